"""RoboLab-shaped observations, as a robot sends them: what the client, the demo and the benchmarks send.

Its own module below both ``client.py`` and ``chunk_executor.py`` (the
simulated robot the client runs), so neither imports the other to build one.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def robolab_observation(metadata: dict[str, Any], seed: int, *, fixed_seed: int | None = None) -> dict[str, Any]:
    """A 224x224 camera frame, joint and gripper positions of the sizes ``metadata`` announces, and a prompt;
    ``fixed_seed``: the sampling seed the request carries (same seed, same actions).  A server whose metadata
    lists its ``observation_keys`` (a LeRobot policy) gets exactly those keys, of their shapes."""
    rng = np.random.default_rng(seed)
    if isinstance(metadata.get("observation_keys"), dict):
        return _of_keys(metadata["observation_keys"], rng, fixed_seed)
    obs: dict[str, Any] = {
        "observation/image": rng.integers(0, 256, size=(224, 224, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(int(metadata.get("joint_dim", 7))).astype(np.float32),
        "observation/gripper_position": rng.random(int(metadata.get("gripper_dim", 1))).astype(np.float32),
        "prompt": "put the banana in the bowl",
    }
    if fixed_seed is not None:
        obs["seed"] = fixed_seed
    return obs


def _of_keys(keys: dict[str, Any], rng: np.random.Generator, fixed_seed: int | None) -> dict[str, Any]:
    """The observation a LeRobot policy's metadata describes: uint8 HWC cameras, float vectors, the task."""
    obs: dict[str, Any] = {}
    for key, spec in keys.items():
        if spec.get("dtype") == "str":
            obs[key] = "put the banana in the bowl"
        elif spec.get("dtype") == "uint8":
            obs[key] = rng.integers(0, 256, size=tuple(spec["shape"]), dtype=np.uint8)
        else:
            obs[key] = rng.standard_normal(tuple(spec["shape"])).astype(np.float32)
    if fixed_seed is not None:
        obs["seed"] = fixed_seed
    return obs
