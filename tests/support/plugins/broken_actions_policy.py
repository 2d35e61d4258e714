"""Policy plug-ins for tests whose actions a robot must not get: the reference policy with a planted fault.

Served with ``--policy broken_actions_policy:NanActionsPolicy`` (or
``ShortActionsPolicy``) through the server's real plug-in path, so
``policyserver probe`` is tested against a whole server that loads, warms up
and answers, but answers wrongly:

* ``NanActionsPolicy``: one NaN in every action chunk (a diverged denoiser);
* ``ShortActionsPolicy``: a chunk one step shorter than ``action_shape`` in the
  metadata (a postprocess that drops the last step).
"""

from __future__ import annotations

import numpy as np
import torch

from policy_operator.runtime.policy.reference import ReferencePolicy


class NanActionsPolicy(ReferencePolicy):
    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        actions = super().postprocess(x).copy()
        actions[-1, 0] = np.nan
        return actions


class ShortActionsPolicy(ReferencePolicy):
    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        return super().postprocess(x)[:-1]
