"""Real-time chunking (Black, Galliker, Levine 2025) for any flow-matching ``Policy``, at inference time.

A robot executes chunk k while chunk k+1 is computed; with an inference delay
of d control steps the new chunk must agree with the d actions executed
meanwhile, or the arm jumps at the switch.  The new chunk is aligned with
the previous chunk's unexecuted tail ``Y`` (``prev_actions``): its action i is
executed where ``Y[i]`` would have been.  Two parts, both per row of a batch:

* **hard inpainting**: after every integration step the first d positions of
  ``x`` are set to the flow's own interpolant of ``Y`` at that time,
  ``t * noise + (1 - t) * Y`` (the row's initial noise), so at t=0 they are
  ``Y[:d]`` exactly and the model always sees a consistent prefix;
* **soft guidance**: the velocity is corrected toward ``Y`` with the paper's
  weights -- 1 on the frozen prefix, decaying exponentially to 0 at the
  execution horizon -- and its time-dependent scale clipped at
  ``MAX_GUIDANCE_WEIGHT``: ``v' = v - k(t) * J^T (W * (Y - x0_hat))`` with
  ``x0_hat = x - t * v`` (the flow's estimate of the final actions) and
  ``J = d x0_hat / d x``.

``guided`` computes ``J^T e`` as a vector-Jacobian product through the
denoiser (autograd, as published); ``inpaint`` takes ``J = I`` (the closed
form LeRobot uses), which needs no gradients and so keeps compiled denoisers
and CUDA graphs.

Time runs as in the sampler: noise at t=1, actions at t=0, ``x += dt * v``
with ``dt < 0``, so a velocity points from the actions toward the noise.
Rows without a constraint have ``active`` False and take the uncorrected
values through ``torch.where``: their numbers are exactly what they would be
without RTC.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final, Literal

import numpy as np
import torch

from policy_operator.runtime.policy.interface import Branch, EulerFlow, Integrator, Policy, Sample, context_map

RtcMode = Literal["off", "inpaint", "guided"]  # serve_flags.RTC_MODES, the --rtc choices
MAX_GUIDANCE_WEIGHT: Final = 5.0  # the paper's beta: the correction's scale is clipped here near t=0 and t=1


@dataclass(frozen=True)
class RtcConstraint:
    """One request's constraint, in the model's action space (``Policy.actions_to_model``), on the CPU.

    ``target`` holds the previous chunk's unexecuted tail, ``h`` rows (h <= horizon), as wide as the model's
    ``x`` or narrower (then the rest of each row is zeros: the padded action dimensions of LeRobot's models);
    positions [0, delay) are frozen to it, [delay, horizon) guided with decaying weights.
    """

    target: torch.Tensor  # [h, action_dim] float32
    delay: int
    horizon: int  # weights are 0 from here on (delay <= horizon <= h)

    def __post_init__(self) -> None:
        h = self.target.shape[0]
        if not 0 <= self.delay <= self.horizon <= h:
            raise ValueError(f"need 0 <= delay ({self.delay}) <= horizon ({self.horizon}) <= rows ({h})")


def prefix_weights(delay: int, horizon: int, total: int) -> torch.Tensor:
    """The paper's weights over ``total`` positions: 1 before ``delay``, ``c (e^c - 1)/(e - 1)`` with
    ``c = (horizon - i)/(horizon - delay + 1)`` on [delay, horizon), 0 from ``horizon`` on."""
    w = torch.zeros(total, dtype=torch.float32)
    w[:delay] = 1.0
    i = torch.arange(delay, horizon, dtype=torch.float32)
    c = (horizon - i) / (horizon - delay + 1)
    w[delay:horizon] = c * torch.expm1(c) / (math.e - 1.0)
    return w


def guidance_scale(t: float, beta: float = MAX_GUIDANCE_WEIGHT) -> float:
    """``min(beta, (1 - tau) / (tau * r^2))`` of the paper with tau = 1 - t and ``r^2 = (1-tau)^2 / (tau^2 +
    (1-tau)^2)``: ``(t^2 + (1-t)^2) / (t (1-t))``, infinite (hence ``beta``) at both ends."""
    if t <= 0.0 or t >= 1.0:
        return beta
    return min(beta, (t * t + (1.0 - t) ** 2) / (t * (1.0 - t)))


@dataclass
class RtcBatch:
    """The constraints of one batch on the sampler's device: per-row masks, weights and targets."""

    mode: RtcMode
    target: torch.Tensor  # [B, H, A], zeros where a row gave fewer than H actions
    weights: torch.Tensor  # [B, H, 1]; 0 on rows without a constraint
    frozen: torch.Tensor  # [B, H, 1] bool: position < the row's delay (False on rows without one)
    active: torch.Tensor  # [B, 1, 1] bool: the row has a constraint
    noise: torch.Tensor | None = None  # [B, H, A], x at t=1: the sampler sets it before the first step

    @classmethod
    def build(
        cls,
        constraints: Sequence[RtcConstraint | None],
        shape: tuple[int, int],
        mode: RtcMode,
        device: torch.device,
        dtype: torch.dtype,
    ) -> RtcBatch | None:
        """The batch of ``constraints`` (one per row, None for a plain row) for an ``x`` of per-row ``shape``;
        None when no row has one."""
        if mode == "off" or all(c is None for c in constraints):
            return None
        horizon, action_dim = shape
        rows = len(constraints)
        target = torch.zeros(rows, horizon, action_dim, dtype=torch.float32)
        weights = torch.zeros(rows, horizon, 1, dtype=torch.float32)
        frozen = torch.zeros(rows, horizon, 1, dtype=torch.bool)
        active = torch.zeros(rows, 1, 1, dtype=torch.bool)
        for b, c in enumerate(constraints):
            if c is None:
                continue
            h, width = c.target.shape
            target[b, :h, :width] = c.target
            weights[b, :, 0] = prefix_weights(c.delay, c.horizon, horizon)
            frozen[b, : c.delay] = True
            active[b] = True
        return cls(mode, target.to(device, dtype), weights.to(device, dtype), frozen.to(device), active.to(device))

    @property
    def guided(self) -> bool:
        return self.mode == "guided"

    def error(self, x: torch.Tensor, v: torch.Tensor, t: float) -> torch.Tensor:
        """``W * (Y - x0_hat)``: how far the flow's estimate of the final actions is from the target, weighted."""
        return self.weights * (self.target - (x - t * v))

    def correct(self, v: torch.Tensor, jtw: torch.Tensor, t: float) -> torch.Tensor:
        """The guided velocity from ``jtw = J^T (W * (Y - x0_hat))``; rows without a constraint keep ``v``."""
        return torch.where(self.active, v - guidance_scale(t) * jtw, v)

    def inpaint(self, x: torch.Tensor, t: float) -> torch.Tensor:
        """``x`` at time ``t`` with the frozen prefix set to the interpolant of the target."""
        assert self.noise is not None, "set noise (x at t=1) before the first step"
        return torch.where(self.frozen, t * self.noise + (1.0 - t) * self.target, x)

    def start(self, x: torch.Tensor) -> None:
        """Remember the initial noise (x at t=1) that the frozen prefix is interpolated from."""
        self.noise = x.clone()


def time_after(timesteps: Sequence[float], i: int) -> float:
    """The time of ``x`` after step ``i``: the next step's, or 0 (the actions) after the last."""
    return float(timesteps[i + 1]) if i + 1 < len(timesteps) else 0.0


@contextmanager
def grad_enabled() -> Iterator[None]:
    """Autograd on, inside the sampler's inference mode: what the guided correction's VJP needs."""
    with torch.inference_mode(False), torch.enable_grad():
        yield


def detached(tree: Any) -> Any:
    """Normal (not inference-mode) copies of a context's tensors, which autograd may save for backward."""
    from torch.utils import _pytree as pytree

    with grad_enabled():
        return pytree.tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, tree)


