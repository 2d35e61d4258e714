"""What the ranks of one dp replica do with a request.

The driver (cfg index 0) runs ``execute``: it sends the *already validated*
request to its cfg peer on the replica's gloo control group, runs its branch,
and postprocesses; the peer (cfg index 1) sits in ``peer_loop``.  Remote
drivers (replicas >= 1, not on global rank 0) sit in ``driver_loop`` and get
their requests from the ingress on their dispatch group.  Every loop wraps one
request in try/except and carries on: a failed request is reported, never
fatal (the seed PR's bug 1).  A ``shutdown`` message ends every loop, so no
rank is left holding a GPU when rank 0 goes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from policy_operator.runtime.groups import Groups
from policy_operator.runtime.health import Heartbeat, RankState
from policy_operator.runtime.policy import Policy, Sample
from policy_operator.runtime.sampler import CfgGroup, CfgMode, sample_actions

log = logging.getLogger(__name__)

OP_INFER = "infer"
OP_SHUTDOWN = "shutdown"


@dataclass
class Job:
    request_id: str
    sample: Sample
    seed: int


@dataclass(frozen=True)
class SamplerSettings:
    steps: int
    guidance: float
    cfg_mode: CfgMode  # for cfgp=1; cfgp=2 is always "parallel"


class RequestFailed(RuntimeError):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def _broadcast(obj: Any, src: int, group: dist.ProcessGroup) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


class ReplicaWorker:
    """One rank's share of its replica: owns the policy and the replica's groups."""

    def __init__(self, policy: Policy, groups: Groups, settings: SamplerSettings, heartbeat: Heartbeat) -> None:
        self.policy = policy
        self.groups = groups
        self.settings = settings
        self.heartbeat = heartbeat
        self._cfg = None
        if groups.layout.cfgp == 2:
            staging = policy.device.type == "cuda" and dist.get_backend(groups.cfg) == "gloo"
            self._cfg = CfgGroup(groups.cfg, groups.cfg_index, staging)

    def _sample(self, job: Job) -> torch.Tensor:
        s = self.settings
        mode: CfgMode = "parallel" if self._cfg is not None else s.cfg_mode
        return sample_actions(self.policy, job.sample, job.seed, steps=s.steps, guidance=s.guidance, mode=mode,
                              cfg_group=self._cfg)

    def _done(self) -> None:
        self.heartbeat.set_state(RankState.WARM)

    # --- driver side -------------------------------------------------------------
    def execute(self, job: Job) -> tuple[np.ndarray, float]:
        """Run one validated request on this replica; returns (actions, infer_ms)."""
        self.heartbeat.set_state(RankState.SERVING)
        start = time.perf_counter()
        try:
            if self._cfg is not None:
                _broadcast({"op": OP_INFER, "job": job}, self.groups.driver, self.groups.replica_ctrl)
            x = self._sample(job)
            actions = self.policy.postprocess(x)
            if self.policy.device.type == "cuda":
                torch.cuda.synchronize(self.policy.device)
            return actions, (time.perf_counter() - start) * 1e3
        finally:
            self._done()

    def execute_reply(self, job: Job) -> dict[str, Any]:
        try:
            actions, infer_ms = self.execute(job)
            return {"ok": True, "actions": actions, "infer_ms": infer_ms}
        except Exception as exc:  # noqa: BLE001 - reported to the client, the replica carries on
            log.exception("request %s failed on replica %d", job.request_id, self.groups.dp_index)
            return {"ok": False, "kind": getattr(exc, "kind", "inference_failed"), "message": f"{type(exc).__name__}: {exc}"}

    def shutdown_peers(self) -> None:
        if self._cfg is not None:
            try:
                _broadcast({"op": OP_SHUTDOWN}, self.groups.driver, self.groups.replica_ctrl)
            except Exception as exc:  # noqa: BLE001 - a dead peer has nothing left to stop
                log.warning("could not send shutdown to the cfg peer: %s", exc)

    def driver_loop(self) -> None:
        """Remote driver: requests from rank 0 on the dispatch group until shutdown."""
        group = self.groups.dispatch[self.groups.dp_index]
        while True:
            msg = [None]
            dist.recv_object_list(msg, src=0, group=group)
            if msg[0]["op"] == OP_SHUTDOWN:
                log.info("replica %d: shutdown", self.groups.dp_index)
                self.shutdown_peers()
                return
            reply = self.execute_reply(msg[0]["job"])
            dist.send_object_list([reply], dst=0, group=group)

    # --- peer side ---------------------------------------------------------------
    def peer_loop(self) -> None:
        """cfg index 1: the unconditional branch of every request until shutdown."""
        while True:
            msg = _broadcast(None, self.groups.driver, self.groups.replica_ctrl)
            if msg["op"] == OP_SHUTDOWN:
                log.info("rank %d: shutdown", self.groups.rank)
                return
            job: Job = msg["job"]
            self.heartbeat.set_state(RankState.SERVING)
            try:
                self._sample(job)  # the result is the driver's; this rank only contributes its branch
            except Exception:  # noqa: BLE001 - the driver fails the request too; keep looping
                log.exception("request %s failed on rank %d", job.request_id, self.groups.rank)
            finally:
                self._done()
