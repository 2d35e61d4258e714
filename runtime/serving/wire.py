"""The openpi wire protocol: msgpack frames with openpi's numpy encoding.

Byte-compatible with ``openpi_client.msgpack_numpy`` so the real openpi client
(and RoboLab, which uses it) talks to this server unchanged: arrays are maps
``{"__ndarray__": True, "data", "dtype", "shape"}`` and numpy scalars
``{"__npgeneric__": True, "data", "dtype"}``.  Decoding is stricter than
openpi's: frames come from the network, so object/void/complex dtypes, shape
and buffer-length mismatches and non-map frames are refused with a
``WireError`` that names the problem instead of crashing a handler.
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


def _check_dtype(dtype: np.dtype) -> None:
    if dtype.kind in _REFUSED_KINDS:
        raise WireError(f"unsupported dtype {dtype.str!r} ({_REFUSED_KINDS[dtype.kind]} arrays are refused)")


def _pack_default(obj: Any) -> Any:
    if isinstance(obj, (np.ndarray, np.generic)):
        _check_dtype(obj.dtype)
    if isinstance(obj, np.ndarray):
        return {b"__ndarray__": True, b"data": np.ascontiguousarray(obj).tobytes(), b"dtype": obj.dtype.str, b"shape": obj.shape}
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
        if not isinstance(shape, (list, tuple)) or len(shape) > MAX_NDIM or not all(
            isinstance(d, int) and d >= 0 for d in shape
        ):
            raise WireError(f"bad array shape {shape!r}")
        if not isinstance(data, (bytes, bytearray)):
            raise WireError("array data must be bytes")
        expected = math.prod(shape) * dtype.itemsize
        if len(data) != expected:
            raise WireError(f"array of shape {tuple(shape)} and dtype {dtype.str} needs {expected} bytes, got {len(data)}")
        return np.ndarray(buffer=data, dtype=dtype, shape=tuple(shape))
    if b"__npgeneric__" in obj or "__npgeneric__" in obj:
        return _wire_dtype(obj, "scalar").type(_get(obj, "data"))
    return obj


packb = functools.partial(msgpack.packb, default=_pack_default, use_bin_type=True)


def unpackb(data: bytes | str) -> Any:
    """Decode one frame; any malformed input, a text frame included, raises WireError (never another type)."""
    if isinstance(data, str):
        raise WireError("expected a binary msgpack frame, got a text frame")
    try:
        return msgpack.unpackb(data, object_hook=_unpack_hook, strict_map_key=False)
    except WireError:
        raise
    except (ValueError, TypeError, OverflowError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        # OverflowError: a scalar whose value does not fit its dtype ({"__npgeneric__", "dtype": "<i8", "data": 2**64-1})
        raise WireError(f"frame is not valid msgpack: {exc}") from exc


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
