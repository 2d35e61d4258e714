"""The sampler and the three ways to run classifier-free guidance.

The policy's integrator (``Policy.integrator``: by default Euler flow matching
from noise at t=1 to actions at t=0) moves ``x`` one step per model call.  Per
guided step the combined output is ``u + g * (c - u)``; where the two branch
outputs come from is the only thing that differs between layouts:

* ``sequential``: one rank, two batch-1 forwards;
* ``batched``: one rank, one batch-2 forward (faster on a GPU; its GEMM shapes
  differ, so results match the other modes to ~1e-6, not bitwise);
* ``parallel``: cfgp=2, each rank one batch-1 forward of its own branch, then
  one all_gather.  Same kernels as ``sequential``, hence bitwise-equal actions.

Both cfg ranks compute the combination themselves, so their ``x`` never
diverges and nothing but the velocities crosses the wire.  A rank whose step
fails keeps joining the collectives with a zero contribution and a failure
flag, so its peer never hangs; both then see the flag and fail the request
together while staying in step for the next one.  A collective that itself
fails (the peer died, or froze past ``--pg-timeout-s``) is another matter: the
group is broken for good, so it raises ``ReplicaFailed`` and the replica goes
out of service (``parallel/dispatch.py``).  The flag is read once after
the loop: no host sync inside the step loop.

Every mode samples a batch of B requests at once (B rows of ``x``, each from
its own seed's noise): ``batched`` runs 2B rows per step, ``parallel`` sends B
rows per step through the all_gather.  ``bucket_of`` pads B up to a fixed
size, so a compiled denoiser (CUDA graphs) only ever sees the shapes it
captured at warm-up.  Contexts are trees of tensors (``Context``): batched
CFG concatenates them leaf by leaf.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from policy_operator.builtin_policies import check_unconditional
from policy_operator.constants import policy_guidance
from policy_operator.layout import ParallelLayout
from policy_operator.runtime.errors import PeerFailed, ReplicaFailed
from policy_operator.runtime.policy.interface import Branch, Context, Integrator, Policy, Sample, context_map
from policy_operator.runtime.policy.rtc import (
    RtcBatch,
    RtcConstraint,
    RtcMode,
    Step,
    detached,
    grad_enabled,
    guided_velocity,
    sample_rtc,
    time_after,
    vjp,
)

log = logging.getLogger(__name__)

CfgMode = Literal["sequential", "batched", "parallel"]


@dataclass(frozen=True)
class SamplerSettings:
    """The server's sampling flags (--steps, --guidance, --cfg-mode), the same for every request."""

    steps: int | None  # None: the policy's own
    guidance: float | None  # None: the policy's own (3.0 with an unconditional branch, 1.0 without)
    cfg_mode: CfgMode  # for cfgp=1; cfgp=2 is always "parallel"
    buckets: tuple[int, ...] = ()  # batch sizes a batch is padded up to (compiled denoisers); () = no padding
    rtc: RtcMode = "off"  # --rtc: how a request's ``rtc`` constraint is applied (runtime/policy/rtc.py)
    rtc_max_delay: int | None = None  # --rtc-max-delay; None: any delay the action horizon allows

    def for_policy(self, policy: Policy, cfgp: int = 1) -> SamplerSettings:
        """These settings with the policy's own steps and guidance where the flags left them unset.

        LayoutError (one line) when they ask ``policy`` for guidance it has no
        unconditional branch for: ``serve`` refuses a built-in's before any
        rank starts; this catches a plug-in's when it loads.
        """
        guidance = policy_guidance(
            self.guidance if self.guidance is not None else policy.default_guidance, policy.has_unconditional
        )
        check_unconditional(policy.name, policy.has_unconditional, cfgp=cfgp, guidance=guidance)
        ParallelLayout(cfgp=cfgp).check_guidance(guidance)  # a checkpoint's own guidance of 1.0 under cfgp=2
        steps = policy.integrator(self.steps).steps
        return SamplerSettings(steps, guidance, self.cfg_mode, self.buckets, self.rtc, self.rtc_max_delay)


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, ... up to ``max_batch`` (included even when not a power of two): the shapes warm-up captures."""
    if max_batch < 1:
        raise ValueError(f"max_batch must be >= 1, got {max_batch}")
    sizes = []
    size = 1
    while size < max_batch:
        sizes.append(size)
        size *= 2
    return (*sizes, max_batch)


def bucket_of(size: int, buckets: Sequence[int]) -> int:
    """The smallest bucket that holds ``size`` rows; ``size`` itself without buckets."""
    if not buckets:
        return size
    for bucket in buckets:
        if bucket >= size:
            return bucket
    raise ValueError(f"a batch of {size} exceeds the largest bucket {max(buckets)}")


@dataclass(frozen=True)
class CfgGroup:
    """This rank's place in a cfgp=2 replica."""

    group: dist.ProcessGroup
    cfg_index: int  # 0 = conditional branch, 1 = unconditional
    host_staging: bool = False  # gloo with CUDA tensors: exchange through host memory


