"""A policy plug-in for tests: the reference policy, except that chosen requests wait for a file.

Served with ``--policy held_policy:HeldPolicy`` (the server's real plug-in
path; ``servers.subprocess_env`` puts this folder on ``PYTHONPATH``).  A request whose prompt is ``hold:<path>`` blocks in
``condition`` -- on the model thread, exactly where a long inference spends
its time -- until ``<path>`` exists, so a test can probe the server *while a
request is in flight* without guessing how long an inference takes on a busy
machine.  Any other request is the reference policy, unchanged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from typing import Any

import torch

from policy_operator.runtime.policy import Branch, Sample
from policy_operator.runtime.policy.reference import ReferencePolicy

HOLD_PREFIX = "hold:"
HOLD_LIMIT_S = 120.0  # a forgotten gate never wedges the server for longer


def hold_prompt(gate: str | os.PathLike[str]) -> str:
    return f"{HOLD_PREFIX}{os.fspath(gate)}"


class HeldPolicy(ReferencePolicy):
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        sample = super().prepare(obs)
        prompt = obs.get("prompt")
        if isinstance(prompt, str) and prompt.startswith(HOLD_PREFIX):
            sample.meta["hold"] = prompt[len(HOLD_PREFIX) :]
        return sample

    def condition(self, sample: Sample, branch: Branch) -> torch.Tensor:
        gate = next((row["hold"] for row in sample.rows() if row.get("hold")), None)
        if gate and branch is Branch.COND:
            deadline = time.monotonic() + HOLD_LIMIT_S
            while not os.path.exists(gate) and time.monotonic() < deadline:
                time.sleep(0.02)
        return super().condition(sample, branch)
