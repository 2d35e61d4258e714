"""How a request travels between the ranks of a pod: the whole protocol, both ends, in one module.

::

    rank 0 (ingress)                   driver of replica k (cfg index 0)        cfg peer (cfg index 1)
    Lane k --InferenceRequest-------->  Replica.serve_driver  (k >= 1 only)
                                        Replica.execute --InferenceRequest-->  Replica.serve_peer
                                          both: sample_actions, one all_gather per step
    Lane k <-------------------Reply--  postprocess (driver only)
    Lane k --Shutdown---------------->  --Shutdown-------------------------->  (loops end)

Replica 0's driver is global rank 0 itself: its lane calls ``Replica.answer``
on rank 0's model thread instead of sending.  Replica k >= 1 is reached over
the gloo dispatch group {0, driver_k}; inside a replica the driver broadcasts
on the replica's gloo control group.  Messages are typed dataclasses, pickled
by ``torch.distributed``'s object collectives.  Every loop handles one request
in try/except and carries on: a failed request is a ``Reply`` with an error,
never the end of a rank -- except when a collective itself failed
(``ReplicaFailed``: a peer died or froze past ``--pg-timeout-s``).  A failed
communicator is never used again: the rank publishes ``failed``, its loop
ends and the rank exits non-zero, so torchrun stops the pod and it restarts
(NCCL's watchdog does the same on a GPU; docs/runtime.md).  Actions with NaN
or inf are never sent: the driver fails that request with
``non_finite_actions``.  ``Shutdown`` ends every loop, so no rank is left
holding a GPU when rank 0 goes.

Each lane is one single-thread executor: D replicas run D requests at once
while each replica stays serial, which keeps every replica's collectives in
the same order on all of its ranks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from policy_operator.readyz import RankState
from policy_operator.runtime.parallel.groups import Groups
from policy_operator.runtime.parallel.heartbeat import Heartbeat
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.sampler import CfgGroup, CfgMode, SamplerSettings, sample_actions
from policy_operator.runtime.serving.errors import (
    ErrorKind,
    NonFiniteActions,
    ReplicaFailed,
    RequestError,
    RequestFailed,
)

log = logging.getLogger(__name__)


# --- messages --------------------------------------------------------------------------------
@dataclass(frozen=True)
class InferenceRequest:
    """One validated request (``Policy.prepare`` already ran on rank 0), ready for any rank."""

    request_id: str
    sample: Sample
    seed: int


@dataclass(frozen=True)
class Reply:
    """What a replica's driver sends back: the actions, or why there are none."""

    request_id: str
    infer_ms: float
    actions: np.ndarray | None = None
    error_kind: ErrorKind | None = None
    error: str = ""

    def unwrap(self) -> np.ndarray:
        """The actions; ``RequestFailed`` with the replica's kind and message when it failed."""
        if self.error_kind is not None or self.actions is None:
            raise RequestFailed(self.error, self.error_kind or ErrorKind.INFERENCE_FAILED)
        return self.actions


@dataclass(frozen=True)
class Shutdown:
    """Ends the receiving loop (and, from a driver, its peer's)."""


Message = InferenceRequest | Shutdown


def _send(message: Message | Reply, dst: int, group: dist.ProcessGroup) -> None:
    dist.send_object_list([message], dst=dst, group=group)


def _recv(src: int, group: dist.ProcessGroup) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def _broadcast(message: Message | None, src: int, group: dist.ProcessGroup | None) -> Message:
    # None would mean the default (world) group: every replica's ranks, not this replica's two
    assert group is not None, "only a cfgp=2 replica broadcasts to its peer"
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]  # type: ignore[return-value]


