"""LeRobot's own observation keys on the openpi wire, checked before anything else sees them.

A robot recorded with LeRobot sends what its dataset holds: ``observation.state``
(and ``observation.environment_state``) as float vectors, each camera as
``observation.images.<camera>`` (or ``observation.image``) -- uint8 HWC as
cameras deliver frames, or float CHW in [0, 1] as LeRobot's datasets decode
them -- and the instruction as ``task`` for the vision-language families.
The metadata frame lists the expected keys with their shapes, so a client
can build a frame from it.  The set of observation keys must be exact: a
missing camera or a misspelt key is ``invalid_observation`` naming the
expected keys.  Other keys (``seed``, ``session_id``...) are left to the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy_operator.runtime.errors import InvalidObservation
from policy_operator.runtime.policy.observation import check_state_values

TASK_KEY = "task"
OBSERVATION_PREFIX = "observation."
MAX_TASK_CHARS = 2048


@dataclass(frozen=True)
class Feature:
    key: str
    kind: str  # VISUAL, STATE, ENV
    shape: tuple[int, ...]  # a camera's is (C, H, W)

    def describe(self) -> dict[str, Any]:
        if self.kind == "VISUAL":
            c, h, w = self.shape
            return {"shape": [h, w, c], "dtype": "uint8", "or": {"shape": [c, h, w], "dtype": "float32 in [0, 1]"}}
        return {"shape": list(self.shape), "dtype": "float32"}


class ObservationSpec:
    """The observation a LeRobot config expects, from its ``input_features``."""

    def __init__(self, input_features: Mapping[str, Any], *, needs_task: bool) -> None:
        self.features = tuple(
            Feature(key, str(f.type.name), tuple(int(d) for d in f.shape)) for key, f in sorted(input_features.items())
        )
        self.needs_task = needs_task
        self.keys = frozenset(f.key for f in self.features) | ({TASK_KEY} if needs_task else set())

    def describe(self) -> dict[str, Any]:
        keys: dict[str, Any] = {f.key: f.describe() for f in self.features}
        if self.needs_task:
            keys[TASK_KEY] = {"dtype": "str"}
        return keys

    def _key_error(self, obs: Mapping[str, Any]) -> InvalidObservation | None:
        given = {k for k in obs if isinstance(k, str) and (k.startswith(OBSERVATION_PREFIX) or k == TASK_KEY)}
        missing, unexpected = sorted(self.keys - given), sorted(given - self.keys)
        if not missing and not unexpected:
            return None
        parts = [f"missing {missing}"] if missing else []
        parts += [f"unexpected {unexpected}"] if unexpected else []
        return InvalidObservation(f"{'; '.join(parts)}: this policy takes exactly {sorted(self.keys)}")

    def parse(self, obs: Any, *, raw_images: bool = False) -> dict[str, Any]:
        """LeRobot's unbatched frame (CPU tensors, the task string); InvalidObservation naming what is wrong.

        ``raw_images``: a uint8 camera frame stays uint8 HWC (the device converts it: staging.py)."""
        if not isinstance(obs, Mapping):
            raise InvalidObservation(f"observation must be a dict, got {type(obs).__name__}")
        error = self._key_error(obs)
        if error is not None:
            raise error
        frame: dict[str, Any] = {}
        for f in self.features:
            frame[f.key] = _image(f, obs[f.key], raw_images) if f.kind == "VISUAL" else _vector(f, obs[f.key])
        if self.needs_task:
            task = obs[TASK_KEY]
            if not isinstance(task, str):
                raise InvalidObservation(f"{TASK_KEY!r} must be a string, got {type(task).__name__}")
            if len(task) > MAX_TASK_CHARS:
                raise InvalidObservation(f"{TASK_KEY!r} is {len(task)} characters; at most {MAX_TASK_CHARS}")
            frame[TASK_KEY] = task
        return frame

    def example(self, seed: int = 0, task: str = "pick up the cube") -> dict[str, Any]:
        """A valid observation (uint8 camera frames), for warm-up, the bundled client and tests."""
        rng = np.random.default_rng(seed)
        obs: dict[str, Any] = {}
        for f in self.features:
            if f.kind == "VISUAL":
                c, h, w = f.shape
                obs[f.key] = rng.integers(0, 256, size=(h, w, c), dtype=np.uint8)
            else:
                obs[f.key] = rng.standard_normal(f.shape).astype(np.float32)
        if self.needs_task:
            obs[TASK_KEY] = task
        return obs


def _vector(f: Feature, value: Any) -> torch.Tensor:
    arr = np.asarray(value) if isinstance(value, (list, tuple, float, int, np.generic)) else value
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "fiu":
        raise InvalidObservation(
            f"{f.key!r} must be a float array of shape {list(f.shape)}, got {type(value).__name__}"
            f"{'' if not isinstance(arr, np.ndarray) else ' of dtype ' + arr.dtype.str}"
        )
    if arr.shape != f.shape:
        raise InvalidObservation(f"{f.key!r} must have shape {list(f.shape)}, got {list(arr.shape)}")
    arr = arr.astype(np.float32)
    check_state_values(f.key, arr)  # NaN, inf, or a magnitude above MAX_ABS_STATE (-1e30 made NaN actions)
    return torch.from_numpy(arr)


def _image(f: Feature, value: Any, raw: bool = False) -> torch.Tensor:
    c, h, w = f.shape
    if not isinstance(value, np.ndarray):
        raise InvalidObservation(f"{f.key!r} must be an image array, got {type(value).__name__}")
    if value.dtype == np.uint8:
        if value.shape != (h, w, c):
            raise InvalidObservation(f"{f.key!r} (uint8) must have shape {[h, w, c]} (HWC), got {list(value.shape)}")
        image = torch.from_numpy(value.copy())
        return image if raw else image.permute(2, 0, 1).float().div_(255.0)
    if value.dtype.kind == "f":
        if value.shape != (c, h, w):
            raise InvalidObservation(f"{f.key!r} (float) must have shape {[c, h, w]} (CHW), got {list(value.shape)}")
        arr = value.astype(np.float32)
        if not (np.isfinite(arr).all() and arr.min(initial=0.0) >= 0.0 and arr.max(initial=0.0) <= 1.0):
            raise InvalidObservation(f"{f.key!r} (float) must hold values in [0, 1]")
        return torch.from_numpy(arr)
    raise InvalidObservation(f"{f.key!r} must be uint8 HWC or float CHW in [0, 1], got dtype {value.dtype.str}")
