"""A reference policy that fails on demand, on one chosen CFG branch.

Used by the distributed tests to prove a request that blows up *inside* the
compute of one rank (after validation, so not catchable up front) fails only
that request: the prompt ``explode:cond`` or ``explode:uncond`` makes that
branch raise on whichever rank computes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policy_operator.runtime.policy import Branch, Sample
from policy_operator.runtime.policy.reference import ReferencePolicy

PREFIX = "explode:"


class FaultyPolicy(ReferencePolicy):
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        sample = super().prepare(obs)
        prompt = obs.get("prompt", "")
        if isinstance(prompt, str) and prompt.startswith(PREFIX):
            sample.meta["explode"] = prompt[len(PREFIX) :]
        return sample

    def condition(self, sample: Sample, branch: Branch) -> torch.Tensor:
        if any(row.get("explode") == branch.name.lower() for row in sample.rows()):  # fails its whole batch
            raise RuntimeError(f"planted failure in the {branch.name.lower()} branch")
        return super().condition(sample, branch)
