"""The front-end process of ``--frontend process``: WebSocket I/O, decoding and ``prepare`` beside the model's.

They run out of the interpreter that launches the model.  Rank 0 starts it (``serving/engine_link.py``) before
it loads the model -- or several, each with its own listening socket on the port (``--frontend-processes``;
``rank0_front.ProcessFront``) -- and it serves the port from then on: connections, sessions, auth, connection
bounds, ``/healthz`` ``/readyz`` ``/metrics`` and draining are the inline
server's own code (``server.py``); only its backend differs, and
``--max-connections`` counts the sessions of every front-end of the pod
(``ipc.SessionCounts``).  ``EngineProxy`` decodes each frame, checks its ``rtc`` entry against the connection's memory,
prepares it with the policy's ``Preprocessor`` when it has one (else the model
process prepares the raw frame), writes the bytes into the shared-memory ring
and sends the request's small description; the reply comes back over the same
socket.  The model process's event loop thus only routes, batches and answers,
and its model thread starts the next batch while this process is still
sending the last one's replies and decoding the next frames.

It answers to rank 0 only: SIGTERM and SIGINT are ignored (rank 0 gets them
and sends ``Drain``), and when rank 0 is gone -- its socket closed -- it exits
non-zero at once, so a pod never keeps a port open with no model behind it.
``/readyz`` is 503 whenever rank 0's last readiness snapshot is older than
``stale_after`` (a frozen model process).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import signal
import socket
import sys
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import torch

from policy_operator.constants import ENV_PROMETHEUS_MULTIPROC_DIR
from policy_operator.readyz import LayoutDoc, Readiness
from policy_operator.runtime.errors import NotReady, RequestError, RequestFailed
from policy_operator.runtime.parallel.dispatch import Reply
from policy_operator.runtime.policy.observation import parse_seed, parse_session
from policy_operator.runtime.serving import heap, ipc, wire
from policy_operator.runtime.serving.event_loop import event_loop_factory
from policy_operator.runtime.serving.ingress import INLINE_MAX_BYTES
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.rtc_session import RTC_KEY, RtcRequest, RtcSession, parse_rtc
from policy_operator.runtime.serving.server import PolicyWebSocketServer, Sessions, drain_sessions

log = logging.getLogger(__name__)

EXIT_ENGINE_GONE = 1  # the model process closed its socket without a drain
RECENT_REPORT_S = 0.1  # a batch window is milliseconds; a closed session stops counting within this


class EngineProxy:
    """The ``Backend`` of the front-end process: each request shipped to the model process, its reply awaited."""

    def __init__(
        self,
        channel: ipc.Channel,
        ring: ipc.SlotRing,
        config: ipc.FrontendConfig,
        metrics: ServerMetrics,
        recent_sessions: Any,
    ) -> None:
        self.channel = channel
        self.ring = ring
        self.config = config
        self.metrics = metrics
        self._recent_sessions = recent_sessions
        self._recent_reported = 0  # the count the model process has, from a request or a Recent
        self.draining = False
        self.attached: ipc.Attached | None = None
        self.snapshot: tuple[float, ipc.Snapshot] | None = None  # (monotonic time received, snapshot)
        # a snapshot comes every quarter heartbeat period at most: older than this, the model process is stuck
        self.stale_after = max(1.0, 2 * config.heartbeat_s)
        self._pending: dict[int, asyncio.Future[Reply]] = {}
        self._free = deque(range(ring.slots))
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        self._ids = itertools.count()
        # one intra-op thread there too (``main`` sets this thread's; the setting is per thread under OpenMP)
        self._prepare_pool = ThreadPoolExecutor(
            1, thread_name_prefix="prepare", initializer=torch.set_num_threads, initargs=(1,)
        )
        self.on_drain: Any = None  # set by the process: what a Drain message starts

    # --- what the server reads ---------------------------------------------------------------
    def _fresh(self) -> ipc.Snapshot | None:
        if self.snapshot is None or time.monotonic() - self.snapshot[0] > self.stale_after:
            return None
        return self.snapshot[1]

    @property
    def accepting(self) -> bool:
        snapshot = self._fresh()
        return self.attached is not None and not self.draining and snapshot is not None and snapshot.accepting

    def metadata(self) -> dict[str, Any]:
        assert self.attached is not None
        return self.attached.metadata

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
                # requests sent and not answered: fresher than the snapshot's, and the pod's when it is the only
                # front-end; with several, the model process's count (at most a snapshot period old) is the pod's
                "in_flight": len(self._pending) if self.config.processes == 1 else doc.in_flight,
            }
        )

    # --- the request path ------------------------------------------------------------------------
    def _decode_and_prepare(
        self, message: bytes | str, rtc_session: RtcSession | None
    ) -> tuple[Any, int | None, str | None, RtcRequest | None, float, float]:
        """(prepared sample, or None when the model process prepares), seed, session, checked rtc, ms, ms."""
        attached = self.attached
        assert attached is not None
        t0 = time.perf_counter()
        obs = wire.decode_observation(message)
        t1 = time.perf_counter()
        seed, session = parse_seed(obs), parse_session(obs)
        sample = attached.preprocessor.prepare(obs) if attached.preprocessor is not None else None
        rtc = None
        if RTC_KEY in obs:
            attached.rtc.check()
            rtc = parse_rtc(
                obs[RTC_KEY], rtc_session, action_shape=attached.action_shape, max_delay=attached.rtc.max_delay
            )
        return sample, seed, session, rtc, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3

    async def _slot(self) -> int:
        """A free slot of the ring, waiting (bounded by the request timeout) while the model process holds all."""
        deadline = time.monotonic() + self.config.request_timeout_s
        while not self._free:
            waiter = asyncio.get_running_loop().create_future()
            self._slot_waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                raise NotReady("the model process takes no requests (shared memory full)") from None
        return self._free.popleft()

    def _release(self, slots: tuple[int, ...] | list[int]) -> None:
        self._free.extend(slots)
        while self._slot_waiters and self._free:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    async def infer(self, message: bytes | str, rtc_session: RtcSession | None = None) -> Reply:
        if not self.accepting:
            raise NotReady("server is shutting down" if self.draining else "server is not ready yet")
        if len(message) <= INLINE_MAX_BYTES:
            sample, seed, session, rtc, decode_ms, prepare_ms = self._decode_and_prepare(message, rtc_session)
        else:
            sample, seed, session, rtc, decode_ms, prepare_ms = await asyncio.get_running_loop().run_in_executor(
                self._prepare_pool, self._decode_and_prepare, message, rtc_session
            )
        slot = await self._slot()
        try:
            if sample is not None:
                specs: tuple[ipc.TensorSpec, ...] | None = self.ring.write_sample(slot, sample)
                meta, raw = sample.meta, 0
            else:
                assert isinstance(message, bytes)  # decode refused text frames
                self.ring.write_raw(slot, message)
                specs, meta, raw = None, {}, len(message)
        except BaseException:
            self._release([slot])
            raise
        request_id = next(self._ids)
        future: asyncio.Future[Reply] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = future
        try:
            self.channel.send(
                ipc.Request(
                    request_id,
                    slot,
                    specs,
                    raw,
                    meta,
                    seed,
                    session,
                    (rtc.prev_actions, rtc.delay, rtc.horizon) if rtc is not None else None,
                    self._reported(self._recent_sessions()),
                )
            )
            reply = await future
        finally:
            self._pending.pop(request_id, None)
        actions = reply.unwrap()
        if rtc is not None:
            actions = rtc.frozen(actions)
        if rtc_session is not None:
            rtc_session.received(actions)
        return replace(reply, actions=actions, decode_ms=decode_ms, prepare_ms=prepare_ms + reply.prepare_ms)

    def _reported(self, recent: int) -> int:
        self._recent_reported = recent
        return recent

    async def report_recent(self) -> None:
        """Tell the model process when this process's recent sessions changed between requests.  Each request
        carries the count; but a session that closed, or went quiet, sends none, and with several front-ends
        the others' requests would have the batch window wait for it."""
        while True:
            await asyncio.sleep(RECENT_REPORT_S)
            recent = self._recent_sessions()
            if recent != self._recent_reported:
                try:
                    self.channel.send(ipc.Recent(self._reported(recent)))
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
            future.set_exception(error)
        return len(waiting)

    # --- what the model process sends -------------------------------------------------------------
    def on_message(self, message: Any) -> None:
        if isinstance(message, ipc.Answer):
            future = self._pending.get(message.id)
            if future is not None and not future.done():  # else the request gave up (drain_timeout)
                future.set_result(message.reply)
        elif isinstance(message, ipc.Failure):
            future = self._pending.get(message.id)
            if future is not None and not future.done():
                future.set_exception(
                    NotReady(message.message) if message.not_ready else RequestFailed(message.message, message.kind)
                )
        elif isinstance(message, ipc.Freed):
            self._release(message.slots)
        elif isinstance(message, ipc.BatchRan):
            self.metrics.observe_batch(message.replica, message.size)
        elif isinstance(message, ipc.Snapshot):
            self.snapshot = (time.monotonic(), message)
        elif isinstance(message, ipc.Attached):
            self.attached = message
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


