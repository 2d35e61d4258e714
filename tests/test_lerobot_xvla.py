"""X-VLA through ``--policy lerobot``: the same actions as LeRobot's own on a tiny checkpoint written offline.

runtime/policy/lerobot/family_xvla.py builds a small Florence-2 (DaViT + BART
encoder) from config and bundles a locally trained tokenizer; the reference is
LeRobot's ``predict_action_chunk`` with its global generator seeded with the
request's seed (what ``generate_actions`` draws its noise from) and its
postprocessor.  Measured: bitwise equal on this CPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from policy_operator.layout import LayoutError  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import SamplerSettings  # noqa: E402
from tests.support.lerobot_equality import (  # noqa: E402
    assert_answers_as_lerobot,
    assert_batched_rows_equal_each_alone,
    assert_checkpoint_init_writes,
)

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def xvla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("xvla", tmp_path_factory.mktemp("xvla") / "ckpt", seed=5)


@pytest.fixture(scope="module")
def xvla(xvla_dir: Path) -> LeRobotPolicy:
    return LeRobotPolicy.load(str(xvla_dir), device=CPU)


def test_xvla_answers_as_lerobot(xvla: LeRobotPolicy) -> None:
    obs = xvla.example_observation(2)
    assert_answers_as_lerobot(xvla, obs, 13)
    assert xvla.action_shape == (4, 6)


def test_batched_requests_equal_each_alone(xvla: LeRobotPolicy) -> None:
    observations = [xvla.example_observation(k) for k in (1, 2, 3)]
    observations[2]["task"] = "open the top drawer"
    assert_batched_rows_equal_each_alone(xvla, observations)


def test_no_guidance_and_no_rtc(xvla: LeRobotPolicy) -> None:
    assert not xvla.has_unconditional
    assert SamplerSettings(None, None, "sequential").for_policy(xvla).guidance == 1.0
    with pytest.raises(LayoutError, match="cfgp=2"):
        SamplerSettings(None, None, "sequential").for_policy(xvla, cfgp=2)
    meta = xvla.metadata()
    assert meta["lerobot_type"] == "xvla" and meta["chunk_shape"] == [4, 6]
    assert set(meta["observation_keys"]) == {
        "observation.images.top",
        "observation.images.wrist",
        "observation.state",
        "task",
    }
    assert xvla.rtc_unsupported_reason is not None and "clean chunk" in xvla.rtc_unsupported_reason


def test_checkpoint_init_writes_the_family_and_it_verifies(xvla_dir: Path, tmp_path: Path) -> None:
    """``policyserver checkpoint init --lerobot xvla`` writes the fixture's bytes, and ``checkpoint verify`` (the
    pods' init container: manifest, hashes, the trusted-steps checks) accepts it."""
    assert_checkpoint_init_writes("xvla", 5, xvla_dir, tmp_path / "ckpt", ("model.safetensors",))
