"""The openpi wire protocol: msgpack frames with openpi's numpy encoding.

Byte-compatible with ``openpi_client.msgpack_numpy`` so the real openpi client
(and RoboLab, which uses it) talks to this server unchanged: arrays are maps
``{"__ndarray__": True, "data", "dtype", "shape"}`` and numpy scalars
``{"__npgeneric__": True, "data", "dtype"}``.  Decoding is stricter than
openpi's: frames come from the network, so object/void/complex dtypes, shape
and buffer-length mismatches and non-map frames are refused with a
``WireError`` that names the problem instead of crashing a handler.

Frames are also refused by *structure* while they decode, before they cost
the server memory or seconds: a map of more than ``MAX_MAP_LEN`` entries, a
list of more than ``MAX_ARRAY_LEN``, more than ``MAX_CONTAINERS`` maps and
lists in one frame, nesting deeper than ``MAX_DEPTH``, or any msgpack ext
type.  An observation is a flat map of a few arrays and scalars (ALOHA-style
``{"images": {camera: array}}`` nests three deep); a frame of 300,000 camera
maps or 1,000 nested maps is an attack or a bug, a ``bad_frame`` either way,
and msgpack stops at the first map or list header beyond a limit.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import msgpack
import numpy as np

from policy_operator.runtime.errors import ErrorKind, WireError

_REFUSED_KINDS = {"V": "void", "O": "object", "c": "complex"}
MAX_NDIM = 8
MAX_MAP_LEN = 256  # keys of one map: an observation has a dozen, a camera dict a handful
MAX_ARRAY_LEN = 4096  # items of one list (a state vector sent as a list, an action history)
MAX_CONTAINERS = 512  # maps and lists in one frame, array maps included
MAX_DEPTH = 16  # maps and lists inside each other
MAX_STR_LEN = 1 << 20  # one string (keys, prompts); prompts are capped much lower by validation


def _dtype(value: Any, what: str) -> np.dtype:
    """``value`` as a dtype, refused where the wire carries no such arrays (object, void, complex)."""
    try:
        dtype = np.dtype(value)
    except TypeError as exc:
        raise WireError(f"bad dtype in {what}: {exc}") from exc
    if dtype.kind in _REFUSED_KINDS:
        raise WireError(f"unsupported dtype {dtype.str!r} ({_REFUSED_KINDS[dtype.kind]} arrays are refused)")
    return dtype


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, np.ndarray):
        dtype = _dtype(obj.dtype, "array")
        return {
            b"__ndarray__": True,
            b"data": np.ascontiguousarray(obj).tobytes(),
            b"dtype": dtype.str,
            b"shape": obj.shape,
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": _dtype(obj.dtype, "scalar").str}
    raise TypeError(f"cannot serialize {type(obj).__name__}")


packb = functools.partial(msgpack.packb, default=_pack_default, use_bin_type=True)

_MISSING = object()
_ARRAY_FIELDS: tuple[str, ...] = ("dtype", "shape", "data")
_SCALAR_FIELDS: tuple[str, ...] = ("dtype", "data")


class _Frame:
    """msgpack's object and list hook for one frame (the same one for both): it counts the frame's maps and lists
    as msgpack builds them (bottom-up, once each), and turns array and numpy scalar maps into numpy values.
    openpi packs those maps with bin keys (``b"data"``); other msgpack writers use str keys."""

    left = MAX_CONTAINERS  # the instance's own count shadows this on the first container

    def built(self, obj: dict | list) -> Any:
        self.left -= 1
        if self.left < 0:
            raise WireError(f"frame holds more than {MAX_CONTAINERS} maps and lists")
        if isinstance(obj, list):
            return obj
        if b"__ndarray__" in obj or "__ndarray__" in obj:
            fields = _ARRAY_FIELDS
        elif b"__npgeneric__" in obj or "__npgeneric__" in obj:
            fields = _SCALAR_FIELDS
        else:
            return obj
        values = []
        for key in fields:
            value = obj.get(key.encode(), obj.get(key, _MISSING))
            if value is _MISSING:
                raise WireError(f"array map without {key!r}")
            values.append(value)
        if fields is _SCALAR_FIELDS:
            return _dtype(values[0], "scalar").type(values[1])
        dtype, shape, data = _dtype(values[0], "array"), values[1], values[2]
        if (
            not isinstance(shape, (list, tuple))
            or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and d >= 0 for d in shape)
        ):
            raise WireError(f"bad array shape {shape!r}")
        if not isinstance(data, (bytes, bytearray)):
            raise WireError("array data must be bytes")
        expected = math.prod(shape) * dtype.itemsize
        if len(data) != expected:
            raise WireError(
                f"array of shape {tuple(shape)} and dtype {dtype.str} needs {expected} bytes, got {len(data)}"
            )
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))


def unpackb(data: bytes | str) -> Any:
    """Decode one frame; any malformed input, a text frame included, raises WireError (never another type).

    Nesting is checked after msgpack built the frame (at most ``MAX_CONTAINERS`` containers) with an explicit
    stack, never recursion, so whatever later walks the frame recursively stays far from the recursion limit."""
    if isinstance(data, str):
        raise WireError("expected a binary msgpack frame, got a text frame")
    frame = _Frame()
    try:
        obj = msgpack.unpackb(
            data,
            object_hook=frame.built,
            list_hook=frame.built,
            strict_map_key=False,
            max_map_len=MAX_MAP_LEN,
            max_array_len=MAX_ARRAY_LEN,
            max_str_len=MAX_STR_LEN,
            max_bin_len=len(data),
            max_ext_len=0,
        )
    except WireError:
        raise
    except (
        ValueError,
        TypeError,
        OverflowError,
        RecursionError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        # OverflowError: a scalar whose value does not fit its dtype ({"__npgeneric__", "dtype": "<i8", "data": 2**64-1})
        raise WireError(f"frame is not valid msgpack: {str(exc)[:200]}") from None
    stack = [(obj, 1)] if isinstance(obj, (dict, list)) else []
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise WireError(f"frame nests maps and lists more than {MAX_DEPTH} deep")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return obj


def decode_observation(data: bytes | str) -> dict[str, Any]:
    """A request frame: binary msgpack holding a map with str keys."""
    obj = unpackb(data)
    if not isinstance(obj, dict):
        raise WireError(f"observation must be a map, got {type(obj).__name__}")
    if not all(isinstance(k, str) for k in obj):
        raise WireError("observation keys must be strings")
    return obj


def error_dict(kind: ErrorKind, message: str) -> dict[str, Any]:
    """The documented structured error reply (``--error-format dict``)."""
    return {"type": "error", "error": {"kind": kind.value, "message": message}}
