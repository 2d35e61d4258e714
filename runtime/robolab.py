"""RoboLab-shaped observations, as a robot sends them: what the client, the demo and the benchmarks send.

Its own module below both ``client.py`` and ``chunk_executor.py`` (the
simulated robot the client runs), so neither imports the other to build one.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def robolab_observation(metadata: dict[str, Any], seed: int, *, fixed_seed: int | None = None) -> dict[str, Any]:
    """A 224x224 camera frame, joint and gripper positions of the sizes ``metadata`` announces, and a prompt;
    ``fixed_seed``: the sampling seed the request carries (same seed, same actions)."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {
        "observation/image": rng.integers(0, 256, size=(224, 224, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(int(metadata.get("joint_dim", 7))).astype(np.float32),
        "observation/gripper_position": rng.random(int(metadata.get("gripper_dim", 1))).astype(np.float32),
        "prompt": "put the banana in the bowl",
    }
    if fixed_seed is not None:
        obs["seed"] = fixed_seed
    return obs
