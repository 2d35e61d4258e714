"""What rank 0 serves its port through: the in-process server (``--frontend inline``) or the front-end process.

Rank 0's life is the same in both modes (``worker.Rank0``: listen, load,
attach, serve, drain); only where its readiness and engine metrics go and
who drains the sessions differ.  A ``Front`` is that difference, one class per
mode, handed to the driver when it is made.  Inline, the server's front-end
(``serving.admission.FrontEnd``) submits to the ``Engine`` on this event loop,
reads it on every ``/readyz`` and owns the ``ServerMetrics``; with a front-end
process, rank 0 pushes readiness and sends metrics as messages
(``engine/link.py``), and the front-end's exit ends rank 0
(``ServeExit.FRONTEND``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, NoReturn, Protocol

from policy_operator.exit_codes import ServeExit
from policy_operator.fetch_progress import FetchProgress
from policy_operator.readyz import RankState
from policy_operator.runtime import ipc
from policy_operator.runtime.engine.link import FrontendLink
from policy_operator.runtime.lifecycle import Lifecycle, exit_now
from policy_operator.runtime.parallel.heartbeat import Heartbeat
from policy_operator.runtime.policy.interface import Policy
from policy_operator.runtime.serving.admission import FrontEnd
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.server import PolicyWebSocketServer, ServerConfig, Sessions, drain_sessions

if TYPE_CHECKING:
    from policy_operator.runtime.engine.core import Engine

log = logging.getLogger(__name__)


class Front(Protocol):
    """Rank 0's side of whoever serves the port."""

    label: str  # after the layout in the "listening on" line

    # Bound to whoever counts or records them, so the request path calls the counter itself (no forwarding hop).
    @property
    def recent_sessions(self) -> Callable[[], int]:
        """Sessions that may send soon (the batch window waits for them)."""

    @property
    def observe_batch(self) -> Callable[[int, int], None]:
        """(replica, size) of a batch as its lane starts it."""

    async def open(self, engine: Engine) -> None:
        """Start serving the port for ``engine`` (before the model loads: /healthz and /readyz answer at once)."""

    async def listening(self) -> int:
        """The port, once it is served; a front that cannot serve it ends rank 0."""

    def push_readiness(self) -> None:
        """The engine's readiness changed (a failed replica, a load error)."""

    def observe_download(self, progress: FetchProgress) -> None:
        """The checkpoint's download progress, from the fetch's thread."""

    def observe_buckets(self, seconds: dict[int, float]) -> None:
        """Warm-up's time per batch bucket (--latency-budget-ms), for every replica."""

    def attached(self, policy: Policy, load_s: float, warmup_s: float) -> None:
        """The model is loaded and the engine attached: sessions may come."""

    async def drain(self, grace_s: float) -> bool:
        """Drain the sessions (``server.drain_sessions``) and stop serving; True when every request was answered."""

    async def close(self) -> None:
        """Stop serving without a drain (nothing was served: the model did not load)."""


