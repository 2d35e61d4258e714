"""A policy plug-in for tests: the reference policy, except that loading waits for a file.

Served with ``--policy gated_load_policy:GatedLoadPolicy`` and the gate's path
in ``$GATED_LOAD_FILE`` (every rank reads it), so a test can act on a server
*while its ranks load the policy* -- a pod deleted while it starts -- without
guessing how long loading takes on a busy machine.  Without the variable it
loads at once.
"""

from __future__ import annotations

import os
import time

import torch

from policy_operator.runtime.policy.reference import ReferencePolicy

GATE_ENV = "GATED_LOAD_FILE"
GATE_LIMIT_S = 120.0  # a forgotten gate never wedges a server for longer


class GatedLoadPolicy(ReferencePolicy):
    @classmethod
    def load(cls, checkpoint: str, *, device: torch.device, dtype: torch.dtype = torch.float32) -> GatedLoadPolicy:
        gate = os.environ.get(GATE_ENV)
        deadline = time.monotonic() + GATE_LIMIT_S
        while gate and not os.path.exists(gate) and time.monotonic() < deadline:
            time.sleep(0.02)
        return super().load(checkpoint, device=device, dtype=dtype)  # type: ignore[return-value]