def vjp(out: torch.Tensor, x: torch.Tensor, vector: torch.Tensor) -> torch.Tensor:
    """``(d out / d x)^T vector``; a policy whose ``denoise_step`` turns autograd off gets a clear error."""
    if not out.requires_grad:
        raise RuntimeError(
            "--rtc guided needs gradients through denoise_step, and this policy's denoise_step "
            "computes without autograd (e.g. under torch.inference_mode); use --rtc inpaint"
        )
    (grad,) = torch.autograd.grad(out, x, vector)
    return grad


#: One step's combined output and its parts with their coefficients in it: the output is linear in its parts
#: (CFG: ``u + g (c - u)`` has parts ``(c, g), (u, 1 - g)``), so its VJP is the sum of theirs, taken per branch
#: -- which is what lets each cfg rank take its own branch's under cfgp=2.
Step = tuple[torch.Tensor, Sequence[tuple[torch.Tensor, float]]]


def guided_velocity(rtc: RtcBatch, forward: Callable[[torch.Tensor], Step], x: torch.Tensor, t: float) -> torch.Tensor:
    """The corrected output of one step: ``forward(x)`` (the combined, CFG-guided output) with RTC's correction.

    ``guided``: ``J^T e = e - t (d out/d x)^T e`` by autograd through ``forward``, part by part;
    ``inpaint``: ``J = I``.
    """
    if not rtc.guided:
        out = forward(x)[0]
        return rtc.correct(out, rtc.error(x, out, t), t)
    with grad_enabled():
        x_g = x.clone().requires_grad_(True)
        out, parts = forward(x_g)
        out = out.detach()
        e = rtc.error(x, out, t)
        grads = [vjp(part, x_g, coef * e) for part, coef in parts]
        total = grads[0]
        for g in grads[1:]:
            total = total + g
        return rtc.correct(out, e - t * total, t)


