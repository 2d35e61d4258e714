"""Validation of openpi / RoboLab observation dicts.

Keys follow openpi's DROID convention as RoboLab sends it:
``observation/image`` (HxWx3 uint8, or a dict of cameras), any other
``observation/*image*`` key as a further camera, ``observation/joint_position``,
``observation/gripper_position``, ``prompt``, optional ``seed`` and
``session_id``.  Unknown keys are ignored, as openpi policies do.  Every check
raises ``InvalidObservation`` with the key and the reason, so the client sees
what to fix and no rank ever sees the bad data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_operator.runtime.errors import InvalidObservation

IMAGE_KEY = "observation/image"
JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
PROMPT_KEY = "prompt"
SEED_KEY = "seed"
SESSION_KEY = "session_id"

MAX_IMAGE_SIDE = 4096
# The largest state value (joint, gripper, end-effector, environment) any policy takes unless it says less: far
# beyond a robot's reading in radians, metres or millimetres, and small enough that normalising it and one
# linear layer stay finite in float32.  A finite -1e30 would turn every action into NaN or inf.
MAX_ABS_STATE = 1.0e6
MAX_PROMPT_CHARS = 2048
MAX_SEED = 2**63 - 1
MAX_SESSION_BYTES = 256  # the router keeps up to 4096 sessions: each key must stay small


@dataclass(frozen=True)
class Observation:
    cameras: tuple[np.ndarray, ...]  # each HxWx3 uint8, in a stable order
    state: np.ndarray  # float32 [joint_dim + gripper_dim]
    prompt: str


def _float_vector(obs: Mapping[str, Any], key: str, size: int, limit: float = MAX_ABS_STATE) -> np.ndarray:
    if key not in obs:
        raise InvalidObservation(f"missing key {key!r}")
    value = obs[key]
    try:
        arr = np.asarray(value) if isinstance(value, (list, tuple, float, int, np.generic)) else value
    except (ValueError, TypeError) as exc:  # a ragged list such as [1, [2, 3]]
        raise InvalidObservation(f"{key!r} must be a flat list of numbers: {exc}") from None
    if not isinstance(arr, np.ndarray):
        raise InvalidObservation(f"{key!r} must be a float array, got {type(value).__name__}")
    if arr.dtype.kind not in "fiu" or arr.dtype == np.bool_:
        raise InvalidObservation(f"{key!r} must be a float array, got dtype {arr.dtype.str}")
    arr = arr.reshape(-1) if arr.ndim <= 1 else arr
    if arr.shape != (size,):
        raise InvalidObservation(f"{key!r} must have shape ({size},), got {tuple(np.shape(value))}")
    arr = arr.astype(np.float32, copy=False)
    # One pass over a handful of Python floats: the numpy reductions this replaces cost the event loop
    # ~10 us per vector.  A NaN fails ``<=``, so the slow path below only runs for a bad vector.
    if not all(-limit <= v <= limit for v in arr.tolist()):
        check_state_values(key, arr, limit)
    return arr


def check_state_values(key: str, arr: np.ndarray, limit: float = MAX_ABS_STATE) -> None:
    """Refuse NaN, inf and values of magnitude above ``limit`` (finite but far outside any robot's range: the
    model would answer with NaN actions), naming the key and the bound."""
    if not np.isfinite(arr).all():
        raise InvalidObservation(f"{key!r} contains NaN or inf")
    largest = float(np.abs(arr).max(initial=0.0))
    if largest > limit:
        raise InvalidObservation(f"{key!r} has a value of magnitude {largest:.3g}; this policy takes at most {limit:g}")


def _image(key: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray):
        raise InvalidObservation(f"{key!r} must be an HxWx3 uint8 array, got {type(value).__name__}")
    if value.dtype != np.uint8:
        raise InvalidObservation(f"{key!r} must be uint8, got dtype {value.dtype.str}")
    if value.ndim != 3 or value.shape[-1] != 3:
        raise InvalidObservation(f"{key!r} must have shape (H, W, 3), got {value.shape}")
    h, w, _ = value.shape
    if not (1 <= h <= MAX_IMAGE_SIDE and 1 <= w <= MAX_IMAGE_SIDE):
        raise InvalidObservation(f"{key!r} has size {h}x{w}; each side must be in 1..{MAX_IMAGE_SIDE}")
    return value


def parse_observation(
    obs: Mapping[str, Any], *, joint_dim: int, gripper_dim: int, max_cameras: int, max_abs_state: float = MAX_ABS_STATE
) -> Observation:
    """The observation's parts, checked; ``max_abs_state`` bounds every joint and gripper value."""
    if not isinstance(obs, Mapping):
        raise InvalidObservation(f"observation must be a dict, got {type(obs).__name__}")
    cameras: list[tuple[str, np.ndarray]] = []
    if IMAGE_KEY not in obs:
        raise InvalidObservation(f"missing key {IMAGE_KEY!r}")
    main = obs[IMAGE_KEY]
    if isinstance(main, Mapping):
        if not main:
            raise InvalidObservation(f"{IMAGE_KEY!r} is an empty dict of cameras")
        for name in sorted(main, key=str):
            cameras.append((f"{IMAGE_KEY}/{name}", _image(f"{IMAGE_KEY}/{name}", main[name])))
    else:
        cameras.append((IMAGE_KEY, _image(IMAGE_KEY, main)))
    for key in sorted(k for k in obs if k.startswith("observation/") and "image" in k and k != IMAGE_KEY):
        cameras.append((key, _image(key, obs[key])))
    if len(cameras) > max_cameras:
        raise InvalidObservation(
            f"{len(cameras)} camera images given ({', '.join(k for k, _ in cameras)}); this policy takes at most {max_cameras}"
        )
    joints = _float_vector(obs, JOINT_KEY, joint_dim, max_abs_state)
    gripper = _float_vector(obs, GRIPPER_KEY, gripper_dim, max_abs_state)
    prompt = obs.get(PROMPT_KEY, "")
    if not isinstance(prompt, str):
        raise InvalidObservation(f"{PROMPT_KEY!r} must be a string, got {type(prompt).__name__}")
    if len(prompt) > MAX_PROMPT_CHARS:
        raise InvalidObservation(f"{PROMPT_KEY!r} is {len(prompt)} characters; at most {MAX_PROMPT_CHARS}")
    return Observation(tuple(img for _, img in cameras), np.concatenate([joints, gripper]), prompt)


