"""Label and field selectors, parsed and matched the way kube-apiserver does.

LIST and WATCH apply them on the server: ``kubectl get -l``, kopf's label
filters and ``kubectl wait``/``delete`` (which select by ``metadata.name``)
all depend on that, and plain kmock ignores them.  A malformed selector is a
``SelectorError`` (the emulator answers 400), never a silent match-all.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector string that kube-apiserver would reject with 400 BadRequest."""


# Label keys: an optional DNS-subdomain prefix and a name segment (apimachinery's validation).
_LABEL_KEY = re.compile(
    r"^(?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*/)?" r"[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?$"
)
_LABEL_VALUE = re.compile(r"^(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?$")
_REQUIREMENT = re.compile(
    r"""\s*(?:
        !\s*(?P<absent>[^\s!=,()<>]+)
      | (?P<key>[^\s!=,()<>]+)\s*(?:
            \s(?P<setop>in|notin)\s*\((?P<values>[^()]*)\)
          | (?P<op>==|=|!=|<|>)\s*(?P<value>[^\s,()!=<>]*)
        )?
    )\s*(?:,|$)""",
    re.VERBOSE,
)


@dataclass(frozen=True)
class Requirement:
    """One comma-separated term of a label selector."""

    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", ">", "<"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op == "=":
            return present and value == self.values[0]
        if self.op == "!=":
            return not present or value != self.values[0]
        if self.op == "in":
            return present and value in self.values
        if self.op == "notin":
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        try:  # ">" and "<" compare integers; a non-integer label simply does not match
            number, bound = int(value or ""), int(self.values[0])
        except ValueError:
            return False
        return number > bound if self.op == ">" else number < bound


def parse_label_selector(text: str | None) -> list[Requirement]:
    """Parse ``a=b,c!=d,e in (f,g),h notin (i),j,!k,l>3`` into requirements (all must match)."""
    requirements: list[Requirement] = []
    text = (text or "").strip()
    pos = 0
    while pos < len(text):
        m = _REQUIREMENT.match(text, pos)
        if not m or m.end() == pos:
            raise SelectorError(f"unable to parse requirement at {text[pos:]!r} in label selector {text!r}")
        pos = m.end()
        if m["absent"]:
            requirements.append(Requirement(_check_key(m["absent"], text), "!"))
        elif m["setop"]:
            values = tuple(v.strip() for v in m["values"].split(",") if v.strip())
            if not values:
                raise SelectorError(f"{m['setop']!r} needs at least one value in label selector {text!r}")
            requirements.append(Requirement(_check_key(m["key"], text), m["setop"], tuple(_check_value(v, text) for v in values)))
        elif m["op"]:
            op = "=" if m["op"] == "==" else m["op"]
            value = _check_value(m["value"], text)
            if op in "<>" and not re.fullmatch(r"-?\d+", value):
                raise SelectorError(f"{op!r} needs an integer value in label selector {text!r}")
            requirements.append(Requirement(_check_key(m["key"], text), op, (value,)))
        else:
            requirements.append(Requirement(_check_key(m["key"], text), "exists"))
        if text[pos - 1 : pos] == "," and pos == len(text):
            raise SelectorError(f"trailing comma in label selector {text!r}")
    return requirements


def _check_key(key: str, text: str) -> str:
    if len(key.rsplit("/", 1)[-1]) > 63 or not _LABEL_KEY.match(key):
        raise SelectorError(f"invalid label key {key!r} in label selector {text!r}")
    return key


def _check_value(value: str, text: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise SelectorError(f"invalid label value {value!r} in label selector {text!r}")
    return value


def metadata_problems(meta: Mapping[str, Any]) -> list[str]:
    """Why kube-apiserver would reject these labels/annotations (422 causes); empty when they are valid."""
    causes = []
    for field in ("labels", "annotations"):
        values = meta.get(field) or {}
        if not isinstance(values, Mapping):
            causes.append(f"metadata.{field}: Invalid value: must be a map of strings")
            continue
        for key, value in values.items():
            try:
                _check_key(str(key), f"metadata.{field}")
            except SelectorError:
                causes.append(
                    f"metadata.{field}: Invalid value: {key!r}: a qualified name must be an optional DNS-subdomain prefix "
                    "and '/' and a name of at most 63 alphanumeric characters, '-', '_' or '.', "
                    "starting and ending with an alphanumeric"
                )
            if not isinstance(value, str):
                causes.append(f"metadata.{field}: Invalid value: {key}={value!r}: values must be strings")
            elif field == "labels" and (len(value) > 63 or not _LABEL_VALUE.match(value)):
                causes.append(
                    f"metadata.labels: Invalid value: {value!r}: a valid label value must be 63 characters or less, "
                    "empty or alphanumeric characters, '-', '_' or '.', starting and ending with an alphanumeric"
                )
    return causes


def labels_match(requirements: list[Requirement], obj: Mapping[str, Any]) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(r.matches(labels) for r in requirements)


@dataclass(frozen=True)
class FieldRequirement:
    path: str  # dotted, e.g. "metadata.name", "status.phase", "involvedObject.uid"
    equal: bool
    value: str


def parse_field_selector(text: str | None) -> list[FieldRequirement]:
    """Parse ``metadata.name=x,status.phase!=Running``; ``\\,`` and ``\\=`` escape literals."""
    requirements: list[FieldRequirement] = []
    for term in re.split(r"(?<!\\),", (text or "").strip()):
        term = term.strip()
        if not term:
            if text and text.strip():
                raise SelectorError(f"empty term in field selector {text!r}")
            continue
        m = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*(==|=|!=)\s*(.*)", term)
        if not m:
            raise SelectorError(f"invalid field selector term {term!r}: expected field=value, field==value or field!=value")
        value = re.sub(r"\\(.)", r"\1", m[3])
        requirements.append(FieldRequirement(m[1], m[2] != "!=", value))
    return requirements


def field_value(obj: Mapping[str, Any], path: str) -> str:
    """A field as a field selector sees it: missing fields are "" and booleans are lowercase."""
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, Mapping) else None
        if value is None:
            return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return value if isinstance(value, str) else str(value)


def fields_match(requirements: list[FieldRequirement], obj: Mapping[str, Any]) -> bool:
    return all((field_value(obj, r.path) == r.value) == r.equal for r in requirements)


def label_selector_to_string(selector: Mapping[str, Any] | None) -> str:
    """Render a LabelSelector object (matchLabels/matchExpressions) as a selector string, as Scale.status does."""
    if not selector:
        return ""
    if "matchLabels" not in selector and "matchExpressions" not in selector:  # a plain map (ReplicationController)
        return ",".join(f"{k}={v}" for k, v in sorted(selector.items()))
    terms = [f"{k}={v}" for k, v in sorted((selector.get("matchLabels") or {}).items())]
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr.get("key"), expr.get("operator"), expr.get("values") or []
        if op == "In":
            terms.append(f"{key} in ({','.join(sorted(values))})")
        elif op == "NotIn":
            terms.append(f"{key} notin ({','.join(sorted(values))})")
        elif op == "Exists":
            terms.append(str(key))
        elif op == "DoesNotExist":
            terms.append(f"!{key}")
    return ",".join(terms)
