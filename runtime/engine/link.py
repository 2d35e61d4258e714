"""Rank 0's end of ``--frontend process``: it starts the front-end process and serves its requests.

Rank 0 stays the model process, as it must (it is a member of the cfg group
and of every dispatch group).  Its event loop no longer touches a socket of a
robot: it reads requests from the front-end's socket, copies them
out of the shared-memory ring at once (and hands the slots back), and submits
each to the ``Engine`` -- exactly what inline mode's front-end submits: the
same ``PreparedRequest`` -- then sends its ``Result`` back, as it is.  The
front-end process's end of the link is ``serving.mp_client.MPClient``.

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
from collections.abc import Callable
from typing import Any

from policy_operator.constants import ENV_PROMETHEUS_MULTIPROC_DIR
from policy_operator.fetch_progress import FetchProgress
from policy_operator.runtime import ipc
from policy_operator.runtime.engine.core import Engine
from policy_operator.runtime.result import Result

log = logging.getLogger(__name__)

SNAPSHOT_S = 0.25  # readiness pushed at least this often (and at most a quarter heartbeat period apart)
LISTEN_TIMEOUT_S = 120.0  # the front-end imports torch and binds the port: seconds on a busy machine
# the torchrun rank variables: the front-end is no rank (tests and tools find ranks by them)
RANK_ENV = ("RANK", "LOCAL_RANK", "GROUP_RANK", "ROLE_RANK")


class FrontendLink:
    """The model process's end of one front-end process: its socket, its ring, the process itself."""

    def __init__(self, channel: ipc.Channel, ring: ipc.SlotRing, proc: subprocess.Popen[bytes], heartbeat_s: float):
        self.channel = channel
        self.ring = ring
        self.proc = proc
        self.heartbeat_s = heartbeat_s
        self.engine: Engine | None = None
        self.recent_sessions = 0  # the front-end's recent sessions, as of its latest request or report
        self.outstanding = 0  # requests submitted from this link and not answered yet
        self._loop: asyncio.AbstractEventLoop | None = None
        self._listening: asyncio.Future[int] | None = None
        self._drained: asyncio.Future[bool] | None = None
        self._freed: list[int] = []
        self._snapshots: asyncio.Task[None] | None = None
        self._on_gone: Callable[[], None] = lambda: None
        self.gone = False

    @classmethod
    def spawn(cls, config: ipc.FrontendConfig, metrics_dir: str) -> FrontendLink:
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

    def start(self, engine: Engine, on_gone: Callable[[], None]) -> None:
        """On rank 0's event loop: take messages, push readiness."""
        self._loop = loop = asyncio.get_running_loop()
        self.engine = engine
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
        assert self.engine is not None
        readiness = self.engine.readiness()
        self.send(ipc.Snapshot(readiness, self.engine.accepting, max(0, readiness.in_flight - self.outstanding)))

    async def _push_snapshots(self) -> None:
        period = min(SNAPSHOT_S, self.heartbeat_s / 4)
        while not self.gone:
            self.push()
            await asyncio.sleep(period)

    def attach(self) -> None:
        """The model is loaded (the engine attached): sessions may come."""
        assert self.engine is not None and self.engine.admission is not None
        self.send(ipc.Attached(self.engine.admission))
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
        """A request is copied out of its slot at once, the slot handed back, and the request submitted; its
        Result is sent from its future's callback: no task per request."""
        if isinstance(message, ipc.Request):
            assert self.engine is not None
            self.recent_sessions = message.recent_sessions
            try:
                prepared = self.ring.read_request(message)
            except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
                log.error("request %d could not be read from its slot", message.id, exc_info=exc)
                self.send(ipc.Answer(message.id, Result.failed(exc)))
                return
            finally:
                if not self._freed:
                    assert self._loop is not None
                    self._loop.call_soon(self._flush_freed)  # after every request this read pass took
                self._freed.append(message.slot)
            answer = self.engine.submit(prepared)
            self.outstanding += 1
            answer.add_done_callback(functools.partial(self._answered, message.id))
        elif isinstance(message, ipc.RecentSessions):
            self.recent_sessions = message.sessions
        elif isinstance(message, ipc.Listening):
            if self._listening is not None and not self._listening.done():
                self._listening.set_result(message.port)
        elif isinstance(message, ipc.Drained):
            if self._drained is not None and not self._drained.done():
                self._drained.set_result(message.drained)
        else:
            log.warning("unexpected message from the front-end: %s", type(message).__name__)

    def _flush_freed(self) -> None:
        freed, self._freed = tuple(self._freed), []
        self.send(ipc.Freed(freed))

    def _answered(self, request_id: int, answer: asyncio.Future[Result]) -> None:
        self.outstanding -= 1
        if answer.cancelled():  # nothing here cancels one; were it to, the front-end still gets its answer
            result = Result.failed(RuntimeError("the request was cancelled in the model process"))
        else:
            result = answer.result()
        self.send(ipc.Answer(request_id, result))
