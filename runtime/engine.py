"""The ingress side of a pod: validate, route, and run requests on dp replicas.

Lives on global rank 0 next to the WebSocket server.  ``prepare`` (validation
and preprocessing) runs here, before routing, so invalid input never reaches a
replica.  Each replica has one single-thread executor: replica 0's is the
model thread of this process (build, warm-up and inference on one thread, as
OpenMP wants), replica k's is a dispatcher thread that hands the request to
replica k's driver over their gloo dispatch group and waits for the reply.  D
replicas therefore run D requests at once while each stays serial, which is
what keeps every replica's collectives in order.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch.distributed as dist

from policy_operator import __version__
from policy_operator.layout import ParallelLayout
from policy_operator.readyz import LayoutDoc, Readiness, all_ranks_ready
from policy_operator.runtime.health import Board
from policy_operator.runtime.observation import parse_seed, parse_session
from policy_operator.runtime.policy import Policy
from policy_operator.runtime.replica import OP_INFER, OP_SHUTDOWN, Job, RequestFailed, SamplerSettings
from policy_operator.runtime.router import Router

log = logging.getLogger(__name__)


class NotReady(RuntimeError):
    kind = "unavailable"


@dataclass
class Result:
    actions: np.ndarray
    replica: int
    prepare_ms: float
    queue_ms: float
    infer_ms: float


class ReplicaHandle:
    """A serial lane to one replica; ``call`` runs on the lane's own thread."""

    def __init__(self, index: int, executor: ThreadPoolExecutor, call: Callable[[Job], dict[str, Any]]) -> None:
        self.index = index
        self.executor = executor
        self._call = call

    async def run(self, job: Job) -> tuple[dict[str, Any], float]:
        enqueued = time.perf_counter()

        def timed() -> tuple[dict[str, Any], float]:
            queue_ms = (time.perf_counter() - enqueued) * 1e3
            return self._call(job), queue_ms

        return await asyncio.get_running_loop().run_in_executor(self.executor, timed)


def remote_call(index: int, driver: int, group: dist.ProcessGroup) -> Callable[[Job], dict[str, Any]]:
    def call(job: Job) -> dict[str, Any]:
        dist.send_object_list([{"op": OP_INFER, "job": job}], dst=driver, group=group)
        reply: list[Any] = [None]
        dist.recv_object_list(reply, src=driver, group=group)
        return reply[0]

    return call


def remote_shutdown(driver: int, group: dist.ProcessGroup) -> Callable[[], None]:
    def call() -> None:
        dist.send_object_list([{"op": OP_SHUTDOWN}], dst=driver, group=group)

    return call


class Engine:
    """What the server needs: metadata, readiness, ``infer``, drain."""

    def __init__(self, layout: ParallelLayout, settings: SamplerSettings, board: Board) -> None:
        self.layout = layout
        self.settings = settings
        self.board = board
        self.router = Router(layout.dp)
        self.replicas: list[ReplicaHandle] = []
        self.shutdown_calls: list[tuple[ThreadPoolExecutor, Callable[[], None]]] = []
        self.policy: Policy | None = None
        self.load_error: str | None = None
        self.draining = False
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")

    # --- wiring (called by the worker) ----------------------------------------------
    def attach(self, policy: Policy, replicas: list[ReplicaHandle]) -> None:
        self.policy = policy
        self.replicas = replicas

    @property
    def accepting(self) -> bool:
        return self.policy is not None and not self.draining and self.load_error is None

    def metadata(self) -> dict[str, Any]:
        assert self.policy is not None
        meta = dict(self.policy.metadata())
        meta.update({
            "server": "policy-operator",
            "server_version": __version__,
            "layout": self.layout.as_dict(),
            "steps": self.settings.steps,
            "guidance": self.settings.guidance,
            "action_shape": list(self.policy.action_shape),
        })
        return meta

    def readiness(self) -> Readiness:
        ranks = self.board.snapshot()
        return Readiness(
            ready=all_ranks_ready(ranks, self.layout.world_size) and self.accepting,
            layout=LayoutDoc(**self.layout.as_dict()),
            world_size=self.layout.world_size,
            ranks_ready=sum(1 for r in ranks if r.ready),
            ranks=ranks,
            in_flight=self.router.total_in_flight(),
            draining=self.draining,
            error=self.load_error,
        )

    # --- the request path --------------------------------------------------------------
    async def infer(self, obs: dict[str, Any]) -> Result:
        if not self.accepting:
            raise NotReady("server is shutting down" if self.draining else "server is not ready yet")
        assert self.policy is not None
        t0 = time.perf_counter()
        seed = parse_seed(obs)
        session = parse_session(obs)
        sample = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.policy.prepare, obs)
        prepare_ms = (time.perf_counter() - t0) * 1e3
        job = Job(uuid.uuid4().hex, sample, secrets.randbits(63) if seed is None else seed)
        index = self.router.acquire(session)
        try:
            reply, queue_ms = await self.replicas[index].run(job)
        finally:
            self.router.release(index)
        if not reply["ok"]:
            raise RequestFailed(reply["kind"], reply["message"])
        return Result(reply["actions"], index, prepare_ms, queue_ms, reply["infer_ms"])

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests and wait for in-flight ones; True when all finished in time."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.router.total_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.router.total_in_flight() == 0

    def stop_replicas(self) -> None:
        """Send the shutdown sentinel down every lane, queued behind anything still running."""
        futures = [executor.submit(call) for executor, call in self.shutdown_calls]
        for f in futures:
            try:
                f.result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead replica needs no sentinel
                log.warning("shutdown sentinel not delivered: %s", exc)
