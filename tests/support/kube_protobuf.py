"""Decode the protobuf request bodies kubectl 1.32 sends for its typed generators.

``kubectl create namespace|configmap|secret|serviceaccount`` POST
``application/vnd.kubernetes.protobuf`` and do not fall back to JSON on 415.
This decodes the ``k8s\\x00`` envelope and the fields of those four kinds (field
numbers from k8s.io/api's generated.proto) into the JSON form; any other kind
raises ``ProtobufUnsupported`` so the emulator answers 415 with a hint to use
``kubectl apply -f``.  Server-owned ObjectMeta fields are skipped.
"""

from __future__ import annotations

import base64
from typing import Any

MAGIC = b"k8s\x00"


class ProtobufUnsupported(ValueError):
    pass


# field number -> (JSON name, how to decode). "meta" is ObjectMeta, "map"/"bmap" are map<string,string|bytes>.
_META = {
    1: ("name", "str"),
    2: ("generateName", "str"),
    3: ("namespace", "str"),
    11: ("labels", "map"),
    12: ("annotations", "map"),
    14: ("finalizers", "strs"),
}
_KINDS: dict[str, dict[int, tuple[str, Any]]] = {
    "Namespace": {1: ("metadata", _META), 2: ("spec", {1: ("finalizers", "strs")})},
    "ConfigMap": {1: ("metadata", _META), 2: ("data", "map"), 3: ("binaryData", "bmap"), 4: ("immutable", "bool")},
    "Secret": {
        1: ("metadata", _META),
        2: ("data", "bmap"),
        3: ("type", "str"),
        4: ("stringData", "map"),
        5: ("immutable", "bool"),
    },
    "ServiceAccount": {1: ("metadata", _META), 4: ("automountServiceAccountToken", "bool")},
}


def _varint(buf: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(buf):
            raise ValueError("truncated varint")
        byte = buf[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, i


def _fields(buf: bytes) -> list[tuple[int, int | bytes]]:
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(buf):
        key, i = _varint(buf, i)
        number, wire = key >> 3, key & 7
        value: int | bytes
        if wire == 0:
            value, i = _varint(buf, i)
        elif wire == 2:
            size, i = _varint(buf, i)
            value, i = buf[i : i + size], i + size
        elif wire in (1, 5):
            size = 8 if wire == 1 else 4
            value, i = buf[i : i + size], i + size
        else:
            raise ValueError(f"unsupported protobuf wire type {wire}")
        out.append((number, value))
    return out


def _decode(buf: bytes, schema: dict[int, tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for number, value in _fields(buf):
        if number not in schema:
            continue
        name, how = schema[number]
        if isinstance(how, dict):
            obj[name] = _decode(bytes(value), how)  # type: ignore[arg-type]
        elif how == "str":
            obj[name] = bytes(value).decode()  # type: ignore[arg-type]
        elif how == "bool":
            obj[name] = bool(value)
        elif how == "strs":
            obj.setdefault(name, []).append(bytes(value).decode())  # type: ignore[arg-type]
        else:  # a map entry: key = 1, value = 2
            entry = dict(_fields(bytes(value)))  # type: ignore[arg-type]
            key, raw = bytes(entry.get(1, b"")).decode(), bytes(entry.get(2, b""))  # type: ignore[arg-type]
            obj.setdefault(name, {})[key] = base64.b64encode(raw).decode() if how == "bmap" else raw.decode()
    return {k: v for k, v in obj.items() if v not in ("", None)}


def decode(body: bytes) -> dict[str, Any]:
    """The JSON form of a protobuf-encoded object; ProtobufUnsupported for kinds outside the table."""
    if not body.startswith(MAGIC):
        raise ProtobufUnsupported("not a Kubernetes protobuf envelope")
    envelope = dict(_fields(body[len(MAGIC) :]))
    type_meta = dict(_fields(bytes(envelope.get(1, b""))))  # type: ignore[arg-type]
    api_version, kind = bytes(type_meta.get(1, b"")).decode(), bytes(type_meta.get(2, b"")).decode()  # type: ignore[arg-type]
    if kind not in _KINDS:
        raise ProtobufUnsupported(
            f"protobuf bodies of kind {kind!r} are not decoded by the emulator; send JSON (kubectl apply -f)"
        )
    raw = bytes(envelope.get(2, b""))  # type: ignore[arg-type]
    return {"apiVersion": api_version, "kind": kind, **_decode(raw, _KINDS[kind])}
