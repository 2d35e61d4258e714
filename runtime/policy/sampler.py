"""The flow-matching sampler and the three ways to run classifier-free guidance.

Euler integration from noise (t=1) to actions (t=0).  Per step the guided
velocity is ``u + g * (c - u)``; where the two branch velocities come from is
the only thing that differs between layouts:

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
captured at warm-up.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

from policy_operator.runtime.policy.interface import Branch, Policy, Sample
from policy_operator.runtime.errors import PeerFailed, ReplicaFailed

log = logging.getLogger(__name__)

CfgMode = Literal["sequential", "batched", "parallel"]


@dataclass(frozen=True)
class SamplerSettings:
    """The server's sampling flags (--steps, --guidance, --cfg-mode), the same for every request."""

    steps: int
    guidance: float
    cfg_mode: CfgMode  # for cfgp=1; cfgp=2 is always "parallel"
    buckets: tuple[int, ...] = ()  # batch sizes a batch is padded up to (compiled denoisers); () = no padding


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
    steps: int,
    guidance: float,
    mode: CfgMode = "sequential",
    cfg_group: CfgGroup | None = None,
) -> torch.Tensor:
    """Final ``x`` of the batch (one row per seed) on this rank; the output rank postprocesses it.

    ``sample`` is a collated batch (or one prepared sample) with one row per seed.
    """
    if steps < 1:
        raise ValueError(f"steps must be >= 1, got {steps}")
    rows = len(seeds)
    if rows < 1 or sample.batch_size != rows:
        raise ValueError(f"{rows} seeds for a sample of {sample.batch_size} rows")
    guided = float(guidance) != 1.0
    if mode == "parallel" and (cfg_group is None or not guided):
        raise ValueError("parallel CFG needs a cfg group and guidance != 1.0")
    with torch.inference_mode():
        x = torch.cat([policy.init_noise(seed) for seed in seeds])
        dt = -1.0 / steps
        failed: torch.Tensor | None = None
        if mode == "parallel":
            assert cfg_group is not None
            branch = Branch(cfg_group.cfg_index)
            ctx = _guarded(policy.condition, sample, branch)
            failed = torch.zeros((), device=x.device, dtype=torch.float32)
            if ctx is None:
                failed = failed + 1
            for i in range(steps):
                t = torch.full((rows,), 1.0 - i / steps, device=x.device, dtype=torch.float32)
                v = _guarded(policy.denoise_step, ctx, x, t) if ctx is not None else None
                if v is None:
                    v, failed = torch.zeros_like(x), failed + 1
                    ctx = None  # stop computing, keep joining the collectives
                payload = torch.cat([v.float().flatten(), failed.reshape(1)])
                if cfg_group.host_staging:
                    payload = payload.cpu()
                gathered = [torch.empty_like(payload) for _ in range(2)]
                try:
                    dist.all_gather(gathered, payload, group=cfg_group.group)
                except Exception as exc:  # noqa: BLE001 - gloo: timeout or closed pair; the group is unusable now
                    raise ReplicaFailed(f"cfg collective failed at step {i + 1} of {steps}: "
                                        f"{str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__}") from exc
                gathered = [g.to(x.device, non_blocking=True) for g in gathered]
                c = gathered[0][:-1].view_as(x).to(x.dtype)
                u = gathered[1][:-1].view_as(x).to(x.dtype)
                failed = torch.maximum(gathered[0][-1], gathered[1][-1])
                x = x + dt * (u + guidance * (c - u))
            if failed.item() > 0:  # the one host sync, after the loop
                raise PeerFailed("inference failed on a cfg rank; see that rank's log")
            return x
        ctx_c = policy.condition(sample, Branch.COND)
        if not guided:
            for i in range(steps):
                t = torch.full((rows,), 1.0 - i / steps, device=x.device, dtype=torch.float32)
                x = x + dt * policy.denoise_step(ctx_c, x, t)
            return x
        ctx_u = policy.condition(sample, Branch.UNCOND)
        if mode == "batched":
            ctx = torch.cat([ctx_c, ctx_u.expand_as(ctx_c)])
            for i in range(steps):
                t = torch.full((2 * rows,), 1.0 - i / steps, device=x.device, dtype=torch.float32)
                c, u = policy.denoise_step(ctx, torch.cat([x, x]), t).chunk(2)
                x = x + dt * (u + guidance * (c - u))
            return x
        if mode != "sequential":
            raise ValueError(f"unknown cfg mode {mode!r}")
        for i in range(steps):
            t = torch.full((rows,), 1.0 - i / steps, device=x.device, dtype=torch.float32)
            c = policy.denoise_step(ctx_c, x, t)
            u = policy.denoise_step(ctx_u, x, t)
            x = x + dt * (u + guidance * (c - u))
        return x


def _guarded(fn: Callable[..., torch.Tensor], *args: object) -> torch.Tensor | None:
    try:
        return fn(*args)
    except Exception:  # noqa: BLE001 - reported through the failure flag, logged here
        log.exception("cfg branch computation failed")
        return None
