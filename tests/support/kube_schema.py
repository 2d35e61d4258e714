"""What kube-apiserver does to a custom resource with its CRD's ``openAPIV3Schema``.

On every write it prunes fields the structural schema does not declare,
applies ``default:`` values and rejects objects that do not validate (422).
Plain kmock stores whatever arrives, so an operator writing an undeclared
``status`` field (a classic kopf gotcha: handler results land in
``status.<handler-id>``) would pass tests and lose the field on a real cluster.
Validation goes through ``jsonschema`` after converting the Kubernetes dialect
(``nullable``, ``x-kubernetes-int-or-string``); CEL rules
(``x-kubernetes-validations``) and ``format`` checks are not evaluated.
"""

from __future__ import annotations

import copy
import json
import re
from typing import Any

import jsonschema

_ROOT_KEPT = ("apiVersion", "kind", "metadata")


def prune(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Drop, in place, every field the structural schema does not declare; return their paths.

    apiVersion/kind/metadata always stay.  The paths feed ``fieldValidation=Strict``
    (kubectl's default), which turns them into an error instead.
    """
    dropped: list[str] = []
    for key in list(obj):
        if key not in _ROOT_KEPT:
            _prune_field(obj, key, schema, key, dropped)
    return dropped


def _prune_field(parent: dict[str, Any], key: str, schema: dict[str, Any], path: str, dropped: list[str]) -> None:
    sub = _child_schema(schema, key)
    if sub is None:
        del parent[key]
        dropped.append(path)
    else:
        parent[key] = _prune_value(parent[key], sub, path, dropped)


def _child_schema(schema: dict[str, Any], key: str) -> dict[str, Any] | None:
    props = schema.get("properties") or {}
    if key in props:
        return props[key]
    extra = schema.get("additionalProperties")
    if isinstance(extra, dict):
        return extra
    if extra is True or schema.get("x-kubernetes-preserve-unknown-fields"):
        return {"x-kubernetes-preserve-unknown-fields": True}
    return None


def _prune_value(value: Any, schema: dict[str, Any], path: str, dropped: list[str]) -> Any:
    if isinstance(value, dict):
        if (
            schema.get("x-kubernetes-preserve-unknown-fields")
            and not schema.get("properties")
            and "additionalProperties" not in schema
        ):
            return value
        if schema.get("type") not in (None, "object") and not schema.get("x-kubernetes-preserve-unknown-fields"):
            return value  # a type mismatch is for validation to report, not for pruning to hide
        kept = _ROOT_KEPT if schema.get("x-kubernetes-embedded-resource") else ()
        for key in list(value):
            if key not in kept:
                _prune_field(value, key, schema, f"{path}.{key}", dropped)
        return value
    if isinstance(value, list) and isinstance(schema.get("items"), dict):
        return [_prune_value(item, schema["items"], f"{path}[{n}]", dropped) for n, item in enumerate(value)]
    return value


def apply_defaults(obj: Any, schema: dict[str, Any]) -> None:
    """Fill absent fields that declare ``default:``, recursively, in place (as kube-apiserver defaults CRs)."""
    if isinstance(obj, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if key not in obj and "default" in sub:
                obj[key] = copy.deepcopy(sub["default"])
            if key in obj:
                apply_defaults(obj[key], sub)
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for key in obj:
                if key not in (schema.get("properties") or {}):
                    apply_defaults(obj[key], extra)
    elif isinstance(obj, list) and isinstance(schema.get("items"), dict):
        for item in obj:
            apply_defaults(item, schema["items"])


def validate(obj: dict[str, Any], schema: dict[str, Any]) -> list[str]:
    """Return kube-style causes (``spec.replicas: Invalid value: ...``); empty when the object is valid."""
    root = dict(to_json_schema(schema))
    root["properties"] = {k: v for k, v in (root.get("properties") or {}).items() if k != "metadata"}
    validator = jsonschema.Draft4Validator(root)
    causes = []
    for error in sorted(validator.iter_errors(obj), key=lambda e: [str(p) for p in e.absolute_path]):
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error.absolute_path).lstrip(".") or "<root>"
        if error.validator == "required":
            missing = re.search(r"'(.*)' is a required property", error.message)
            causes.append(f"{path}.{missing[1] if missing else '?'}: Required value".removeprefix("<root>."))
        elif error.validator == "enum":
            allowed = ", ".join(json.dumps(v) for v in error.validator_value)
            causes.append(f"{path}: Unsupported value: {json.dumps(error.instance)}: supported values: {allowed}")
        else:
            causes.append(f"{path}: Invalid value: {json.dumps(error.instance)[:120]}: {error.message}")
    return causes


def to_json_schema(schema: Any) -> Any:
    """Translate the OpenAPI v3 dialect of CRDs into draft-4 JSON Schema that ``jsonschema`` checks."""
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in ("properties", "patternProperties", "definitions") and isinstance(value, dict):
            out[key] = {name: to_json_schema(sub) for name, sub in value.items()}
        elif key in ("items", "additionalProperties", "not"):
            out[key] = to_json_schema(value)
        elif key in ("allOf", "anyOf", "oneOf") and isinstance(value, list):
            out[key] = [to_json_schema(sub) for sub in value]
        elif key.startswith("x-kubernetes-") or key in ("nullable", "format", "default", "example", "externalDocs"):
            continue
        else:
            out[key] = value
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out.setdefault("anyOf", [{"type": "integer"}, {"type": "string"}])
    if schema.get("nullable"):
        if "type" in out:
            out["type"] = [out["type"], "null"]
        if "enum" in out:
            out["enum"] = [*out["enum"], None]
    return out