def parse_request_keys(obs: Mapping[str, Any]) -> tuple[int | None, str | None]:
    """The keys that are the request's, not the robot's, checked in one pass (the seed first): its ``seed``
    (None: the server picks one) and its ``session_id``, at most ``MAX_SESSION_BYTES`` of UTF-8 (a longer one is
    refused, never echoed; None: no session)."""
    seed = obs.get(SEED_KEY)
    if seed is not None:
        if isinstance(seed, np.ndarray) and seed.shape == ():
            seed = seed.item()
        if isinstance(seed, np.integer):
            seed = int(seed)
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise InvalidObservation(f"{SEED_KEY!r} must be an integer, got {type(seed).__name__}")
        if not 0 <= seed <= MAX_SEED:
            raise InvalidObservation(f"{SEED_KEY!r} must be in 0..2**63-1, got {seed}")
    session = obs.get(SESSION_KEY)
    if session is None:
        return seed, None
    if not isinstance(session, (str, int)) or isinstance(session, bool):
        raise InvalidObservation(f"{SESSION_KEY!r} must be a string, got {type(session).__name__}")
    session = str(session)
    size = len(session.encode("utf-8", "surrogatepass"))
    if size > MAX_SESSION_BYTES:
        raise InvalidObservation(f"{SESSION_KEY!r} is {size} bytes of UTF-8; at most {MAX_SESSION_BYTES}")
    return seed, session
