"""Test fixtures written as the API's JSON, made into the client's typed models by the operator's own converter.

A fixture states only the fields a test is about (a pod's Ready condition, a
container's exit code).  The API server always writes the fields its schema
requires (a container status's ``image``, ``imageID``, ``ready``,
``restartCount``); ``api_object`` fills those a fixture leaves out with zero
values (``""``, ``0``, ``False``, ``[]``, ``{}``) and then converts with
``kube_objects.typed``, the same call ``observe.py`` makes on what it reads;
``observed_of(...)`` builds a pass's ``Observed`` from such fixtures.
"""

from __future__ import annotations

import datetime
import types
import typing
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import AliasChoices, BaseModel

from policy_operator.operator.kube_objects import typed
from policy_operator.operator.observe import Observed


def _strip(annotation: Any) -> Any:
    """``Optional[X]`` / ``Annotated[X, ...]`` -> X."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
        else:
            return annotation


def _wire_name(name: str, field: Any) -> str:
    alias = field.validation_alias
    if isinstance(alias, AliasChoices):
        return str(alias.choices[0])
    return str(field.alias or name)


def _zero(annotation: Any) -> Any:
    kind = _strip(annotation)
    origin = typing.get_origin(kind)
    if origin is list:
        return []
    if origin is dict:
        return {}
    if isinstance(kind, type) and issubclass(kind, BaseModel):
        return complete(kind, {})
    if kind is datetime.datetime:
        return "2025-01-01T00:00:00Z"
    return {str: "", bool: False, int: 0, float: 0.0}.get(kind, "")


def complete(model: type[BaseModel], data: Mapping[str, Any]) -> dict[str, Any]:
    """``data`` with every field ``model``'s schema requires, at any depth, present (zero values where missing)."""
    out = dict(data)
    for name, field in model.model_fields.items():
        wire = _wire_name(name, field)
        if wire not in out:
            if field.is_required():
                out[wire] = _zero(field.annotation)
            continue
        value, kind = out[wire], _strip(field.annotation)
        origin = typing.get_origin(kind)
        if origin is list and isinstance(value, list):
            item = _strip(typing.get_args(kind)[0])
            if isinstance(item, type) and issubclass(item, BaseModel):
                out[wire] = [complete(item, v) if isinstance(v, Mapping) else v for v in value]
        elif isinstance(kind, type) and issubclass(kind, BaseModel) and isinstance(value, Mapping):
            out[wire] = complete(kind, value)
    return out


def api_object[M: BaseModel](model: type[M], data: Mapping[str, Any]) -> M:
    """A fixture as the client's ``model`` (``V1Pod``...), through the operator's converter."""
    # The client's models are BaseModels that each define from_dict (what typed() needs); no common base declares it
    # and a type variable's bound cannot ask for both, so mypy cannot see that V1Pod... satisfy typed()'s bound.
    return typed(model, complete(model, data))  # type: ignore[type-var]


def api_objects[M: BaseModel](model: type[M], items: Iterable[Mapping[str, Any]]) -> list[M]:
    return [api_object(model, d) for d in items]


def api_object_or_none[M: BaseModel](model: type[M], data: Mapping[str, Any] | None) -> M | None:
    return None if data is None else api_object(model, data)


def _model_of(hint: Any) -> tuple[type[BaseModel] | None, bool]:
    """(the client model a field of ``Observed`` holds, whether it holds a list of them)."""
    kind = _strip(hint)
    if typing.get_origin(kind) is list:
        item = _strip(typing.get_args(kind)[0])
        return (item if isinstance(item, type) and issubclass(item, BaseModel) else None), True
    return (kind if isinstance(kind, type) and issubclass(kind, BaseModel) else None), False


def _as_model(model: type[BaseModel], value: Any) -> Any:
    return value if value is None or isinstance(value, BaseModel) else api_object(model, value)


def observed_field(name: str, value: Any) -> Any:
    """``value`` (the API's JSON, or a list of it) as the field ``name`` of ``Observed`` holds it."""
    model, many = _model_of(typing.get_type_hints(Observed)[name])
    if model is None:
        return value
    return [_as_model(model, v) for v in value] if many else _as_model(model, value)


def observed_of(**children: Any) -> Observed:
    """``Observed`` from fixtures written as the API's JSON (a model already made passes through)."""
    return Observed(**{name: observed_field(name, value) for name, value in children.items()})
