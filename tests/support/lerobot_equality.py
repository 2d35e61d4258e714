"""What every LeRobot family's equality test compares: the server's sampler on a batch, and LeRobot's own answer.

A family module's test (tests/test_lerobot_<type>.py) brings its tiny checkpoint and its own assertions; the
two sides of the comparison, and the checks that hold for every family that draws its noise from the global
generator (GR00T, X-VLA), are written here once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

from policy_operator.cli import main as policyserver
from policy_operator.exit_codes import CheckpointExit
from policy_operator.runtime.policy.interface import collate
from policy_operator.runtime.policy.lerobot import LeRobotPolicy
from policy_operator.runtime.policy.sampler import sample_actions

ATOL = 1e-5


def ours(policy: LeRobotPolicy, observations: list[dict[str, Any]], seeds: list[int], **kwargs: Any) -> np.ndarray:
    """The server's sampler on one batch of requests (``guidance`` 1.0 unless given), postprocessed per row."""
    kwargs.setdefault("guidance", 1.0)
    sample = collate([policy.prepare(obs) for obs in observations])
    return np.stack(policy.postprocess_batch(sample_actions(policy, sample, seeds, **kwargs), sample))


def lerobots_own(policy: LeRobotPolicy, observations: list[dict[str, Any]], seed: int) -> np.ndarray:
    """LeRobot's answer to a session's ``observations`` for a family that takes its noise as an argument (SmolVLA,
    pi0, pi0.5, Diffusion Policy): its preprocessor per frame, its queue of the last n_obs_steps frames (the first
    one repeated while fewer came), predict_action_chunk with the request's noise, its postprocessor."""
    loaded, n = policy.loaded, policy.history
    frames = [loaded.preprocessor(policy.spec.parse(obs)) for obs in observations][-n:]
    frames = [frames[0]] * (n - len(frames)) + frames
    batch = dict(frames[-1])
    if n > 1:
        batch.update(
            {k: torch.stack([f[k] for f in frames], dim=1) for k, v in batch.items() if isinstance(v, torch.Tensor)}
        )
    noise = torch.randn(policy.family.noise_shape, generator=torch.Generator().manual_seed(seed))
    loaded.policy.reset()
    with torch.inference_mode():
        return loaded.postprocessor(loaded.policy.predict_action_chunk(batch, noise=noise))[0].numpy()


def lerobots_own_global_seed(policy: LeRobotPolicy, obs: dict[str, Any], seed: int) -> np.ndarray:
    """LeRobot's first chunk for a family that draws its noise from the global generator: its preprocessor,
    ``predict_action_chunk`` after ``reset()`` with ``torch.manual_seed(seed)``, its postprocessor."""
    loaded = policy.loaded
    loaded.policy.reset()
    batch = loaded.preprocessor(policy.spec.parse(obs))
    torch.manual_seed(seed)
    with torch.inference_mode():
        return loaded.postprocessor(loaded.policy.predict_action_chunk(batch))[0].numpy()


def assert_answers_as_lerobot(policy: LeRobotPolicy, obs: dict[str, Any], seed: int) -> np.ndarray:
    """One request answers LeRobot's own chunk for a global-seed family (float32, the policy's action shape), and
    another seed answers otherwise (the seed is the noise); returns the answer for the family's own checks."""
    got = ours(policy, [obs], [seed])[0]
    assert got.shape == policy.action_shape and got.dtype == np.float32
    np.testing.assert_allclose(got, lerobots_own_global_seed(policy, obs, seed), rtol=0, atol=ATOL)
    assert not np.allclose(got, ours(policy, [obs], [seed + 1])[0], atol=1e-3)
    return got


def assert_batched_rows_equal_each_alone(policy: LeRobotPolicy, observations: list[dict[str, Any]]) -> None:
    """A batch answers each row what that request alone answers (seeds 1, 2, ... by row)."""
    seeds = list(range(1, len(observations) + 1))
    together = ours(policy, observations, seeds)
    for k, obs in enumerate(observations):
        np.testing.assert_allclose(together[k], ours(policy, [obs], [seeds[k]])[0], rtol=0, atol=ATOL)


def assert_checkpoint_init_writes(family: str, seed: int, fixture: Path, written: Path, files: tuple[str, ...]) -> None:
    """``policyserver checkpoint init --lerobot FAMILY`` writes the fixture's bytes for the same seed, and
    ``checkpoint verify --hashes`` (the pods' init container: manifest, hashes, the trusted-steps checks) accepts it."""
    assert policyserver(["checkpoint", "init", "--lerobot", family, "--seed", str(seed), str(written)]) == 0
    for name in files:
        assert (written / name).read_bytes() == (fixture / name).read_bytes(), name
    assert policyserver(["checkpoint", "verify", str(written), "--hashes"]) == CheckpointExit.OK
