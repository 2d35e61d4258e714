"""Rank 0's end of ``--frontend process``: it starts the front-end process and serves its requests.

Rank 0 stays the model process, as it must (it is a member of the cfg group
and of every dispatch group).  Its event loop no longer touches a socket of a
robot: it reads requests from the front-end's socket, copies their tensors
out of the shared-memory ring at once (and hands the slots back), and gives
them to the ``Ingress`` -- routing, session stickiness, history, the lanes'
batching and the replica bounds, exactly as inline -- then sends each reply
back.  A policy without a ``Preprocessor`` gets the raw frame and prepares it
here, on the ingress's prepare thread for large frames.

Readiness is computed here (the heartbeat board, failures, load errors) and
pushed to the front-end every ``SNAPSHOT_S`` and on every change it causes,
so the front-end's ``/readyz`` is never older than that.  Engine-side metrics
(batch sizes, load and warm-up times, bucket times, download progress) travel
as messages.  The front-end's exit ends rank 0 (``ServeExit.FRONTEND``), and
rank 0's ends the front-end (its socket closes): the pod never serves half.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from policy_operator.constants import ENV_PROMETHEUS_MULTIPROC_DIR
from policy_operator.fetch_progress import FetchProgress
from policy_operator.runtime.errors import ErrorKind, NotReady, RequestError
from policy_operator.runtime.parallel.dispatch import Reply
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.rtc import RtcConstraint
from policy_operator.runtime.serving import ipc, wire
from policy_operator.runtime.serving.ingress import INLINE_MAX_BYTES, Ingress
from policy_operator.runtime.serving.rtc_session import RtcSupport

log = logging.getLogger(__name__)

SNAPSHOT_S = 0.25  # readiness pushed at least this often (and at most a quarter heartbeat period apart)
LISTEN_TIMEOUT_S = 120.0  # the front-end imports torch and binds the port: seconds on a busy machine
# the torchrun rank variables: the front-end is no rank (tests and tools find ranks by them)
RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")


class EngineLink:
    def __init__(self, channel: ipc.Channel, ring: ipc.SlotRing, proc: subprocess.Popen[bytes], heartbeat_s: float):
        self.channel = channel
        self.ring = ring
        self.proc = proc
        self.heartbeat_s = heartbeat_s
        self.ingress: Ingress | None = None
        self.recent = 0  # the front-end's recently active sessions, as of its latest request
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening: asyncio.Future[int] | None = None
        self._drained: asyncio.Future[bool] | None = None
        self._freed: list[int] = []
        self._tasks: set[asyncio.Task[None]] = set()
        self._snapshots: asyncio.Task[None] | None = None
        self._on_gone: Callable[[], None] = lambda: None
        self.gone = False

    @classmethod
    def spawn(cls, config: ipc.FrontendConfig, metrics_dir: str) -> EngineLink:
        """Start a front-end process with its socket and its ring, and send it its configuration; it keeps its
        metrics in ``metrics_dir``, beside those of the other front-end processes."""
        ring_fd = ipc.create_ring_fd(config.slots, config.slot_bytes)
        ours, theirs = socket.socketpair()
        env = {k: v for k, v in os.environ.items() if k not in RANK_ENV}
        env[ENV_PROMETHEUS_MULTIPROC_DIR] = metrics_dir
        try:
            ring = ipc.SlotRing(ring_fd, config.slots, config.slot_bytes)
            proc = subprocess.Popen(
                # -P: the working directory is not put on sys.path, so a struct.py there cannot shadow the stdlib
                [
                    sys.executable,
                    "-P",
                    "-m",
                    "policy_operator.runtime.serving.frontend",
                    str(theirs.fileno()),
                    str(ring_fd),
                ],
                pass_fds=(theirs.fileno(), ring_fd),
                env=env,
            )
        finally:
            theirs.close()
            os.close(ring_fd)
        channel = ipc.Channel(ours)
        channel.send(config)
        return cls(channel, ring, proc, config.heartbeat_s)

    def start(self, ingress: Ingress, on_gone: Callable[[], None]) -> None:
        """On rank 0's event loop: take messages, push readiness."""
        self._loop = loop = asyncio.get_running_loop()
        self.ingress = ingress
        self._on_gone = on_gone
        self._listening = loop.create_future()
        self._drained = loop.create_future()
        self.channel.listen(loop, self._on_message, self._closed)
        self._snapshots = asyncio.ensure_future(self._push_snapshots())

    async def listening(self) -> int:
        """The port the front-end serves; raises when it did not come up."""
        assert self._listening is not None
        return await asyncio.wait_for(self._listening, LISTEN_TIMEOUT_S)

    def _closed(self) -> None:
        self.gone = True
        for future in (self._listening, self._drained):
            if future is not None and not future.done():
                future.set_exception(ConnectionError("the front-end process exited"))
        self._on_gone()

    # --- pushes ---------------------------------------------------------------------------------------
    def send(self, message: object) -> None:
        if self.gone:
            return
        try:
            self.channel.send(message)
        except OSError as exc:  # it is gone: _closed follows from the reader
            log.warning("front-end unreachable: %s", exc)

    def push(self) -> None:
        """The readiness as of now."""
        assert self.ingress is not None
        self.send(ipc.Snapshot(self.ingress.readiness(), self.ingress.accepting))

    async def _push_snapshots(self) -> None:
        period = min(SNAPSHOT_S, self.heartbeat_s / 4)
        while not self.gone:
            self.push()
            await asyncio.sleep(period)

    def attach(self, policy: Policy, rtc: RtcSupport) -> None:
        """The model is loaded (the ingress attached): sessions may come."""
        assert self.ingress is not None
        self.send(ipc.Attached(self.ingress.metadata(), policy.preprocessor(), rtc, policy.action_shape))
        self.push()

    def observe_batch(self, replica: int, size: int) -> None:
        self.send(ipc.BatchRan(replica, size))

    def gauges(self, gauges: ipc.Gauges) -> None:
        """From any thread (the fetch reports progress from its own)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self.send, gauges)

    def observe_download(self, progress: FetchProgress) -> None:
        self.gauges(ipc.Gauges(download=(progress.done, progress.total or 0)))

    async def drain(self, grace_s: float) -> bool:
        """The front-end drains its sessions (``server.drain_sessions``); True when all were answered."""
        assert self._drained is not None
        self.send(ipc.Drain(grace_s, self.heartbeat_s))
        # its drain ends by grace + heartbeat + the error's send time; a front-end that never says is done too
        try:
            return await asyncio.wait_for(asyncio.shield(self._drained), grace_s + self.heartbeat_s + 5.0)
        except (TimeoutError, ConnectionError):
            return False

    def close(self) -> None:
        if self._snapshots is not None:
            self._snapshots.cancel()

    # --- requests -------------------------------------------------------------------------------------
    def _on_message(self, message: Any) -> None:
        if isinstance(message, ipc.Request):
            self._request(message)
        elif isinstance(message, ipc.Recent):
            self.recent = message.sessions
        elif isinstance(message, ipc.Listening):
            if self._listening is not None and not self._listening.done():
                self._listening.set_result(message.port)
        elif isinstance(message, ipc.Drained):
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(message.drained)
        else:
            log.warning("unexpected message from the front-end: %s", type(message).__name__)

    def _request(self, request: ipc.Request) -> None:
        """Copy the request out of its slot now, hand the slot back, and serve it."""
        self.recent = request.recent
        try:
            if request.tensors is not None:
                payload: Sample | bytes = Sample(self.ring.read_tensors(request.slot, request.tensors), request.meta)
            else:
                payload = self.ring.read_raw(request.slot, request.raw_bytes)
        finally:
            if not self._freed:
                assert self._loop is not None
                self._loop.call_soon(self._flush_freed)  # after every request this read pass took
            self._freed.append(request.slot)
        if isinstance(payload, Sample):
            self._dispatch(request, payload, 0.0)
            return
        task = asyncio.ensure_future(self._prepare_and_dispatch(request, payload))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _flush_freed(self) -> None:
        freed, self._freed = tuple(self._freed), []
        self.send(ipc.Freed(freed))

    async def _prepare_and_dispatch(self, request: ipc.Request, frame: bytes) -> None:
        """A policy without a ``Preprocessor``: its raw frame prepared here first."""
        assert self.ingress is not None
        started = time.perf_counter()
        try:
            sample = await self._prepare(self.ingress, frame)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
            self._failed(request.id, exc)
            return
        self._dispatch(request, sample, (time.perf_counter() - started) * 1e3)

    def _dispatch(self, request: ipc.Request, sample: Sample, prepare_ms: float) -> None:
        """Route the request; its answer (or failure) is sent from its future's callback: no task per request."""
        ingress = self.ingress
        assert ingress is not None and ingress.policy is not None
        try:
            rtc = None
            if request.rtc is not None:
                prev, delay, horizon = request.rtc
                rtc = RtcConstraint(ingress.policy.actions_to_model(prev).float(), delay, horizon)
            answer = ingress.dispatch(sample, request.seed, request.session, rtc)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
            self._failed(request.id, exc)
            return
        answer.add_done_callback(functools.partial(self._answered, request.id, prepare_ms))

    def _answered(self, request_id: int, prepare_ms: float, answer: asyncio.Future[Reply]) -> None:
        if answer.cancelled():  # nothing here cancels one; were it to, the front-end still gets its answer
            self._failed(request_id, RuntimeError("the request was cancelled in the model process"))
            return
        if (exc := answer.exception()) is not None:
            self._failed(request_id, exc)
            return
        reply = answer.result()
        self.send(ipc.Answer(request_id, replace(reply, prepare_ms=prepare_ms) if prepare_ms else reply))

    def _failed(self, request_id: int, exc: BaseException) -> None:
        if isinstance(exc, NotReady):
            self.send(ipc.Failure(request_id, exc.kind, str(exc), True))
        elif isinstance(exc, RequestError):
            self.send(ipc.Failure(request_id, exc.kind, str(exc), False))
        else:
            log.error("request failed", exc_info=exc)
            self.send(ipc.Failure(request_id, ErrorKind.INTERNAL, f"{type(exc).__name__}: {exc}", False))

    async def _prepare(self, ingress: Ingress, frame: bytes) -> Sample:
        """A policy without a ``Preprocessor``: its ``prepare`` here, off the loop for large frames."""
        policy = ingress.policy
        assert policy is not None

        def prepare() -> Sample:
            return policy.prepare(wire.decode_observation(frame))

        ingress.preparing += 1
        try:
            if len(frame) <= INLINE_MAX_BYTES:
                return prepare()
            return await ingress.off_loop(prepare)
        finally:
            ingress.preparing -= 1
