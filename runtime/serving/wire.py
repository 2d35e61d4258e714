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


def _check_dtype(dtype: np.dtype) -> None:
    if dtype.kind in _REFUSED_KINDS:
        raise WireError(f"unsupported dtype {dtype.str!r} ({_REFUSED_KINDS[dtype.kind]} arrays are refused)")


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        _check_dtype(obj.dtype)
    if isinstance(obj, np.ndarray):
        return {
            b"__ndarray__": True,
            b"data": np.ascontiguousarray(obj).tobytes(),
            b"dtype": obj.dtype.str,
            b"shape": obj.shape,
        }
    if isinstance(obj, np.generic):
        return {b"__npgeneric__": True, b"data": obj.item(), b"dtype": obj.dtype.str}
    raise TypeError(f"cannot serialize {type(obj).__name__}")


def _get(obj: dict, key: str) -> Any:
    # openpi packs with bin keys (b"data"); other msgpack writers use str keys.
    if key.encode() in obj:
        return obj[key.encode()]
    if key in obj:
        return obj[key]
    raise WireError(f"array map without {key!r}")


def _wire_dtype(obj: dict, what: str) -> np.dtype:
    try:
        dtype = np.dtype(_get(obj, "dtype"))
    except TypeError as exc:
        raise WireError(f"bad dtype in {what}: {exc}") from exc
    _check_dtype(dtype)
    return dtype


def _unpack_hook(obj: dict) -> Any:
    if b"__ndarray__" in obj or "__ndarray__" in obj:
        dtype = _wire_dtype(obj, "array")
        shape = _get(obj, "shape")
        data = _get(obj, "data")
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
    if b"__npgeneric__" in obj or "__npgeneric__" in obj:
        return _wire_dtype(obj, "scalar").type(_get(obj, "data"))
    return obj


packb = functools.partial(msgpack.packb, default=_pack_default, use_bin_type=True)


class _Budget:
    """Counts the maps and lists of one frame as msgpack builds them (its hooks run bottom-up, once each)."""

    __slots__ = ("left",)

    def __init__(self) -> None:
        self.left = MAX_CONTAINERS

    def _spend(self) -> None:
        self.left -= 1
        if self.left < 0:
            raise WireError(f"frame holds more than {MAX_CONTAINERS} maps and lists")

    def map(self, obj: dict) -> Any:
        self._spend()
        return _unpack_hook(obj)

    def list(self, obj: list) -> Any:
        self._spend()
        return obj


def _check_depth(obj: Any) -> None:
    """Nesting at most ``MAX_DEPTH``: an explicit stack (at most MAX_CONTAINERS entries), never recursion, so
    whatever later walks the frame recursively stays far from Python's recursion limit."""
    stack = [(obj, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise WireError(f"frame nests maps and lists more than {MAX_DEPTH} deep")
        children = item.values() if isinstance(item, dict) else item
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))


def unpackb(data: bytes | str) -> Any:
    """Decode one frame; any malformed input, a text frame included, raises WireError (never another type)."""
    if isinstance(data, str):
        raise WireError("expected a binary msgpack frame, got a text frame")
    budget = _Budget()
    try:
        obj = msgpack.unpackb(
            data,
            object_hook=budget.map,
            list_hook=budget.list,
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
    if isinstance(obj, (dict, list)):
        _check_depth(obj)
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
