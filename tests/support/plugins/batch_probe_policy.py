"""A policy plug-in for the batching tests: ``HeldPolicy`` plus a request whose own row of a batch goes bad.

Served with ``--policy batch_probe_policy:BatchProbePolicy``.  ``hold:<path>``
holds the replica (``held_policy.py``) so a test can queue requests behind it
and know they will run as one batch; the prompt ``nan-row`` turns that
request's conditioning context into NaN *inside the batch*, so only its own
row's actions are non-finite -- unless rows leaked into each other; the
prompt ``fail-batch`` makes ``condition`` raise, failing the batch it is in.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from policy_operator.runtime.policy import Branch, Sample

try:  # in a server: the plug-in folder is on PYTHONPATH (servers.subprocess_env)
    from held_policy import HeldPolicy
except ImportError:  # imported by a test module for NAN_PROMPT
    from tests.support.plugins.held_policy import HeldPolicy

NAN_PROMPT = "nan-row"
FAIL_PROMPT = "fail-batch"


class BatchProbePolicy(HeldPolicy):
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        sample = super().prepare(obs)
        if obs.get("prompt") == NAN_PROMPT:
            sample.meta["nan"] = True
        if obs.get("prompt") == FAIL_PROMPT:
            sample.meta["fail"] = True
        return sample

    def condition(self, sample: Sample, branch: Branch) -> torch.Tensor:
        if any(row.get("fail") for row in sample.rows()):
            raise RuntimeError("planted failure of the batched call")
        ctx = super().condition(sample, branch)
        bad = [i for i, row in enumerate(sample.rows()) if row.get("nan")]
        if bad and branch is Branch.COND:
            ctx = ctx.clone()
            ctx[bad] = float("nan")
        return ctx
