"""What rank 0 serves its port through: the in-process server (``--frontend inline``) or the front-end process.

Rank 0's life is the same in both modes (``worker.Rank0``: listen, load,
attach, serve, drain); only where its readiness and engine metrics go and
who drains the sessions differ.  A ``Front`` is that difference, one class per
mode, handed to the driver when it is made.  Inline, the server reads the
ingress on every ``/readyz`` and owns the ``ServerMetrics``; with a front-end
process, rank 0 pushes readiness and sends metrics as messages
(``serving/engine_link.py``), and the front-end's exit ends rank 0
(``ServeExit.FRONTEND``).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from policy_operator.exit_codes import ServeExit
from policy_operator.fetch_progress import FetchProgress
from policy_operator.readyz import RankState
from policy_operator.runtime.lifecycle import Lifecycle, exit_now
from policy_operator.runtime.parallel.heartbeat import Heartbeat
from policy_operator.runtime.policy.interface import Policy
from policy_operator.runtime.serving import ipc
from policy_operator.runtime.serving.engine_link import EngineLink
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.server import PolicyWebSocketServer, ServerConfig, Sessions, drain_sessions

if TYPE_CHECKING:
    from policy_operator.runtime.serving.ingress import Ingress

log = logging.getLogger(__name__)


class Front(Protocol):
    """Rank 0's side of whoever serves the port."""

    label: str  # after the layout in the "listening on" line

    def recent_sessions(self) -> int:
        """Sessions that may send soon (the batch window waits for them)."""

    async def open(self, ingress: Ingress) -> None:
        """Start serving the port for ``ingress`` (before the model loads: /healthz and /readyz answer at once)."""

    async def listening(self) -> int:
        """The port, once it is served; a front that cannot serve it ends rank 0."""

    def push_readiness(self) -> None:
        """The ingress's readiness changed (a failed replica, a load error)."""

    def observe_download(self, progress: FetchProgress) -> None:
        """The checkpoint's download progress, from the fetch's thread."""

    def observe_batch(self, replica: int, size: int) -> None: ...

    def observe_buckets(self, seconds: dict[int, float]) -> None:
        """Warm-up's time per batch bucket (--latency-budget-ms), for every replica."""

    def attached(self, policy: Policy, load_s: float, warmup_s: float) -> None:
        """The model is loaded and the ingress attached: sessions may come."""

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
        self.server: PolicyWebSocketServer | None = None  # made by open(), with the ingress

    def recent_sessions(self) -> int:
        return self.sessions.recent()

    async def open(self, ingress: Ingress) -> None:
        self.server = PolicyWebSocketServer(ingress, self.config, self.metrics, self.sessions)
        await self.server.start()

    async def listening(self) -> int:
        assert self.server is not None
        return self.server.port

    def push_readiness(self) -> None:
        """Nothing to push: the server asks the ingress on every request."""

    def observe_download(self, progress: FetchProgress) -> None:
        self.metrics.observe_download(progress)

    def observe_batch(self, replica: int, size: int) -> None:
        self.metrics.observe_batch(replica, size)

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


class ProcessFront:
    """``--frontend process``: the front-end child serves the port; rank 0 talks to it over its ``EngineLink``."""

    label = ", front-end process"

    def __init__(self, link: EngineLink, heartbeat: Heartbeat, lifecycle: Lifecycle) -> None:
        self.link = link
        self.heartbeat = heartbeat
        self.lifecycle = lifecycle
        self.ingress: Ingress | None = None  # set by open()

    @classmethod
    def spawn(cls, config: ipc.FrontendConfig, heartbeat: Heartbeat, lifecycle: Lifecycle) -> ProcessFront:
        """Start the front-end process now; it binds the port while rank 0 loads."""
        return cls(EngineLink.spawn(config), heartbeat, lifecycle)

    def recent_sessions(self) -> int:
        return self.link.recent

    async def open(self, ingress: Ingress) -> None:
        self.ingress = ingress
        self.link.start(ingress, self._gone)

    def _gone(self) -> None:
        if self.lifecycle.stopping.is_set():
            return  # it drained and left, or the shutdown took it
        log.error("the front-end process exited (%s); rank 0 exits %d", self.link.proc.poll(), ServeExit.FRONTEND)
        self.heartbeat.set_state(RankState.FAILED, "the front-end process exited")
        exit_now(ServeExit.FRONTEND)

    async def listening(self) -> int:
        try:
            return await self.link.listening()
        except (TimeoutError, ConnectionError) as exc:
            log.error("the front-end process did not start: %s", exc or "no answer")
            exit_now(ServeExit.FRONTEND)

    def push_readiness(self) -> None:
        self.link.push()

    def observe_download(self, progress: FetchProgress) -> None:
        self.link.observe_download(progress)

    def observe_batch(self, replica: int, size: int) -> None:
        self.link.observe_batch(replica, size)

    def observe_buckets(self, seconds: dict[int, float]) -> None:
        self.link.send(ipc.Gauges(buckets=seconds))

    def attached(self, policy: Policy, load_s: float, warmup_s: float) -> None:
        assert self.ingress is not None
        self.link.send(ipc.Gauges(load_s=load_s, warmup_s=warmup_s))
        self.link.attach(policy, self.ingress.rtc.support)

    async def drain(self, grace_s: float) -> bool:
        assert self.ingress is not None
        self.lifecycle.stopping.set()  # the front-end's exit after its drain is expected
        self.ingress.draining = True
        self.link.push()
        drained = await self.link.drain(grace_s)
        self.link.close()
        return drained

    async def close(self) -> None:
        self.lifecycle.stopping.set()  # the front-end's exit that follows is expected
        self.link.close()
