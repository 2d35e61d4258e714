"""Kubernetes objects as read from the API and as built to write, typed: the installed client's own models.

``Kube`` speaks plain dicts (the dynamic client's JSON, the informer's
stores, server-side apply bodies), which is what writing needs.  What a pass
*reads* is handed on typed, so a reader writes ``pod.status.container_statuses``
and mypy knows which fields exist and which may be absent, instead of chains
of ``.get(...) or {}`` over ``dict[str, Any]``.

The models are the installed ``kubernetes`` client's (``V1Pod``,
``V1StatefulSet``...): in the client the operator pins (37) they are pydantic
models generated from the official OpenAPI schema, and each has a public
``from_dict`` that takes the API's JSON as is (camelCase keys, unknown fields
left out, RFC 3339 timestamps parsed to aware datetimes).  That is the one
conversion used here: no private ``ApiClient`` deserializer (its public
``deserialize`` wants a response object and re-parses JSON text), and no
second, hand-written model of the same schema.  It costs about 1 ms for a
full pod, so a pass over a PolicyServer's children (tens of objects) spends
tens of milliseconds on it.  Fields the schema requires (a container status's
``image``, a condition's ``type``) must be present, as the API server always
writes them; an object that lacks them is refused here with pydantic's
``ValidationError`` rather than half-read later.  ``api_json`` turns a model
back into the API's JSON: where a diff against an applied body needs it, and
once at the end of each builder in manifests.py, which makes what it writes
from the same models.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

from kubernetes.client import V1ObjectMeta
from pydantic import BaseModel


class _FromDict(Protocol):
    @classmethod
    def from_dict(cls, obj: dict[str, Any] | None) -> Any: ...


EMPTY_META = V1ObjectMeta()  # the metadata of an object that has none: every field unset


def typed[M: _FromDict](model: type[M], obj: Mapping[str, Any]) -> M:
    """``obj`` (the API's JSON) as the client's ``model``."""
    made = model.from_dict(dict(obj))
    assert isinstance(made, model)
    return made


def typed_or_none[M: _FromDict](model: type[M], obj: Mapping[str, Any] | None) -> M | None:
    """``typed``, passing None (an object that does not exist) through."""
    return None if obj is None else typed(model, obj)


def typed_list[M: _FromDict](model: type[M], objs: Iterable[Mapping[str, Any]]) -> list[M]:
    return [typed(model, obj) for obj in objs]


class HasMetadata(Protocol):
    @property
    def metadata(self) -> V1ObjectMeta | None: ...


def meta_of(obj: HasMetadata | None) -> V1ObjectMeta:
    """The object's metadata; every field unset when there is no object or no metadata."""
    return (obj.metadata if obj is not None else None) or EMPTY_META


def rfc3339(when: datetime.datetime | None) -> str:
    """A timestamp as the API writes it (``2025-01-01T00:00:00Z``: UTC, whole seconds, orders as text); "" if None."""
    if when is None:
        return ""
    if when.tzinfo is not None:
        when = when.astimezone(datetime.UTC)
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def api_json(obj: BaseModel) -> dict[str, Any]:
    """A typed object back as the API's JSON (camelCase, unset fields left out), e.g. to diff it against a body."""
    return obj.model_dump(mode="json", by_alias=True, exclude_none=True)


def passthrough[M: _FromDict](model: type[M], obj: Mapping[str, Any]) -> M:
    """``typed`` for a section the operator copies from the PolicyServer into an object it builds (a user's
    affinity, tolerations, volumes, env): refused with ValueError when the model would not give back the very JSON
    it was made from (a field the installed client does not know), so such a section is never altered on its way
    into an apply body."""
    made = typed(model, obj)
    assert isinstance(made, BaseModel)
    if api_json(made) != obj:
        raise ValueError(f"{model.__name__}: the client's model does not keep {dict(obj)!r} as it is")
    return made
