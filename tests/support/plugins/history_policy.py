"""A policy plug-in for tests: the reference policy, conditioned on its session's last two observations.

Served with ``--policy history_policy:HistoryPolicy``.  ``history = 2``, as
Diffusion Policy's ``n_obs_steps``: the engine keeps each session's last two
prepared samples, and this policy's ``stack_history`` feeds the mean of their
states to the reference model.  So a request's actions depend on the state
its session sent before, which is what a test of whose session that is needs.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from policy_operator.runtime.policy import Sample
from policy_operator.runtime.policy.reference import ReferencePolicy


class HistoryPolicy(ReferencePolicy):
    history = 2

    def stack_history(self, samples: Sequence[Sample]) -> Sample:
        latest = samples[-1]
        tensors = dict(latest.tensors)
        tensors["state"] = torch.stack([s.tensors["state"] for s in samples]).mean(dim=0)
        return Sample(tensors, dict(latest.meta))
