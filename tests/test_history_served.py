"""Every policy family that conditions on a session's history, served by a real server from a stock checkpoint.

``policyserver checkpoint init --lerobot diffusion --size tiny`` (Diffusion Policy, ``n_obs_steps`` 2) failed its
warm-up (``expected input[1, 1, 32, 32] to have 3 channels``, exit 3): the warm-up prepared one observation
without the history serving stacks.  Here the stock checkpoint starts, and one robot's session of three frames
gets, for each, what LeRobot itself computes from the same frames (its own queue of the last ``n_obs_steps``).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("lerobot")

from tests.support.openpi import OpenpiSession  # noqa: E402
from tests.support.servers import VENV_BIN, serve_policy, subprocess_env  # noqa: E402

# The LeRobot families whose policy reads more than the latest observation (Policy.history > 1).
HISTORY_FAMILIES = ["diffusion"]

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]


@pytest.mark.parametrize("family", HISTORY_FAMILIES)
def test_a_stock_checkpoint_with_history_serves_a_session(tmp_path: Path, family: str) -> None:
    import torch

    from policy_operator.runtime.policy.lerobot import LeRobotPolicy
    from tests.support.lerobot_equality import lerobots_own

    ckpt = tmp_path / "ckpt"
    init = subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", "--lerobot", family, "--size", "tiny", str(ckpt)],
        capture_output=True,
        text=True,
        timeout=300,
        env=subprocess_env(),
        cwd=tmp_path,
    )
    assert init.returncode == 0, init.stderr
    policy = LeRobotPolicy.load(str(ckpt), device=torch.device("cpu"))
    assert policy.history > 1, f"{family} reads one observation: not a family with history"
    frames = [policy.example_observation(k) for k in range(3)]
    with serve_policy(ckpt, "--policy", "lerobot", "--error-format", "dict", "--threads", "1") as server:
        with OpenpiSession(server.url) as robot:
            for n, frame in enumerate(frames, start=1):
                reply = robot.infer({**frame, "session_id": "arm", "seed": 10 + n})
                assert "actions" in reply, reply
                expected = lerobots_own(policy, frames[:n], 10 + n)
                np.testing.assert_allclose(reply["actions"], expected, rtol=0, atol=1e-5)