# --- the ranks of one replica --------------------------------------------------------------------
class Replica:
    """One rank's share of its replica: owns the policy and the replica's groups."""

    def __init__(self, policy: Policy, groups: Groups, settings: SamplerSettings, heartbeat: Heartbeat) -> None:
        self.policy = policy
        self.groups = groups
        self.settings = settings
        self.heartbeat = heartbeat
        self._cuda = policy.device.type == "cuda"
        self.broken: str | None = None  # why a collective of this replica failed; set once, never cleared
        self._cfg: CfgGroup | None = None
        if groups.layout.cfgp == 2:
            assert groups.cfg is not None, "a cfgp=2 replica has a cfg group"
            staging = self._cuda and dist.get_backend(groups.cfg) == "gloo"
            self._cfg = CfgGroup(groups.cfg, groups.cfg_index, staging)

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """``serving`` in /readyz while this rank works on a request, ``warm`` again after (unless broken)."""
        self.heartbeat.set_state(RankState.SERVING)
        try:
            yield
        finally:
            if self.broken is None:
                self.heartbeat.set_state(RankState.WARM)

    def _sample(self, request: InferenceRequest) -> torch.Tensor:
        s = self.settings
        mode: CfgMode = "parallel" if self._cfg is not None else s.cfg_mode
        return sample_actions(self.policy, request.sample, request.seed, steps=s.steps, guidance=s.guidance,
                              mode=mode, cfg_group=self._cfg)

    # --- driver side (cfg index 0) ---------------------------------------------------------
    def execute(self, request: InferenceRequest) -> tuple[np.ndarray, float]:
        """Run one request on this replica (peer included); (actions, infer_ms), or the failure raised."""
        with self._serving():
            start = time.perf_counter()
            if self._cfg is not None:
                _broadcast(request, self.groups.driver, self.groups.replica_ctrl)
            actions = self.policy.postprocess(self._sample(request))
            if self._cuda:
                torch.cuda.synchronize(self.policy.device)
            return actions, (time.perf_counter() - start) * 1e3

    def answer(self, request: InferenceRequest) -> Reply:
        """``execute`` as a Reply: a failure is reported to the client and this replica carries on.

        Unless a collective failed: then the Reply says ``replica_failed`` and ``broken`` is set.
        """
        start = time.perf_counter()
        if self.broken is not None:
            return Reply(request.request_id, 0.0, error_kind=ErrorKind.REPLICA_FAILED, error=self.broken)
        try:
            actions, infer_ms = self.execute(request)
            bad = int(np.size(actions) - np.count_nonzero(np.isfinite(actions)))
            if bad:
                raise NonFiniteActions(f"the policy produced {bad} NaN or inf values in its {np.shape(actions)} "
                                       "actions; none were sent")
            return Reply(request.request_id, infer_ms, actions)
        except Exception as exc:  # noqa: BLE001 - reported to the client, the replica carries on
            kind = exc.kind if isinstance(exc, RequestError) else ErrorKind.INFERENCE_FAILED
            if isinstance(exc, ReplicaFailed):
                self.fail(str(exc))
            elif isinstance(exc, NonFiniteActions):
                log.warning("request %s on replica %d: %s", request.request_id, self.groups.dp_index, exc)
            else:
                log.exception("request %s failed on replica %d", request.request_id, self.groups.dp_index)
            return Reply(request.request_id, (time.perf_counter() - start) * 1e3, error_kind=kind,
                         error=f"{type(exc).__name__}: {exc}")

    def fail(self, reason: str) -> None:
        """Take this rank's replica out of service for good: ``failed`` in /readyz, loops end, the rank exits."""
        if self.broken is None:
            self.broken = reason
            log.error("rank %d: replica %d is out of service, its communicator is never used again: %s",
                      self.groups.rank, self.groups.dp_index, reason)
        self.heartbeat.set_state(RankState.FAILED, reason)

    def stop_peer(self) -> None:
        if self._cfg is not None and self.broken is None:  # a broken replica's groups are never used again
            try:
                _broadcast(Shutdown(), self.groups.driver, self.groups.replica_ctrl)
            except Exception as exc:  # noqa: BLE001 - a dead peer has nothing left to stop
                log.warning("could not send shutdown to the cfg peer: %s", exc)

    def serve_driver(self) -> None:
        """Driver of replica k >= 1: requests from rank 0 on the dispatch group until Shutdown."""
        group = self.groups.dispatch[self.groups.dp_index]
        while True:
            message = _recv(0, group)
            if isinstance(message, Shutdown):
                log.info("replica %d: shutdown", self.groups.dp_index)
                self.stop_peer()
                return
            _send(self.answer(message), 0, group)
            if self.broken is not None:
                return  # the worker exits non-zero; the peer saw the same failure

    # --- peer side (cfg index 1) -------------------------------------------------------------
    def serve_peer(self) -> None:
        """The unconditional branch of every request its driver broadcasts, until Shutdown."""
        while True:
            message = _broadcast(None, self.groups.driver, self.groups.replica_ctrl)
            if isinstance(message, Shutdown):
                log.info("rank %d: shutdown", self.groups.rank)
                return
            with self._serving():
                try:
                    self._sample(message)  # the result is the driver's; this rank only contributes its branch
                except ReplicaFailed as exc:
                    self.fail(str(exc))
                except Exception:  # noqa: BLE001 - the driver fails the request too; keep looping
                    log.exception("request %s failed on rank %d", message.request_id, self.groups.rank)
            if self.broken is not None:
                return  # the worker exits non-zero


# --- rank 0's end: one lane per replica ------------------------------------------------------------
class Lane:
    """A serial path from the ingress to one replica; ``call`` and ``stop`` run on the lane's own thread."""

    def __init__(self, index: int, executor: ThreadPoolExecutor, call: Callable[[InferenceRequest], Reply],
                 stop: Callable[[], None]) -> None:
        self.index = index
        self.executor = executor
        self._call = call
        self._stop = stop

    async def submit(self, request: InferenceRequest) -> tuple[Reply, float]:
        """The replica's reply and how long the request queued for the lane (ms)."""
        enqueued = time.perf_counter()

        def timed() -> tuple[Reply, float]:
            queue_ms = (time.perf_counter() - enqueued) * 1e3
            return self._call(request), queue_ms

        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)

    def stop(self) -> Future[None]:
        """Send Shutdown down the lane, queued behind anything still running on it."""
        return self.executor.submit(self._stop)


def local_lane(replica: Replica, executor: ThreadPoolExecutor) -> Lane:
    """Replica 0: rank 0 is its driver, so the lane runs it on rank 0's model thread."""
    return Lane(0, executor, replica.answer, replica.stop_peer)


def remote_lane(index: int, driver: int, group: dist.ProcessGroup, executor: ThreadPoolExecutor) -> Lane:
    """Replica ``index`` >= 1: hand the request to its driver over their dispatch group, wait for the Reply."""

    def call(request: InferenceRequest) -> Reply:
        _send(request, driver, group)
        return _recv(driver, group)

    return Lane(index, executor, call, lambda: _send(Shutdown(), driver, group))