async def serve(config: ipc.FrontendConfig, channel: ipc.Channel, ring: ipc.SlotRing, counts: ipc.SessionCounts) -> int:
    """Serve the port until rank 0 says drain (exit 0) or goes away (``EXIT_ENGINE_GONE``); ``counts``: the open
    sessions of every front-end of the pod, which ``--max-connections`` bounds."""
    loop = asyncio.get_running_loop()
    metrics = ServerMetrics(
        config.layout, config.server.max_connections, multiprocess_dir=os.environ.get(ENV_PROMETHEUS_MULTIPROC_DIR)
    )
    sessions = Sessions(counts)
    proxy = EngineProxy(channel, ring, config, metrics, sessions.recent)
    server = PolicyWebSocketServer(proxy, config.server, metrics, sessions)
    done: asyncio.Future[int] = loop.create_future()

    async def drain(command: ipc.Drain) -> None:
        drained = await drain_sessions(server, proxy, grace_s=command.grace_s, heartbeat_s=command.heartbeat_s)
        channel.send(ipc.Drained(drained))
        if not done.done():
            done.set_result(0)

    def engine_gone() -> None:
        if done.done():
            return
        if proxy.draining:  # rank 0 stopped mid-drain (its own deadline): nothing left to serve
            done.set_result(0)
            return
        log.error("the model process is gone; the front-end exits %d", EXIT_ENGINE_GONE)
        done.set_result(EXIT_ENGINE_GONE)

    drains: set[asyncio.Task[None]] = set()

    def start_drain(command: ipc.Drain) -> None:
        task = asyncio.ensure_future(drain(command))
        drains.add(task)

    proxy.on_drain = start_drain
    await server.start()
    reporter = asyncio.ensure_future(proxy.report_recent())
    channel.listen(loop, proxy.on_message, engine_gone)
    channel.send(ipc.Listening(server.port))
    code = await done
    reporter.cancel()
    channel.finish()
    return code


