"""The ingress of a pod: prepare, route, and hand each request to a replica's lane.

Lives on global rank 0 next to the WebSocket server.  ``prepare`` (validation
and preprocessing) runs here, before routing, so invalid input never reaches a
replica.  The router picks a replica and the request goes down that replica's
lane (``parallel/dispatch.py``): replica 0's lane is the model thread of this
process (build, warm-up and inference on one thread, as OpenMP wants), replica
k's hands the request to replica k's driver over their gloo dispatch group.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from policy_operator import __version__
from policy_operator.layout import ParallelLayout
from policy_operator.readyz import LayoutDoc, Readiness, all_ranks_ready
from policy_operator.runtime.parallel.dispatch import InferenceRequest, Lane
from policy_operator.runtime.parallel.heartbeat import Board
from policy_operator.runtime.policy.interface import Policy
from policy_operator.runtime.policy.observation import parse_seed, parse_session
from policy_operator.runtime.policy.sampler import SamplerSettings
from policy_operator.runtime.serving.errors import NotReady
from policy_operator.runtime.serving.router import Router

log = logging.getLogger(__name__)


@dataclass
class Result:
    actions: np.ndarray
    replica: int
    prepare_ms: float
    queue_ms: float
    infer_ms: float


class Ingress:
    """What the server needs: metadata, readiness, ``infer``, drain."""

    def __init__(self, layout: ParallelLayout, settings: SamplerSettings, board: Board) -> None:
        self.layout = layout
        self.settings = settings
        self.board = board
        self.router = Router(layout.dp)
        self.lanes: list[Lane] = []
        self.policy: Policy | None = None
        self.load_error: str | None = None
        self.draining = False
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")

    # --- wiring (called by the worker) ----------------------------------------------
    def attach(self, policy: Policy, lanes: list[Lane]) -> None:
        self.policy = policy
        self.lanes = lanes

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
        request = InferenceRequest(uuid.uuid4().hex, sample, secrets.randbits(63) if seed is None else seed)
        index = self.router.acquire(session)
        try:
            reply, queue_ms = await self.lanes[index].submit(request)
        finally:
            self.router.release(index)
        return Result(reply.unwrap(), index, prepare_ms, queue_ms, reply.infer_ms)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests and wait for in-flight ones; True when all finished in time."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.router.total_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.router.total_in_flight() == 0

    def stop_lanes(self) -> None:
        """Send Shutdown down every lane, queued behind anything still running."""
        futures = [lane.stop() for lane in self.lanes]
        for f in futures:
            try:
                f.result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead replica needs no Shutdown
                log.warning("shutdown not delivered: %s", exc)
