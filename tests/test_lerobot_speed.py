"""``--policy lerobot`` in its fast serving forms against LeRobot's own float32 answer, on tiny configs.

``--dtype bfloat16`` for every family: the actions differ from LeRobot's
float32 ones by rounding only, bounded relative to the action scale (the
largest |action| of LeRobot's answer).  The bounds are measured on these
configs (largest relative difference over the seeds below, recorded beside
each), with headroom; a dtype bug (a float32 activation into a bfloat16
layer, a projection cast that LeRobot keeps in float32) fails at warm-up or
lands far outside.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import sample_actions  # noqa: E402
from tests.support.lerobot_tiny import reduced_paligemma, write_small_pi  # noqa: E402

CPU = torch.device("cpu")
SEEDS = (0, 1, 2)
# max |bf16 - LeRobot fp32| / max |LeRobot fp32| over SEEDS, measured on this CPU: smolvla 0.0016, pi0 0.0025,
# pi05 0.0014, diffusion 0.0096 (its DDIM steps through a ResNet-18 encoder under autocast)
BF16_BOUND = {"smolvla": 0.01, "pi0": 0.01, "pi05": 0.01, "diffusion": 0.04}


@pytest.fixture(scope="module", params=["smolvla", "pi0", "pi05", "diffusion"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    if family in ("pi0", "pi05"):
        root = write_small_pi(family, directory, seed=3)
        with reduced_paligemma():
            yield family, root
    else:
        yield family, write_tiny_checkpoint(family, directory, seed=1)


def answer(policy: LeRobotPolicy, obs: dict[str, Any], seed: int) -> np.ndarray:
    sample = policy.prepare(obs)
    sample = policy.stack_history([sample] * policy.history)  # a session's first request
    return policy.postprocess(sample_actions(policy, sample, [seed], guidance=1.0))


def test_bfloat16_stays_within_its_bound_of_lerobots_float32_actions(checkpoint: tuple[str, Path]) -> None:
    family, root = checkpoint
    fp32 = LeRobotPolicy.load(str(root), device=CPU)
    bf16 = LeRobotPolicy.load(str(root), device=CPU, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert any(p.dtype == torch.bfloat16 for p in bf16.loaded.policy.parameters()) or family == "diffusion"
    worst = 0.0
    for seed in SEEDS:
        obs = fp32.example_observation(seed)
        reference = answer(fp32, obs, seed)
        ours = answer(bf16, obs, seed)
        assert ours.dtype == np.float32 and ours.shape == reference.shape and np.isfinite(ours).all()
        worst = max(worst, float(np.abs(ours - reference).max() / np.abs(reference).max()))
    print(f"{family}: bf16 vs fp32 max relative difference {worst:.2g}")
    assert 0 < worst <= BF16_BOUND[family], f"{family}: {worst:.3g} of the action scale"