def integrate(
    rtc: RtcBatch,
    x: torch.Tensor,
    integrator: Any,
    forward: Callable[[torch.Tensor, int], Step],
) -> torch.Tensor:
    """The sampler's loop with RTC: each step's output corrected, then the frozen prefix inpainted.

    ``forward(x, i)`` is step ``i``'s combined output as the sampler computes it without RTC, with its
    parts; ``integrator`` is the policy's (flow matching: ``timesteps`` from 1 toward 0, ``step(x, out, i)``).
    """
    rtc.start(x)
    timesteps = integrator.timesteps
    for i, t in enumerate(timesteps):
        out = guided_velocity(rtc, functools.partial(_at_step, forward, i=i), x, float(t))
        x = rtc.inpaint(integrator.step(x, out, i), time_after(timesteps, i))
    return x


def _at_step(forward: Callable[[torch.Tensor, int], Step], z: torch.Tensor, *, i: int) -> Step:
    return forward(z, i)


def sample_rtc(
    policy: Policy,
    sample: Sample,
    x: torch.Tensor,
    integrator: Integrator,
    plan: Sequence[bool],
    guidance: float,
    mode: str,
    rtc: RtcBatch,
) -> torch.Tensor:
    """``sample_actions`` of a batch with at least one constrained row, on one rank (cfgp=1, any cfg mode).

    The same model calls as without RTC, step by step; only the output is corrected and the prefix inpainted.
    """
    rows = x.shape[0]
    ctx_c = policy.condition(sample, Branch.COND)
    ctx_u = policy.condition(sample, Branch.UNCOND) if any(plan) else None
    if rtc.guided:  # contexts made in inference mode cannot be saved for backward
        ctx_c, ctx_u = detached(ctx_c), detached(ctx_u)
    ctx_cu = (
        context_map(lambda c, u: torch.cat([c, u.expand_as(c)]), ctx_c, ctx_u)
        if mode == "batched" and ctx_u is not None
        else None
    )

    def forward(z: torch.Tensor, i: int) -> Step:
        t = integrator.time(i, rows, z.device)
        if not plan[i]:
            c = policy.denoise_step(ctx_c, z, t)
            return c, [(c, 1.0)]
        if ctx_cu is not None:
            c, u = policy.denoise_step(ctx_cu, torch.cat([z, z]), integrator.time(i, 2 * rows, z.device)).chunk(2)
            out = u + guidance * (c - u)
            return out, [(out, 1.0)]
        c = policy.denoise_step(ctx_c, z, t)
        u = policy.denoise_step(ctx_u, z, t)
        return u + guidance * (c - u), [(c, guidance), (u, 1.0 - guidance)]

    return integrate(rtc, x, integrator, forward)


def rtc_unsupported(policy: Policy) -> str | None:
    """Why ``policy`` cannot do real-time chunking, or None when it can: it must map the returned actions back
    to its model space, and integrate a flow from noise at t=1 (what the correction's ``x0_hat`` assumes).  A
    policy class serving several kinds of model says for itself (``rtc_unsupported_reason``, a str or None)."""
    own = getattr(policy, "rtc_unsupported_reason", None)
    if own is not None:
        return str(own)
    if type(policy).actions_to_model is Policy.actions_to_model:
        return f"policy {policy.name} cannot map actions back to its model space (no actions_to_model)"
    if not isinstance(policy.integrator(), EulerFlow):
        return f"policy {policy.name} does not integrate a flow from noise at t=1 (its integrator is not EulerFlow)"
    return None


def warmup_constraint(policy: Policy, mode: str) -> RtcConstraint | None:
    """A constraint for warm-up requests, so a compiled denoiser meets the RTC path (the guided backward) before
    ``/readyz``; None when RTC is off or the policy cannot do it."""
    if mode == "off" or rtc_unsupported(policy) is not None:
        return None
    horizon, action_dim = policy.action_shape
    return RtcConstraint(
        policy.actions_to_model(np.zeros((horizon, action_dim), np.float32)), min(1, horizon - 1), horizon
    )
