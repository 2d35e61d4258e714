"""The front-end process's ``EngineClient`` (``--frontend process``): the engine behind the ring and channel.

Each admitted request is shipped to the model process over the ring and
channel of ``ipc.py``, its Result awaited.

The other end is ``engine.link.FrontendLink`` in the model process, which
submits the same ``PreparedRequest`` to the ``Engine``.  Readiness comes as
snapshots the model process pushes several times per heartbeat period:
``/readyz`` is 503 whenever the last one is older than ``stale_after`` (a
frozen model process).  Engine-side metrics (batch sizes, load and warm-up
times, bucket times, download progress) arrive as messages and go to this
process's ``ServerMetrics``.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from policy_operator.readyz import LayoutDoc, Readiness
from policy_operator.runtime import ipc
from policy_operator.runtime.engine_api import AdmissionSpec, PreparedRequest
from policy_operator.runtime.errors import NotReady, RequestError
from policy_operator.runtime.result import Result
from policy_operator.runtime.serving.metrics import ServerMetrics

log = logging.getLogger(__name__)

RECENT_REPORT_S = 0.1  # a batch window is milliseconds; a closed session stops counting within this


class MPClient:
    """The engine, behind the socket and ring to the model process."""

    def __init__(
        self,
        channel: ipc.Channel,
        ring: ipc.SlotRing,
        config: ipc.FrontendConfig,
        metrics: ServerMetrics,
        recent_sessions: Callable[[], int],
    ) -> None:
        self.channel = channel
        self.ring = ring
        self.config = config
        self.metrics = metrics
        self._recent_sessions = recent_sessions
        self._recent_reported = 0  # the count the model process has, from a request or a RecentSessions
        self.draining = False  # set by begin_drain, drain, or the model process's Drain only
        self.admission: AdmissionSpec | None = None  # from the model process's Attached
        self.snapshot: tuple[float, ipc.Snapshot] | None = None  # (monotonic time received, snapshot)
        # a snapshot comes every quarter heartbeat period at most: older than this, the model process is stuck
        self.stale_after = max(1.0, 2 * config.heartbeat_s)
        self._pending: dict[int, asyncio.Future[Result]] = {}
        self._free = deque(range(ring.slots))
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._waiting: set[asyncio.Task[None]] = set()
        self._ids = itertools.count()
        self.on_drain: Any = None  # set by the process: what a Drain message starts

    # --- what the front-end reads ---------------------------------------------------------------
    def _fresh(self) -> ipc.Snapshot | None:
        if self.snapshot is None or time.monotonic() - self.snapshot[0] > self.stale_after:
            return None
        return self.snapshot[1]

    @property
    def accepting(self) -> bool:
        snapshot = self._fresh()
        return self.admission is not None and not self.draining and snapshot is not None and snapshot.accepting

    def begin_drain(self) -> None:
        self.draining = True

    def readiness(self) -> Readiness:
        snapshot = self._fresh()
        if snapshot is None:
            layout = self.config.layout
            last = self.snapshot[1].readiness if self.snapshot is not None else None
            return Readiness(
                ready=False,
                layout=LayoutDoc(**layout.as_dict()),
                world_size=layout.world_size,
                ranks_ready=0,
                ranks=last.ranks if last is not None else [],
                in_flight=len(self._pending),
                draining=self.draining,
                error=(last.error if last is not None and last.error else None)
                or (f"the model process sent no readiness for {self.stale_after:g}s" if last is not None else None),
                max_batch=last.max_batch if last is not None else None,
                batch_buckets_ms=last.batch_buckets_ms if last is not None else None,
            )
        doc = snapshot.readiness
        return doc.model_copy(
            update={
                "ready": doc.ready and not self.draining,
                "draining": self.draining,
                # this process's requests sent and not answered (fresher than a snapshot), and the pod's others as
                # of the last snapshot (the LeRobot gRPC port's, the other front-ends')
                "in_flight": len(self._pending) + snapshot.elsewhere,
            }
        )

    # --- the request path ------------------------------------------------------------------------
    def submit(self, request: PreparedRequest) -> asyncio.Future[Result]:
        """Write ``request`` into a free slot and send it; the future of its Result.  With every slot held by
        the model process, it waits for one (bounded by the request timeout) first."""
        future: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        if not self.accepting:
            reason = "server is shutting down" if self.draining else "server is not ready yet"
            future.set_result(Result.failed(NotReady(reason)))
            return future
        request_id = next(self._ids)
        self._pending[request_id] = future
        future.add_done_callback(lambda _: self._pending.pop(request_id, None))
        if self._free:
            self._send(request_id, self._free.popleft(), request, future)
        else:
            task = asyncio.ensure_future(self._send_when_free(request_id, request, future))
            self._waiting.add(task)
            task.add_done_callback(self._waiting.discard)
        return future

    async def _send_when_free(self, request_id: int, request: PreparedRequest, future: asyncio.Future[Result]) -> None:
        deadline = time.monotonic() + self.config.request_timeout_s
        while not self._free:
            if future.done():
                return
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                if not future.done():
                    future.set_result(
                        Result.failed(NotReady("the model process takes no requests (shared memory full)"))
                    )
                return
        self._send(request_id, self._free.popleft(), request, future)

    def _send(self, request_id: int, slot: int, request: PreparedRequest, future: asyncio.Future[Result]) -> None:
        try:
            self._recent_reported = recent = self._recent_sessions()  # the count the model process will have
            message = self.ring.write_request(request_id, slot, request, recent)
        except Exception as exc:  # noqa: BLE001 - one request fails (a sample larger than a slot), the server carries on
            self._release([slot])
            if not future.done():
                future.set_result(Result.failed(exc))
            return
        try:
            self.channel.send(message)
        except ConnectionError as exc:
            if not future.done():
                future.set_result(Result.failed(NotReady(f"the model process is gone: {exc}")))

    def _release(self, slots: tuple[int, ...] | list[int]) -> None:
        self._free.extend(slots)
        while self._slot_waiters and self._free:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def report_recent_sessions(self) -> None:
        """Tell the model process when this process's recent sessions changed between requests.  Each request
        carries the count; but a session that closed, or went quiet, sends none, and with several front-ends
        the others' requests would have the batch window wait for it."""
        while True:
            await asyncio.sleep(RECENT_REPORT_S)
            recent = self._recent_sessions()
            if recent != self._recent_reported:
                self._recent_reported = recent
                try:
                    self.channel.send(ipc.RecentSessions(recent))
                except ConnectionError:
                    return  # the model process is gone: serve() ends

    async def drain(self, grace_s: float) -> bool:
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self._pending and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return not self._pending

    def give_up(self, error: RequestError) -> int:
        waiting = [f for f in self._pending.values() if not f.done()]
        for future in waiting:
            future.set_result(Result.failed(error))
        return len(waiting)

    # --- what the model process sends -------------------------------------------------------------
    def on_message(self, message: Any) -> None:
        if isinstance(message, ipc.Answer):
            future = self._pending.get(message.id)
            if future is not None and not future.done():  # else the request gave up (drain_timeout)
                future.set_result(message.result)
        elif isinstance(message, ipc.Freed):
            self._release(message.slots)
        elif isinstance(message, ipc.BatchRan):
            self.metrics.observe_batch(message.replica, message.size)
        elif isinstance(message, ipc.Snapshot):
            self.snapshot = (time.monotonic(), message)
        elif isinstance(message, ipc.Attached):
            self.admission = message.admission
        elif isinstance(message, ipc.Gauges):
            self._gauges(message)
        elif isinstance(message, ipc.Drain):
            self.draining = True
            if self.on_drain is not None:
                self.on_drain(message)
        else:
            log.warning("unexpected message from the model process: %s", type(message).__name__)

    def _gauges(self, gauges: ipc.Gauges) -> None:
        if gauges.load_s is not None:
            self.metrics.load_seconds.set(gauges.load_s)
        if gauges.warmup_s is not None:
            self.metrics.warmup_seconds.set(gauges.warmup_s)
        if gauges.buckets is not None:
            for k in range(self.config.layout.dp):
                self.metrics.observe_buckets(k, gauges.buckets)
        if gauges.download is not None:
            self.metrics.download_done.set(gauges.download[0])
            self.metrics.download_size.set(gauges.download[1])