class InlineFront:
    """``--frontend inline``: the WebSocket server runs on rank 0's own event loop."""

    label = ""

    def __init__(self, config: ServerConfig, metrics: ServerMetrics, dp: int, heartbeat_s: float) -> None:
        self.config = config
        self.metrics = metrics
        self.dp = dp
        self.heartbeat_s = heartbeat_s
        self.sessions = Sessions()
        self.server: PolicyWebSocketServer | None = None  # made by open(), with the engine
        self.recent_sessions: Callable[[], int] = self.sessions.recent
        self.observe_batch: Callable[[int, int], None] = metrics.observe_batch

    async def open(self, engine: Engine) -> None:
        self.server = PolicyWebSocketServer(FrontEnd(engine), self.config, self.metrics, self.sessions)
        await self.server.start()

    async def listening(self) -> int:
        assert self.server is not None
        return self.server.port

    def push_readiness(self) -> None:
        """Nothing to push: the server asks the engine on every request."""

    def observe_download(self, progress: FetchProgress) -> None:
        self.metrics.observe_download(progress)

    def observe_buckets(self, seconds: dict[int, float]) -> None:
        for k in range(self.dp):
            self.metrics.observe_buckets(k, seconds)

    def attached(self, policy: Policy, load_s: float, warmup_s: float) -> None:
        self.metrics.load_seconds.set(load_s)
        self.metrics.warmup_seconds.set(warmup_s)

    async def drain(self, grace_s: float) -> bool:
        assert self.server is not None
        return await drain_sessions(self.server, self.server.ingress, grace_s=grace_s, heartbeat_s=self.heartbeat_s)

    async def close(self) -> None:
        assert self.server is not None
        await self.server.stop()


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` in ``parts`` shares that differ by at most one and add up to it (a bound per front-end)."""
    return [total // parts + (1 if i < total % parts else 0) for i in range(parts)]


def frontend_configs(config: ipc.FrontendConfig, processes: int) -> list[ipc.FrontendConfig]:
    """One configuration per front-end process: its index, its share of ``--max-buffered-bytes`` (its ring from
    that share), and SO_REUSEPORT when there are several.  ``--max-connections`` is not split: every front-end
    bounds the pod's sessions, counted in ``ipc.SessionCounts``."""
    server = config.server
    return [
        replace(
            config,
            server=replace(server, max_buffered_bytes=buffered, reuse_port=processes > 1),
            index=index,
            processes=processes,
        )
        for index, buffered in enumerate(split_evenly(server.max_buffered_bytes, processes))
    ]


def spawn_link(config: ipc.FrontendConfig, metrics_dir: str, counts_fd: int) -> FrontendLink:
    """Start one front-end process (``FrontendLink.spawn``) and hand it the pod's session counts."""
    link = FrontendLink.spawn(config, metrics_dir)
    link.channel.send_fd(counts_fd)
    return link


class ProcessFront:
    """``--frontend process``: front-end children serve the port; rank 0 talks to each over its ``FrontendLink``.

    With ``--frontend-processes N`` there are N of them, each with its own listening socket on the port
    (SO_REUSEPORT: the kernel spreads connections over them), its own ring and its share of the buffer bound;
    ``--max-connections`` bounds the sessions of all of them together (``ipc.SessionCounts``, one memfd that
    every front-end maps, made here).  Each request is answered through the link it came on; the batch window
    counts the recent sessions of all of them; engine metrics (batch sizes, load, warm-up, buckets, download) go to the first
    only, since every process answers ``/metrics`` for all (``ServerMetrics``' multiprocess files in
    ``metrics_dir``); a drain drains them all, and any one's exit ends rank 0.
    """

    label = ", front-end process"

    def __init__(
        self,
        links: list[FrontendLink],
        later: list[ipc.FrontendConfig],
        metrics_dir: str,
        counts_fd: int | None,
        heartbeat: Heartbeat,
        lifecycle: Lifecycle,
    ) -> None:
        """``later``: configurations of front-ends to start once the first one bound the port (``--port 0``);
        ``counts_fd``: the pod's session counts (``ipc.create_counts_fd``) for them, closed once they started;
        None when none is left to start."""
        self.links = links
        self.later = later
        self.metrics_dir = metrics_dir
        self.counts_fd = counts_fd
        self.heartbeat = heartbeat
        self.lifecycle = lifecycle
        self.engine: Engine | None = None  # set by open()
        self.observe_batch: Callable[[int, int], None] = links[
            0
        ].observe_batch  # the first front-end process's metrics count the batches
        if len(links) + len(later) > 1:
            self.label = f", {len(links) + len(later)} front-end processes"

    @classmethod
    def spawn(
        cls, config: ipc.FrontendConfig, processes: int, heartbeat: Heartbeat, lifecycle: Lifecycle
    ) -> ProcessFront:
        """Start the front-end processes now; they bind the port while rank 0 loads.  On ``--port 0`` the first
        one picks the port and the others start when it did."""
        shm = "/dev/shm"
        metrics_dir = tempfile.mkdtemp(prefix="policy-frontend-metrics-", dir=shm if os.access(shm, os.W_OK) else None)
        configs = frontend_configs(config, processes)
        now, later = (configs, []) if config.server.port else (configs[:1], configs[1:])
        counts_fd = ipc.create_counts_fd(processes)
        try:
            links = [spawn_link(c, metrics_dir, counts_fd) for c in now]
        finally:
            if not later:  # every front-end has its copy
                os.close(counts_fd)
        return cls(links, later, metrics_dir, counts_fd if later else None, heartbeat, lifecycle)

    def recent_sessions(self) -> int:  # every front-end process's latest count
        return sum(link.recent_sessions for link in self.links)

    async def open(self, engine: Engine) -> None:
        self.engine = engine
        for link in self.links:
            link.start(engine, self._gone)

    def _gone(self) -> None:
        if self.lifecycle.stopping.is_set():
            return  # it drained and left, or the shutdown took it
        codes = ", ".join(str(link.proc.poll()) for link in self.links if link.gone)
        log.error("the front-end process exited (%s); rank 0 exits %d", codes, ServeExit.FRONTEND)
        self.heartbeat.set_state(RankState.FAILED, "the front-end process exited")
        self._exit(ServeExit.FRONTEND)

    def _exit(self, code: int) -> NoReturn:
        """Leave at once (``exit_now``), the metrics files first: they live in memory, in the pod's /dev/shm."""
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
        exit_now(code)

    async def listening(self) -> int:
        try:
            port = await self.links[0].listening()
            self._start_later(port)
            for link in self.links[1:]:
                await link.listening()
        except (TimeoutError, ConnectionError) as exc:
            log.error("the front-end process did not start: %s", exc or "no answer")
            self._exit(ServeExit.FRONTEND)
        return port

    def _start_later(self, port: int) -> None:
        """``--port 0``: the first front-end picked the port; the others join it."""
        if not self.later:
            return
        assert self.engine is not None and self.counts_fd is not None
        for config in self.later:
            joined = replace(config, server=replace(config.server, port=port))
            link = spawn_link(joined, self.metrics_dir, self.counts_fd)
            link.start(self.engine, self._gone)
            self.links.append(link)
        self.later = []
        os.close(self.counts_fd)  # every front-end has its copy
        self.counts_fd = None

    def push_readiness(self) -> None:
        for link in self.links:
            link.push()

    def observe_download(self, progress: FetchProgress) -> None:
        self.links[0].observe_download(progress)

    def observe_buckets(self, seconds: dict[int, float]) -> None:
        self.links[0].send(ipc.Gauges(buckets=seconds))

    def attached(self, policy: Policy, load_s: float, warmup_s: float) -> None:
        self.links[0].send(ipc.Gauges(load_s=load_s, warmup_s=warmup_s))
        for link in self.links:
            link.attach()

    async def drain(self, grace_s: float) -> bool:
        assert self.engine is not None
        self.lifecycle.stopping.set()  # the front-ends' exits after their drains are expected
        self.engine.begin_drain()
        self.push_readiness()
        drained = await asyncio.gather(*(link.drain(grace_s) for link in self.links))
        self._close()
        return all(drained)

    async def close(self) -> None:
        self.lifecycle.stopping.set()  # the front-ends' exits that follow are expected
        self._close()

    def _close(self) -> None:
        for link in self.links:
            link.close()
        shutil.rmtree(self.metrics_dir, ignore_errors=True)
