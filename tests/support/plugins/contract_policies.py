"""Reference-model variants that use what the ``Policy`` contract offers beyond one tensor and the server's Euler loop.

Each changes one thing, so a test can compare it with the plain reference
policy on the same weights: ``TreeContextPolicy`` returns its context as a
tree (dict, tuple, list) of tensors; ``OwnScheduleFlow`` integrates with its
own, non-uniform timesteps and step count; ``EarlyGuidance`` and ``LateGuidance`` guide only
half of the trajectory; ``UnguidedPolicy`` has no unconditional branch;
``HistoryPolicy`` reads the last two observations of a session.
"""

from __future__ import annotations

import torch

from policy_operator.runtime.policy import Branch, Sample
from policy_operator.runtime.policy.interface import Context, GuidanceInterval, Integrator
from policy_operator.runtime.policy.reference import ReferencePolicy


class TreeContextPolicy(ReferencePolicy):
    """The reference context split into a tree: the first token alone, the rest twice over nested containers."""

    def condition(self, sample: Sample, branch: Branch) -> Context:
        ctx = super().condition(sample, branch)
        return {"head": ctx[:, :1], "rest": (ctx[:, 1:], [ctx[:, 1:].mul(2.0)])}

    def denoise_step(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        rest, (doubled,) = context["rest"]
        assert torch.equal(doubled, rest * 2.0), "a tree's leaves lost their rows"
        return super().denoise_step(torch.cat([context["head"], rest], dim=1), x, t)


class ShiftedEuler(Integrator):
    """Euler on a time grid bunched towards t=1 (``t' = t**2``-style shift), float32 times."""

    def __init__(self, steps: int) -> None:
        grid = [(1.0 - i / steps) ** 0.5 for i in range(steps + 1)]
        self.timesteps = tuple(grid[:-1])
        self.dts = tuple(b - a for a, b in zip(grid[:-1], grid[1:], strict=True))

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        return x + self.dts[i] * out


class OwnScheduleFlow(ReferencePolicy):
    default_steps = 6

    def integrator(self, steps: int | None = None) -> Integrator:
        return ShiftedEuler(self.default_steps if steps is None else steps)


class EarlyGuidance(ReferencePolicy):
    guidance_interval = GuidanceInterval(0.0, 0.5)


class LateGuidance(ReferencePolicy):
    guidance_interval = GuidanceInterval(0.5, 1.0)


class UnguidedPolicy(ReferencePolicy):
    has_unconditional = False


class HistoryPolicy(ReferencePolicy):
    history = 2