def sample_actions(
    policy: Policy,
    sample: Sample,
    seeds: Sequence[int],
    *,
    steps: int | None = None,
    guidance: float,
    mode: CfgMode = "sequential",
    cfg_group: CfgGroup | None = None,
    integrator: Integrator | None = None,
    rtc_mode: RtcMode = "off",
    rtc: Sequence[RtcConstraint | None] | None = None,
) -> torch.Tensor:
    """Final ``x`` of the batch (one row per seed) on this rank; the output rank postprocesses it.

    ``rtc``: real-time chunking, one constraint per row (None for a plain row), applied as ``rtc_mode``
    says (runtime/policy/rtc.py); a batch without any runs exactly as it would without RTC.

    ``sample`` is a collated batch (or one prepared sample) with one row per
    seed.  ``integrator`` (default: the policy's, for ``steps``; None = the
    policy's own number) gives each step's time and update; the policy's
    ``guided_steps`` which steps combine both branches.
    """
    integ = integrator if integrator is not None else policy.integrator(steps)
    n = integ.steps
    rows = len(seeds)
    if rows < 1 or sample.batch_size != rows:
        raise ValueError(f"{rows} seeds for a sample of {sample.batch_size} rows")
    guided = float(guidance) != 1.0
    if guided and not policy.has_unconditional:
        raise ValueError(f"policy {policy.name} has no unconditional branch: guidance must be 1.0, got {guidance:g}")
    plan = policy.guided_steps(n) if guided else (False,) * n
    if len(plan) != n:
        raise ValueError(f"guided_steps gave {len(plan)} flags for {n} steps")
    if mode == "parallel" and (cfg_group is None or not any(plan)):
        raise ValueError("parallel CFG needs a cfg group and guidance != 1.0")
    with torch.inference_mode():
        x = torch.cat([policy.init_noise(seed) for seed in seeds])
        constraints = RtcBatch.build(rtc, (x.shape[1], x.shape[2]), rtc_mode, x.device, x.dtype) if rtc else None
        if mode == "parallel":
            assert cfg_group is not None
            return _parallel(policy, sample, x, integ, plan, guidance, cfg_group, constraints)
        if constraints is not None:
            return sample_rtc(policy, sample, x, integ, plan, guidance, mode, constraints)
        ctx_c = policy.condition(sample, Branch.COND)
        if not any(plan):
            for i in range(n):
                x = integ.step(x, policy.denoise_step(ctx_c, x, integ.time(i, rows, x.device)), i)
            return x
        ctx_u = policy.condition(sample, Branch.UNCOND)
        if mode == "batched":
            ctx = context_map(lambda c, u: torch.cat([c, u.expand_as(c)]), ctx_c, ctx_u)
            for i in range(n):
                if not plan[i]:
                    x = integ.step(x, policy.denoise_step(ctx_c, x, integ.time(i, rows, x.device)), i)
                    continue
                c, u = policy.denoise_step(ctx, torch.cat([x, x]), integ.time(i, 2 * rows, x.device)).chunk(2)
                x = integ.step(x, u + guidance * (c - u), i)
            return x
        if mode != "sequential":
            raise ValueError(f"unknown cfg mode {mode!r}")
        for i in range(n):
            t = integ.time(i, rows, x.device)
            c = policy.denoise_step(ctx_c, x, t)
            if not plan[i]:
                x = integ.step(x, c, i)
                continue
            u = policy.denoise_step(ctx_u, x, t)
            x = integ.step(x, u + guidance * (c - u), i)
        return x