def main(argv: list[str]) -> int:
    """``python -m policy_operator.runtime.serving.frontend SOCKET_FD RING_FD``, started by rank 0 only."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when this process drains
        signal.signal(sig, signal.SIG_IGN)
    sock_fd, ring_fd = int(argv[0]), int(argv[1])
    channel = ipc.Channel(socket.socket(fileno=sock_fd))
    config: ipc.FrontendConfig = channel.recv()
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s frontend {config.index} %(levelname)s %(name)s: %(message)s",
    )
    sys.setswitchinterval(config.gil_switch_ms / 1e3)
    heap.keep_freed_blocks()  # every frame and prepared image is a block of the same few sizes
    # Nothing here is worth parallelizing, and an intra-op parallel op (a ``Preprocessor``'s resize or copy) would
    # wake a team of as many threads as the host has cores that spin on after it, against the model process.
    torch.set_num_threads(1)
    ring = ipc.SlotRing(ring_fd, config.slots, config.slot_bytes)
    os.close(ring_fd)  # mapped: the descriptor is no longer needed
    counts_fd = channel.recv_fd()  # rank 0 sends it after the configuration (``rank0_front.spawn_link``)
    counts = ipc.SessionCounts(counts_fd, config.processes, config.index)
    os.close(counts_fd)
    with asyncio.Runner(loop_factory=event_loop_factory(config.event_loop)) as runner:
        code = runner.run(serve(config, channel, ring, counts))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
