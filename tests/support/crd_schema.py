"""Check a custom resource against its CRD offline, the way kube-apiserver would.

kube-apiserver applies a CRD's structural defaults, then validates the
``openAPIV3Schema`` (with pruning of unknown fields) and the CEL
``x-kubernetes-validations``.  kubernetes-validate skips custom resources, so
this does the same steps with ``jsonschema`` and ``cel-python``: defaults
first, Kubernetes' OpenAPI extensions converted to plain JSON Schema, unknown
fields reported instead of pruned (kubectl's default strict field validation
refuses them too), and ``type: number`` values handed to CEL as doubles as
Kubernetes does.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import celpy
import jsonschema
import yaml


def load_crd(path: str | Path) -> dict[str, Any]:
    return yaml.safe_load(Path(path).read_text())


def version_schema(crd: dict[str, Any], version: str) -> dict[str, Any]:
    for v in crd["spec"]["versions"]:
        if v["name"] == version:
            return v["schema"]["openAPIV3Schema"]
    raise KeyError(f"CRD {crd['metadata']['name']} has no version {version}")


def to_json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """Kubernetes' structural schema as JSON Schema, closed where kube-apiserver would prune."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties",):
            out[key] = {k: to_json_schema(v) for k, v in value.items()}
        elif key == "additionalProperties" and isinstance(value, dict):
            out[key] = to_json_schema(value)
        elif key == "items":
            out[key] = to_json_schema(value)
        elif key in ("anyOf", "allOf", "oneOf"):
            out[key] = [to_json_schema(v) for v in value]
        elif key == "not":
            out[key] = to_json_schema(value)
        elif key.startswith("x-kubernetes-") or key == "nullable":
            continue
        else:
            out[key] = copy.deepcopy(value)
    if schema.get("nullable") and "type" in out:
        out["type"] = [out["type"], "null"]
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    closed = (
        out.get("type") == "object"
        and "properties" in out
        and "additionalProperties" not in schema
        and not schema.get("x-kubernetes-preserve-unknown-fields")
    )
    if closed:
        out["additionalProperties"] = False
    return out


def apply_defaults(schema: dict[str, Any], obj: Any) -> Any:
    """Structural defaulting: an absent field with a ``default`` gets it, then its own defaults apply."""
    if isinstance(obj, dict):
        result = dict(obj)
        for name, sub in (schema.get("properties") or {}).items():
            if name not in result and "default" in sub:
                result[name] = copy.deepcopy(sub["default"])
            if name in result:
                result[name] = apply_defaults(sub, result[name])
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in result:
                if name not in (schema.get("properties") or {}):
                    result[name] = apply_defaults(extra, result[name])
        return result
    if isinstance(obj, list) and isinstance(schema.get("items"), dict):
        return [apply_defaults(schema["items"], item) for item in obj]
    return obj


def _cel_value(schema: dict[str, Any], obj: Any) -> Any:
    """JSON -> plain values with ``type: number`` as float (Kubernetes hands those to CEL as doubles)."""
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        additional = schema.get("additionalProperties")
        extra: dict[str, Any] = additional if isinstance(additional, dict) else {}
        return {k: _cel_value(props.get(k, extra), v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_cel_value(schema.get("items") or {}, v) for v in obj]
    if schema.get("type") == "number" and isinstance(obj, int) and not isinstance(obj, bool):
        return float(obj)
    return obj


def iter_rules(schema: dict[str, Any], obj: Any, path: str = "") -> Iterator[tuple[str, dict[str, Any], Any]]:
    """(path, rule, value) for every CEL rule whose node is present in ``obj``."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield path or "<root>", rule, _cel_value(schema, obj)
    if isinstance(obj, dict):
        props = schema.get("properties") or {}
        for name, value in obj.items():
            sub = props.get(name)
            if sub is None and isinstance(schema.get("additionalProperties"), dict):
                sub = schema["additionalProperties"]
            if sub is not None:
                yield from iter_rules(sub, value, f"{path}.{name}" if path else name)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for i, item in enumerate(obj):
            yield from iter_rules(schema["items"], item, f"{path}[{i}]")


def all_rules(schema: dict[str, Any]) -> Iterator[str]:
    """Every CEL rule text in a schema, present in an object or not (to check they all compile)."""
    for rule in schema.get("x-kubernetes-validations") or []:
        yield rule["rule"]
    for sub in (schema.get("properties") or {}).values():
        yield from all_rules(sub)
    for key in ("items", "additionalProperties"):
        if isinstance(schema.get(key), dict):
            yield from all_rules(schema[key])


_ENV = celpy.Environment()
_PROGRAMS: dict[str, Any] = {}


def compile_rule(rule: str) -> Any:
    """The CEL program of ``rule`` (raises when it does not compile), compiled once."""
    if rule not in _PROGRAMS:
        _PROGRAMS[rule] = _ENV.program(_ENV.compile(rule))
    return _PROGRAMS[rule]


def eval_rule(rule: str, value: Any) -> bool:
    result = compile_rule(rule).evaluate({"self": celpy.json_to_cel(value)})
    if isinstance(result, Exception):
        raise result
    return bool(result)


def validate(crd: dict[str, Any], obj: dict[str, Any], version: str | None = None) -> list[str]:
    """Errors kube-apiserver would report for ``obj`` (after defaulting), empty when it is accepted."""
    version = version or obj["apiVersion"].split("/")[-1]
    schema = version_schema(crd, version)
    defaulted = apply_defaults(schema, obj)
    json_schema = to_json_schema(schema)
    metadata = json_schema.get("properties", {}).get("metadata")
    if metadata:  # the schema may constrain metadata.name; the rest of ObjectMeta is the apiserver's
        metadata.pop("additionalProperties", None)
    errors = [
        f"{'.'.join(str(p) for p in e.absolute_path) or '<root>'}: {e.message}"
        for e in jsonschema.Draft7Validator(json_schema).iter_errors(defaulted)
    ]
    if errors:  # like kube-apiserver, CEL only runs on schema-valid objects
        return errors
    for path, rule, value in iter_rules(schema, defaulted):
        if not eval_rule(rule["rule"], value):
            errors.append(f"{path}{rule.get('fieldPath', '')}: {rule.get('message', rule['rule'])}")
    return errors