def _parallel(
    policy: Policy,
    sample: Sample,
    x: torch.Tensor,
    integ: Integrator,
    plan: Sequence[bool],
    guidance: float,
    cfg_group: CfgGroup,
    rtc: RtcBatch | None = None,
) -> torch.Tensor:
    """cfgp=2: this rank's branch, one all_gather per guided step.

    Both ranks know ``plan``, so they agree on which steps have a collective:
    an unguided step runs on the conditional rank alone, and before a guided
    step that follows unguided ones the conditional rank's ``x`` is gathered
    (the unconditional rank's is stale).  The unconditional rank's result is
    never used.
    """
    rows = x.shape[0]
    n = len(plan)
    branch = Branch(cfg_group.cfg_index)
    ctx = _guarded(policy.condition, sample, branch)
    failed = torch.zeros((), device=x.device, dtype=torch.float32)
    if ctx is None:
        failed = failed + 1
    if rtc is not None:
        rtc.start(x)
        if rtc.guided and ctx is not None:
            ctx = detached(ctx)
    for i in range(n):
        t = integ.time(i, rows, x.device)
        if not plan[i]:
            if branch is Branch.UNCOND:
                continue
            if rtc is not None:  # this rank alone: the same correction as on one rank
                v = _guarded(_rtc_alone, rtc, policy, ctx, x, t, float(integ.timesteps[i])) if ctx is not None else None
            else:
                v = _guarded(policy.denoise_step, ctx, x, t) if ctx is not None else None
            if v is None:
                v, failed = torch.zeros_like(x), failed + 1
                ctx = None
            x = integ.step(x, v, i)
            if rtc is not None:
                x = rtc.inpaint(x, time_after(integ.timesteps, i))
            continue
        if i > 0 and not plan[i - 1]:  # the unconditional rank skipped the steps before: take the driver's x
            gathered = _all_gather(torch.cat([x.float().flatten(), failed.reshape(1)]), cfg_group, x.device, i, n)
            x = gathered[0][:-1].view_as(x).to(x.dtype)
            failed = torch.maximum(gathered[0][-1], gathered[1][-1])
        x_g = None  # guided RTC: this branch's output keeps its graph for the VJP below
        if rtc is not None and rtc.guided and ctx is not None:
            with grad_enabled():
                x_g = x.clone().requires_grad_(True)
                v = _guarded(policy.denoise_step, ctx, x_g, t)
        else:
            v = _guarded(policy.denoise_step, ctx, x, t) if ctx is not None else None
        if v is None:
            v, failed = torch.zeros_like(x), failed + 1
            ctx = None  # stop computing, keep joining the collectives
        gathered = _all_gather(torch.cat([v.detach().float().flatten(), failed.reshape(1)]), cfg_group, x.device, i, n)
        c = gathered[0][:-1].view_as(x).to(x.dtype)
        u = gathered[1][:-1].view_as(x).to(x.dtype)
        failed = torch.maximum(gathered[0][-1], gathered[1][-1])
        out = u + guidance * (c - u)
        if rtc is not None:
            out, failed = _rtc_parallel(
                rtc, out, x, x_g, v, branch, guidance, float(integ.timesteps[i]), failed, cfg_group, i, n
            )
        x = integ.step(x, out, i)
        if rtc is not None:
            x = rtc.inpaint(x, time_after(integ.timesteps, i))
    if failed.item() > 0:  # the one host sync, after the loop
        raise PeerFailed("inference failed on a cfg rank; see that rank's log")
    return x


def _rtc_alone(
    rtc: RtcBatch, policy: Policy, ctx: Context, x: torch.Tensor, t: torch.Tensor, time: float
) -> torch.Tensor:
    """An unguided step's corrected output under cfgp=2, on the conditional rank alone."""

    def forward(z: torch.Tensor) -> Step:
        v = policy.denoise_step(ctx, z, t)
        return v, [(v, 1.0)]

    return guided_velocity(rtc, forward, x, time)


def _rtc_parallel(
    rtc: RtcBatch,
    out: torch.Tensor,
    x: torch.Tensor,
    x_g: torch.Tensor | None,
    v: torch.Tensor,
    branch: Branch,
    guidance: float,
    time: float,
    failed: torch.Tensor,
    cfg_group: CfgGroup,
    i: int,
    n: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A guided step's RTC correction under cfgp=2: both ranks see the same constraint and the same ``out``.

    ``guided``: each rank takes the VJP of its own branch with its coefficient in ``out`` (``g`` for the
    conditional, ``1 - g`` for the unconditional) and one more all_gather sums them, in the order one rank
    sums them in ``sample_rtc`` -- so cfgp=2 computes what cfgp=1 computes.
    """
    e = rtc.error(x, out, time)
    if not rtc.guided:
        return rtc.correct(out, e, time), failed
    coef = guidance if branch is Branch.COND else 1.0 - guidance
    with grad_enabled():
        r = _guarded(vjp, v, x_g, coef * e) if x_g is not None and v.requires_grad else None
    if r is None:
        r, failed = torch.zeros_like(x), failed + 1
    gathered = _all_gather(torch.cat([r.float().flatten(), failed.reshape(1)]), cfg_group, x.device, i, n)
    r_c = gathered[0][:-1].view_as(x).to(x.dtype)
    r_u = gathered[1][:-1].view_as(x).to(x.dtype)
    failed = torch.maximum(gathered[0][-1], gathered[1][-1])
    return rtc.correct(out, e - time * (r_c + r_u), time), failed


def _all_gather(payload: torch.Tensor, cfg_group: CfgGroup, device: torch.device, i: int, n: int) -> list[torch.Tensor]:
    """Both ranks' ``payload`` on ``device``, cond rank's first; ReplicaFailed when the collective itself fails."""
    if cfg_group.host_staging:
        payload = payload.cpu()
    gathered = [torch.empty_like(payload) for _ in range(2)]
    try:
        dist.all_gather(gathered, payload, group=cfg_group.group)
    except Exception as exc:  # noqa: BLE001 - gloo: timeout or closed pair; the group is unusable now
        raise ReplicaFailed(
            f"cfg collective failed at step {i + 1} of {n}: "
            f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}"
        ) from exc
    return [g.to(device, non_blocking=True) for g in gathered]


def _guarded(fn: Callable[..., Context], *args: object) -> Context | None:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported through the failure flag, logged here
        log.exception("cfg branch computation failed")
        return None
