"""A pickle reader that builds only what LeRobot's robot_client sends: its messages and plain data, nothing that runs.

LeRobot's ``AsyncInference`` service carries pickles: the robot's
``RemotePolicyConfig`` (``SendPolicyInstructions``) and every
``TimedObservation`` (``SendObservations``).  LeRobot's own ``policy_server``
reads them with ``pickle.loads``, so any client that reaches its port runs any
code it likes there (a ``__reduce__`` naming ``os.system``).  Here every global
a pickle names is looked up in an allowlist (``pickle.Unpickler.find_class``)
instead of imported: LeRobot's message classes, the plain types they carry
(dicts, lists, numbers and strings need no global), numpy arrays and scalars,
and torch tensors.  Anything else stops the read with ``RefusedPickle``
before a single call it asks for is made.

A torch tensor pickles its storage as ``torch.storage._load_from_bytes`` of a
``torch.save`` blob, which torch reads with ``weights_only=False`` -- a second,
unrestricted pickle inside the first.  The allowlist maps that name to a reader
with ``weights_only=True`` (torch's own restricted unpickler) instead.
"""

from __future__ import annotations

import collections
import io
import pickle
from collections.abc import Mapping
from typing import Any

from policy_operator.runtime.errors import ErrorKind, RequestError


class RefusedPickle(RequestError, ValueError):
    """A pickle named something that is neither one of LeRobot's messages nor plain data: nothing of it ran."""

    kind = ErrorKind.BAD_FRAME


def _storage_from_bytes(data: bytes) -> Any:
    """``torch.storage._load_from_bytes`` without its unrestricted unpickler."""
    import torch

    if not isinstance(data, bytes):
        raise RefusedPickle(f"a tensor's storage must be bytes, got {type(data).__name__}")
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        raise RefusedPickle(f"a tensor's storage was refused by torch's weights-only reader: {exc}") from None


_NDARRAY = ("numpy", "ndarray")  # a name, not the class: ``numpy.ndarray(shape)`` would allocate whatever it asks


def _array_shell(subtype: Any, shape: Any, dtype: Any) -> Any:
    """numpy's ``_reconstruct`` as numpy's own pickles call it (an empty array that ``__setstate__`` fills from
    the pickle's bytes), and nothing larger."""
    import numpy as np
    from numpy._core import multiarray

    if subtype is not _NDARRAY or tuple(shape) != (0,):
        raise RefusedPickle("an array in the pickle is not built the way numpy pickles arrays")
    return multiarray._reconstruct(np.ndarray, shape, dtype)


def plain_data_globals() -> dict[tuple[str, str], Any]:
    """The globals a pickle of plain data may name: numpy arrays, dtypes and scalars (under numpy 1's and 2's
    module names: a robot may run either), torch tensors rebuilt from their storage, ``OrderedDict`` (a tensor's
    hooks), sets and complex numbers."""
    import numpy as np
    import torch
    from numpy._core import multiarray

    found: dict[tuple[str, str], Any] = {
        _NDARRAY: _NDARRAY,
        ("numpy", "dtype"): np.dtype,
        ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
        ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "complex"): complex,
    }
    for module in ("numpy._core.multiarray", "numpy.core.multiarray"):
        found[(module, "_reconstruct")] = _array_shell
        found[(module, "scalar")] = multiarray.scalar
    # numpy's dtypes pickle as numpy.dtype(...) or, for some, as their class (numpy.dtypes.Float32DType)
    for name in dir(np.dtypes):
        if name.endswith("DType"):
            found[("numpy.dtypes", name)] = getattr(np.dtypes, name)
    # torch's scalar types appear as globals (torch.float32) in tensors pickled by some versions
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int64, torch.bool):
        found[("torch", str(dtype).removeprefix("torch."))] = dtype
    return found


class _AllowlistUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Mapping[tuple[str, str], Any], what: str) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed
        self.what = what

    def find_class(self, module: str, name: str) -> Any:
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise RefusedPickle(
                f"{self.what} refused: its pickle names {module}.{name}, which is neither LeRobot's message nor "
                "plain data (dicts, lists, numbers, strings, numpy arrays, torch tensors); nothing of it ran"
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        raise RefusedPickle(f"{self.what} refused: its pickle refers to a persistent id")


def restricted_loads(data: bytes, allowed: Mapping[tuple[str, str], Any], what: str) -> Any:
    """The object ``data`` pickles, built from ``allowed`` globals only; ``RefusedPickle`` for anything else,
    for a pickle that does not parse, and for any error while the allowed constructors run."""
    try:
        return _AllowlistUnpickler(data, allowed, what).load()
    except RefusedPickle:
        raise
    except Exception as exc:  # noqa: BLE001 - a malformed pickle fails its request, whatever broke in it
        raise RefusedPickle(f"{what} is not a readable pickle: {type(exc).__name__}: {exc}") from None
