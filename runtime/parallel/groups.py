"""Process groups of one pod, built once from the ``ParallelLayout``.

Two kinds of group, because a rank that waits for work on an ordinary group
is killed by the process-group watchdog once the server has been idle for
longer than the PG timeout: ranks that wait for work wait on *gloo control
groups with a year-long timeout*; the per-step CFG exchange uses the default
backend (NCCL on CUDA) with the normal timeout, and only while a request runs.

* ``world_ctrl``: everyone; start-up (checkpoint path broadcast).
* ``replica_ctrl``: the ranks of this rank's replica; the driver's one-byte
  wake-up, on which an idle peer waits.
* ``cfg``: same ranks, default backend (cfgp=2 only); the request the driver
  hands its peer right after the wake-up (so a frozen peer fails the replica
  within the PG timeout), then the per-step all_gather.
* ``dispatch[k]``: {0, driver of replica k} for k >= 1; the ingress on rank 0
  hands replica k its requests and gets results back.

``torch.distributed.new_group`` must be called by every rank, in the same
order, for every group: that is why all groups are built here in one loop.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from policy_operator.layout import ParallelLayout

log = logging.getLogger(__name__)

CONTROL_TIMEOUT = timedelta(days=365)


@dataclass
class Groups:
    """This rank's groups and coordinates (fixed for the life of the process, so computed once)."""

    layout: ParallelLayout
    rank: int
    world_ctrl: dist.ProcessGroup | None = None
    replica_ctrl: dist.ProcessGroup | None = None
    cfg: dist.ProcessGroup | None = None
    dispatch: dict[int, dist.ProcessGroup] = field(default_factory=dict)
    dp_index: int = field(init=False)
    cfg_index: int = field(init=False)
    driver: int = field(init=False)  # global rank of this replica's driver (cfg index 0)

    def __post_init__(self) -> None:
        self.dp_index, self.cfg_index = self.layout.coords(self.rank)
        self.driver = self.layout.driver_rank(self.dp_index)


def data_backend(device: torch.device, requested: str = "auto") -> str:
    """NCCL on CUDA, gloo on CPU; gloo on CUDA exchanges through host memory (functional checks)."""
    if requested != "auto":
        return requested
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(
    layout: ParallelLayout, device: torch.device, pg_timeout: timedelta, backend: str = "auto"
) -> Groups:
    """Join the torchrun job and build every group; single-process serving skips it."""
    if layout.world_size == 1:
        return Groups(layout, 0)
    backend = data_backend(device, backend)
    if backend == "nccl":  # bind the communicator to this rank's GPU up front
        dist.init_process_group(backend=backend, timeout=pg_timeout, device_id=device)
    else:
        dist.init_process_group(backend=backend, timeout=pg_timeout)
    rank = dist.get_rank()
    if dist.get_world_size() != layout.world_size:
        raise RuntimeError(f"torchrun started {dist.get_world_size()} ranks for {layout.label}")
    groups = Groups(layout, rank)
    groups.world_ctrl = dist.new_group(list(range(layout.world_size)), backend="gloo", timeout=CONTROL_TIMEOUT)
    for k in range(layout.dp):
        ranks = layout.replica_ranks(k)
        ctrl = dist.new_group(ranks, backend="gloo", timeout=CONTROL_TIMEOUT) if layout.cfgp > 1 else None
        cfg = dist.new_group(ranks, timeout=pg_timeout) if layout.cfgp > 1 else None
        if rank in ranks:
            groups.replica_ctrl, groups.cfg = ctrl, cfg
    for k in range(1, layout.dp):
        g = dist.new_group([0, layout.driver_rank(k)], backend="gloo", timeout=CONTROL_TIMEOUT)
        if rank in (0, layout.driver_rank(k)):
            groups.dispatch[k] = g
    log.info("rank %d/%d joined %s (backend %s, pid %d)", rank, layout.world_size, layout.label, backend, os.getpid())
    return groups


def select_device(name: str, share: bool = False) -> torch.device:
    """One GPU per rank by LOCAL_RANK; CPU otherwise.

    ``share`` (``--share-gpu``) lets ranks outnumber GPUs for functional checks
    on one GPU; in production a missing GPU is an error, not a silent share.
    """
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda but no CUDA device is visible")
        index = int(os.environ.get("LOCAL_RANK", "0"))
        if share:
            index %= torch.cuda.device_count()
        if index >= torch.cuda.device_count():
            raise RuntimeError(f"LOCAL_RANK {index} but only {torch.cuda.device_count()} CUDA devices are visible")
        torch.cuda.set_device(index)
        return torch.device("cuda", index)
    if name != "cpu":
        raise ValueError(f"unknown device {name!r}")
    return torch.device("cpu")
