"""Pydantic models that are Kubernetes API types: one definition for admission and for the operator.

A custom resource is checked twice: by kube-apiserver at admission (the CRD's
``openAPIV3Schema``: types, defaults, ``Field`` constraints and CEL rules) and
by the operator before it creates anything (a spec stored before a CRD
upgrade, or written through an API server that skipped a rule, must still not
reach a pod).  Written by hand, those two checks drift.  Here both come from
one class, as controller-gen derives a CRD from Go types and kube-rs from Rust
types:

- ``KubeModel`` is closed (``extra="forbid"``, the apiserver's strict field
  validation), strict about JSON types (``"3"`` is not an integer), camelCase
  on the wire and null-pruning (``null`` means "unset", as the apiserver
  prunes nulls before defaulting).
- Field constraints (``Field(ge=, le=, max_length=, pattern=)``, ``Literal``)
  are pydantic's own, so the model enforces them and the generated schema
  states them.
- ``Rule`` is one CEL rule (``x-kubernetes-validations``): attached to a class
  (``cel_rules``) or to a field's type (``Annotated[str, Rule(...)]``), it is
  written into the schema *and* evaluated by the model with cel-python on the
  same JSON the apiserver would see, so the rule text exists exactly once.
- ``kube_schema(model)`` turns the model's JSON schema into a Kubernetes
  structural schema (no ``$ref``, no titles, no ``additionalProperties:
  false``, ``default: {}`` on sections whose fields have defaults).

Rules must use only standard CEL (no Kubernetes library functions such as
``isQuantity``) because cel-python evaluates them here; every string and list a
rule reads needs ``max_length``/``max_items``, or the apiserver's cost
estimator refuses the CRD.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Final

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    GetCoreSchemaHandler,
    GetJsonSchemaHandler,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue, NoDefault
from pydantic_core import CoreSchema, PydanticCustomError, core_schema

CEL_VALIDATIONS: Final = "x-kubernetes-validations"
PRESERVE_UNKNOWN: Final = "x-kubernetes-preserve-unknown-fields"
INT_OR_STRING: Final = "x-kubernetes-int-or-string"
LIST_TYPE: Final = "x-kubernetes-list-type"
LIST_MAP_KEYS: Final = "x-kubernetes-list-map-keys"
RULE_ERROR: Final = "cel_rule"  # pydantic error type of a failed Rule; ctx carries its fieldPath


# --- CEL rules ----------------------------------------------------------------------------

_PROGRAMS: dict[str, Any] = {}


def _program(rule: str) -> Any:
    program = _PROGRAMS.get(rule)
    if program is None:
        import celpy  # deferred: building the CEL parser costs ~0.3 s, spent on the first spec parsed

        env = celpy.Environment()
        program = _PROGRAMS[rule] = env.program(env.compile(rule))
    return program


@dataclass(frozen=True)
class Rule:
    """One CEL rule: ``self`` is the node it is attached to, after defaulting, as JSON.

    ``field_path`` (``.runtime.guidance``) names the field the message is about,
    relative to that node; the apiserver and ``SpecError`` both report it.
    ``reason`` is the apiserver's error type (``FieldValueForbidden``...).
    """

    rule: str
    message: str
    field_path: str | None = None
    reason: str | None = None

    def as_schema(self) -> dict[str, str]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out

    def holds(self, value: Any) -> bool:
        """The rule's verdict on ``value`` (JSON); an evaluation error counts as a refusal, as in the apiserver."""
        import celpy

        result = _program(self.rule).evaluate({"self": celpy.json_to_cel(value)})
        return not isinstance(result, Exception) and bool(result)

    def check(self, value: Any) -> None:
        if not self.holds(value):
            raise PydanticCustomError(
                RULE_ERROR, "{message}", {"message": self.message, "field_path": self.field_path or ""}
            )

    # As ``Annotated`` metadata on a field's type: validated after the type, written into its schema.
    def __get_pydantic_core_schema__(self, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        def check(value: Any) -> Any:
            self.check(value.to_api() if isinstance(value, KubeModel) else value)
            return value

        return core_schema.no_info_after_validator_function(check, handler(source))

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(schema)
        json_schema.setdefault(CEL_VALIDATIONS, []).append(self.as_schema())
        return json_schema


# --- the base class -----------------------------------------------------------------------


class KubeModel(BaseModel):
    """A closed, strict, camelCase Kubernetes object section whose ``cel_rules`` hold after validation."""

    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        frozen=True,
        alias_generator=to_camel,
        populate_by_name=True,
        use_attribute_docstrings=True,
        allow_inf_nan=False,
    )

    cel_rules: ClassVar[tuple[Rule, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _prune_nulls(cls, data: Any) -> Any:
        # kube-apiserver drops a null field of a non-nullable schema before defaulting: null means unset
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None}
        return data

    @model_validator(mode="after")
    def _check_rules(self) -> KubeModel:
        rules = vars(type(self)).get("cel_rules", ())
        if rules:
            value = self.to_api()
            for rule in rules:
                rule.check(value)
        return self

    @classmethod
    def __get_pydantic_json_schema__(cls, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        json_schema = handler(schema)
        rules = vars(cls).get("cel_rules", ())
        if rules:
            handler.resolve_ref_schema(json_schema)[CEL_VALIDATIONS] = [r.as_schema() for r in rules]
        return json_schema

    def to_api(self) -> dict[str, Any]:
        """The object as the API server stores it: camelCase, unset fields left out."""
        return self.model_dump(mode="json", by_alias=True, exclude_none=True)


# --- field types and markers ----------------------------------------------------------------

PATTERN_NAMES: dict[str, str] = {}  # regex -> what it means, for messages and docs/crd.md


def named_pattern(regex: str, name: str) -> str:
    """Register a regex under a readable name (error messages and the field table say the name)."""
    PATTERN_NAMES[regex] = name
    return regex


# resource.Quantity's grammar (controller-gen writes the same pattern), without the sign: no
# size or request here may be negative.
QUANTITY_PATTERN: Final = named_pattern(
    r"^\+?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$",
    "a quantity such as 500m, 4Gi or 2",
)


def _quantity(value: Any) -> Any:
    import re

    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return str(value)
    if isinstance(value, str) and re.fullmatch(QUANTITY_PATTERN, value):
        return value
    raise PydanticCustomError("quantity", "must be a quantity such as 500m, 4Gi or 2")


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    WithJsonSchema(
        {INT_OR_STRING: True, "anyOf": [{"type": "integer"}, {"type": "string"}], "pattern": QUANTITY_PATTERN}
    ),
]
"""A Kubernetes quantity (``4Gi``, ``500m``, ``2``), as the int-or-string the API accepts; kept as a string."""

KUBE_TYPE: Final = "x-policy-operator-kube-type"  # never in the CRD: crd.py replaces the node


def kube_type_schema(definition: str) -> dict[str, Any]:
    """The schema of a Kubernetes type passed through unchanged (``io.k8s.api.core.v1.Affinity``).

    The model keeps it as a dict (the operator copies it into pod specs as is);
    the CRD generator embeds Kubernetes' own schema of the type in its place, so
    the apiserver refuses an unknown or mistyped field at admission.
    """
    return {"type": "object", PRESERVE_UNKNOWN: True, KUBE_TYPE: definition}


Affinity = Annotated[dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.Affinity"))]
Toleration = Annotated[dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.Toleration"))]
EnvVarSource = Annotated[dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.EnvVarSource"))]
TopologySpreadConstraint = Annotated[
    dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.TopologySpreadConstraint"))
]
Volume = Annotated[dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.Volume"))]
VolumeMount = Annotated[dict[str, Any], WithJsonSchema(kube_type_schema("io.k8s.api.core.v1.VolumeMount"))]


def list_map(*keys: str) -> dict[str, Any]:
    """``json_schema_extra`` of a list merged by key (server-side apply; duplicate keys refused)."""
    return {LIST_TYPE: "map", LIST_MAP_KEYS: list(keys)}


LIST_SET: Final[dict[str, Any]] = {LIST_TYPE: "set"}


# --- pydantic JSON schema -> Kubernetes structural schema -----------------------------------


class _KubeJsonSchema(GenerateJsonSchema):
    """Pydantic's generator, minus what a structural schema may not say."""

    def sort(self, value: JsonSchemaValue, parent_key: str | None = None) -> JsonSchemaValue:
        return value  # keep the model's field order (and a rule's rule-before-message) in the CRD and the docs

    def field_title_should_be_set(self, schema: Any) -> bool:
        return False

    def nullable_schema(self, schema: core_schema.NullableSchema) -> JsonSchemaValue:
        return self.generate_inner(schema["schema"])  # an optional field is one left out, never null

    def get_default_value(self, schema: core_schema.WithDefaultSchema) -> Any:
        factory: Callable[[], Any] | None = schema.get("default_factory")  # type: ignore[assignment]
        if factory is not None:
            # a section whose fields have defaults defaults to {}, so the apiserver fills those in too
            made = factory()
            if isinstance(made, KubeModel) and any(v not in ({}, []) for v in made.to_api().values()):
                return {}
            return NoDefault
        default = schema.get("default", NoDefault)
        return NoDefault if default is None else default


# Keys of a schema node in the order a reader wants them (the rest keep pydantic's order, after these).
_KEY_ORDER = (
    "type",
    "description",
    "default",
    "required",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "maxItems",
    "maxProperties",
    "format",
    INT_OR_STRING,
    "anyOf",
    PRESERVE_UNKNOWN,
    LIST_TYPE,
    LIST_MAP_KEYS,
    CEL_VALIDATIONS,
    "properties",
    "additionalProperties",
    "items",
)


def ordered_keys(node: dict[str, Any]) -> dict[str, Any]:
    """``node`` with its keys in reading order (type, description, default, bounds..., properties)."""
    first = {key: node[key] for key in _KEY_ORDER if key in node}
    return {**first, **{k: v for k, v in node.items() if k not in first}}


def _inline(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_inline(item, defs) for item in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].rsplit("/", 1)[-1]])
        overrides = {k: v for k, v in node.items() if k != "$ref"}  # the field's description, default...
        node = {**target, **overrides}
    out: dict[str, Any] = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _inline(sub, defs) for name, sub in value.items()}
        elif key in ("title", "$defs") or (key == "additionalProperties" and value is False):
            continue
        elif key == "const":
            out["enum"] = [value]
        elif key == "description":
            out[key] = " ".join(value.split())  # docstrings are wrapped; kubectl explain wraps by itself
        else:
            out[key] = _inline(value, defs)
    return ordered_keys(out)


def kube_schema(model: type[BaseModel]) -> dict[str, Any]:
    """The structural schema of ``model`` (aliases, constraints, defaults, rules, extensions), refs inlined."""
    raw = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_KubeJsonSchema)
    schema: dict[str, Any] = _inline(raw, raw.get("$defs", {}))
    return schema
