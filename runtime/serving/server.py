"""The openpi-compatible WebSocket server, with health, readiness and metrics on the same port.

Protocol (docs/protocol.md): on connect the server sends the metadata map;
each binary frame is one observation, answered by ``{"actions",
"server_timing"}``.  A bad frame or observation fails that request only: by
default (``--error-format text``, openpi's own behaviour) the server sends a
text frame with the reason and closes with 1011, which openpi-client raises
as ``RuntimeError``; with ``--error-format dict`` it sends
``{"type": "error", "error": {"kind", "message"}}`` and keeps the connection.

Plain HTTP ``GET /healthz``, ``/readyz`` and ``/metrics`` are answered before
the WebSocket upgrade (the Service exposes one port).  Inference never runs on
the event loop, so probes and keepalive pings answer during long requests.
"""

from __future__ import annotations

import asyncio
import hmac
import http
import json
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import websockets
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response
from websockets.protocol import State

from policy_operator.constants import DEFAULT_PORT, HEALTHZ_PATH, METRICS_PATH, READYZ_PATH
from policy_operator.runtime.errors import DrainTimeout, ErrorKind, NotReady, RequestError
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcSession
from policy_operator.runtime.serving import wire
from policy_operator.runtime.serving.backend import Backend
from policy_operator.runtime.serving.limits import MAX_QUEUED_FRAMES, MemoryReturn, ReadBudget, bounded_connection
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.probe_cache import ProbePacer, Recomputed
from policy_operator.serve_flags import (
    DEFAULT_FRAME_READ_TIMEOUT_S,
    DEFAULT_MAX_BUFFERED_BYTES,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_SESSION_IDLE_TIMEOUT_S,
)

log = logging.getLogger(__name__)
CONNECTION_LOG = logging.getLogger("policy_operator.runtime.serving.connections")  # websockets' own records
HEALTHZ_BODY = b'{"status": "ok"}'
PROBE_PATHS = frozenset({HEALTHZ_PATH, READYZ_PATH, METRICS_PATH})

ErrorFormat = Literal["text", "dict"]
GOING_AWAY = 1001  # the close code of a draining server: clients reconnect, through the Service, to a ready pod
DRAIN_REASON = "server is shutting down; reconnect"
ERROR_SEND_S = 1.0  # after the grace period: how long the failed requests' sessions get to send their error


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = DEFAULT_PORT
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    error_format: ErrorFormat = "text"
    auth_token: str | None = None
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES
    frame_read_timeout_s: float = DEFAULT_FRAME_READ_TIMEOUT_S
    session_idle_timeout_s: float = DEFAULT_SESSION_IDLE_TIMEOUT_S  # 0: never
    reuse_port: bool = False  # several front-end processes serve one port (SO_REUSEPORT)


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


# A session answered (or sending) this recently counts as coming back: a robot sends its next frame 20-100 ms
# after its reply, however long the reply took to compute.
RECENT_SESSION_S = 1.0


class SharedCount(Protocol):
    """Open sessions counted with those of other servers on the same port (``ipc.SessionCounts``)."""

    def set(self, open_here: int) -> None:
        """This server's open sessions, after every session opened or closed."""

    def total(self) -> int:
        """The open sessions of all of them."""


class Sessions:
    """The open WebSocket sessions and where each is in its request cycle; what the batch window, a drain and
    ``--max-connections`` read.

    A session is *idle* between requests (what a drain closes at once), *in flight* while its request is
    decoded, prepared, queued or computed, and *sending* while its reply is being written: a client that
    stopped reading keeps a session sending for as long as the connection lives, and such a session is not
    coming back, so the window never waits for it.
    """

    def __init__(self, shared: SharedCount | None = None) -> None:
        """``shared``: where this server's count joins those of the other servers of its port, which
        ``--max-connections`` bounds together; None: it bounds this server's own sessions."""
        self.shared = shared
        self.open: set[ServerConnection] = set()
        self.idle: set[ServerConnection] = set()
        self.sending: set[ServerConnection] = set()
        # monotonic time of each session's last frame or delivered reply: a robot's next frame follows its reply
        self.last_active: dict[ServerConnection, float] = {}
        self.opened_at: dict[ServerConnection, float] = {}  # when each session opened (idle before its first frame)

    def opened(self, ws: ServerConnection) -> None:
        self.open.add(ws)
        self.idle.add(ws)
        self.opened_at[ws] = time.monotonic()
        if self.shared is not None:
            self.shared.set(len(self.open))

    def request(self, ws: ServerConnection) -> None:
        self.idle.discard(ws)
        self.last_active[ws] = time.monotonic()

    def answered(self, ws: ServerConnection) -> None:
        self.last_active[ws] = time.monotonic()
        self.idle.add(ws)

    def closed(self, ws: ServerConnection) -> None:
        for group in (self.open, self.idle, self.sending):
            group.discard(ws)
        self.last_active.pop(ws, None)
        self.opened_at.pop(ws, None)
        if self.shared is not None:
            self.shared.set(len(self.open))

    def counted(self) -> int:
        """The sessions ``--max-connections`` bounds: this server's, or with ``shared`` those of its port."""
        return len(self.open) if self.shared is None else self.shared.total()

    def idle_since(self, before: float) -> list[ServerConnection]:
        """Sessions between requests whose last frame or reply (or whose connect) was before ``before``."""
        return [ws for ws in self.idle if self.last_active.get(ws, self.opened_at.get(ws, before)) < before]

    def busy(self) -> set[ServerConnection]:
        return self.open - self.idle

    def recent(self) -> int:
        """Open sessions that can send their next request soon: a request in flight (its robot comes back
        however long the batch computes), or a request or delivered reply within ``RECENT_SESSION_S``.  A
        session whose reply is still being written (its client is not reading) does not count."""
        since = time.monotonic() - RECENT_SESSION_S
        return sum(
            1 for ws, t in self.last_active.items() if ws not in self.sending and (t >= since or ws not in self.idle)
        )


def _json(status: int, payload: dict[str, Any]) -> Response:
    return _response(status, json.dumps(payload).encode(), "application/json")


class PolicyWebSocketServer:
    """One port: probes and metrics as plain HTTP, robots as WebSocket sessions; requests go to the ingress."""

    def __init__(self, ingress: Backend, config: ServerConfig, metrics: ServerMetrics, sessions: Sessions) -> None:
        """``ingress``: the front-end (``admission.FrontEnd``) over the engine, in this process or behind a pipe."""
        self.ingress = ingress
        self.config = config
        self.metrics = metrics
        self.sessions = sessions
        self.budget = ReadBudget(
            config.max_buffered_bytes,
            config.frame_read_timeout_s,
            on_close=lambda reason: metrics.connections_closed.labels(reason).inc(),
        )
        self.memory = MemoryReturn()  # unfinished messages' buffers back to the system once they are freed
        # a probe or scrape flood gets the same bytes again instead of the loop's time (probe_cache.py)
        self._readyz_answer = Recomputed(self._readyz)
        self._metrics_answer = Recomputed(self._scrape)
        self._pacer = ProbePacer()
        self._server: Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    # --- HTTP before the upgrade ---------------------------------------------------------
    def _auth_refusal(self, request: Request) -> Response | None:
        """None when the request may go on; else its answer: 400 for more than one ``Authorization`` header (which
        one a proxy honours is ambiguous), 401 for a missing, malformed or wrong token.  One log line, no
        traceback: a client that sends such headers may send many."""
        if self.config.auth_token is None:
            return None
        headers = request.headers.get_all("Authorization")
        if len(headers) > 1:
            self.metrics.errors.labels(ErrorKind.UNAUTHORIZED.value).inc()
            log.info("refused an upgrade with %d Authorization headers (400)", len(headers))
            return _json(400, {"error": "more than one Authorization header; send exactly one"})
        scheme, _, token = (headers[0] if headers else "").partition(" ")
        try:
            valid = scheme.lower() in ("bearer", "api-key") and hmac.compare_digest(
                token.strip().encode(), self.config.auth_token.encode()
            )
        except (TypeError, UnicodeError):  # compare_digest wants ASCII-compatible bytes; any header is refused
            valid = False
        if valid:
            return None
        self.metrics.errors.labels(ErrorKind.UNAUTHORIZED.value).inc()
        return _json(401, {"error": "missing or invalid token (Authorization: Bearer <token> or Api-Key <token>)"})

    def _readyz(self) -> tuple[int, bytes]:
        readiness = self.ingress.readiness()
        self.metrics.ranks_ready.set(readiness.ranks_ready)
        if self.connections_full():
            readiness = readiness.model_copy(update={"connections_full": True})
        return 200 if readiness.ready else 503, readiness.to_json()

    def _scrape(self) -> bytes:
        # ranks ready and the cap as of this scrape, not as of the last kubelet probe or sweep
        self.metrics.ranks_ready.set(self.ingress.readiness().ranks_ready)
        self.metrics.connections_full.set(self.connections_full())
        return self.metrics.render()

    def _probe_answer(self, path: str) -> Response:
        if path == HEALTHZ_PATH:
            return _response(200, HEALTHZ_BODY, "application/json")
        if path == READYZ_PATH:
            status, body = self._readyz_answer.get()
            return _response(status, body, "application/json")
        return _response(200, self._metrics_answer.get(), self.metrics.content_type)

    def process_request(self, connection: ServerConnection, request: Request) -> Response | Awaitable[Response] | None:
        path = request.path.split("?", 1)[0]
        if path in PROBE_PATHS:  # at once, or a moment later during a flood (probe_cache.ProbePacer)
            return self._pacer.pace(lambda: self._probe_answer(path))
        if (refused := self._auth_refusal(request)) is not None:
            return refused
        if not self.ingress.accepting:
            return _json(
                503, {"error": "server is shutting down" if self.ingress.draining else "server is not ready yet"}
            )
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _json(404, {"error": f"no such path {path}; WebSocket clients connect to /"})
        if self.sessions.counted() >= self.config.max_connections:
            self.metrics.connections_closed.labels("max_connections").inc()
            return _json(
                503,
                {
                    "error": f"server has {self.config.max_connections} connections open "
                    "(--max-connections); retry later or elsewhere"
                },
            )
        return None

    # --- the WebSocket session ---------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        self.metrics.connections.inc()
        sessions = self.sessions
        sessions.opened(ws)
        try:
            await ws.send(wire.packb(self.ingress.metadata()))
            prev_total_ms: float | None = None
            rtc_session = RtcSession()  # this connection's state: its sessions' scope, the short rtc form's reference
            async for message in ws:
                sessions.request(ws)
                started = time.perf_counter()
                self.metrics.in_flight.inc()
                try:
                    reply = await self.ingress.infer(message, rtc_session)
                except NotReady as exc:
                    self.metrics.errors.labels(exc.kind.value).inc()
                    await ws.close(1001, str(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
                    kind = exc.kind if isinstance(exc, RequestError) else ErrorKind.INTERNAL
                    if kind is ErrorKind.INTERNAL:
                        log.exception("request failed")
                    elif kind is ErrorKind.BAD_FRAME:
                        log.info("bad frame: %s", exc)  # one line: whoever sends these may send many
                    self.metrics.errors.labels(kind.value).inc()
                    if await self._reply(ws, self._error_frame(ws, kind, str(exc))) is None:
                        return
                    continue
                finally:
                    self.metrics.in_flight.dec()
                replying = time.perf_counter()
                # the actions map of docs/protocol.md; total_ms: frame received -> reply ready, so what the server
                # itself adds is total_ms - infer_ms
                frame = {
                    "actions": reply.actions,
                    "server_timing": {
                        "infer_ms": reply.infer_ms,
                        "queue_ms": reply.queue_ms,
                        "decode_ms": reply.decode_ms,
                        "prepare_ms": reply.prepare_ms,
                        "replica": reply.replica,
                        "batch_size": reply.batch_size,
                        "prev_total_ms": prev_total_ms,
                        "total_ms": (replying - started) * 1e3,
                    },
                }
                sent = await self._reply(ws, wire.packb(frame), reply, started, replying)
                if sent is None:
                    return
                prev_total_ms = (sent - started) * 1e3
        except websockets.ConnectionClosed:
            pass
        finally:
            sessions.closed(ws)
            self.metrics.connections.dec()

    async def _reply(
        self,
        ws: ServerConnection,
        frame: bytes | str,
        answered: Result | None = None,
        started: float = 0.0,
        replying: float = 0.0,
    ) -> float | None:
        """Write one reply, actions or error, and move the session on; when it was written (``perf_counter``),
        or None when the session ended.

        While it is written the session is *sending* (not coming back).  An error's text frame (openpi's) closes
        the connection.  ``answered``: the request answered with actions, received at ``started`` and its reply
        ready at ``replying`` (``perf_counter``): its metrics, with the write's time and the whole round trip once
        written (its count and compute time alone when the connection closed while it was written).  After any
        reply the session is between requests (what a drain closes at once, what the batch window counts as coming
        back), or closed with 1001 when draining."""
        self.sessions.sending.add(ws)
        sent = None
        try:
            await ws.send(frame)
            sent = time.perf_counter()
        finally:
            self.sessions.sending.discard(ws)
            if answered is not None:
                written = None if sent is None else (sent - started, sent - replying)
                self.metrics.observe_answer(answered, written, ws.latency)
        if isinstance(frame, str):  # openpi's error reply: a text frame, then the connection closes
            # A close reason may hold 123 bytes of UTF-8; cut by bytes, not characters, or close() itself raises.
            await ws.close(1011, frame.encode()[:123].decode("utf-8", "ignore"))
            return None
        if self.ingress.draining:  # this session's request is answered: send it to a ready pod
            await ws.close(GOING_AWAY, DRAIN_REASON)
            return None
        self.sessions.answered(ws)
        return sent

    def _error_frame(self, ws: ServerConnection, kind: ErrorKind, message: str) -> bytes | str:
        """``--error-format dict``: the documented error map (the connection stays); text: openpi's text frame."""
        if self.config.error_format == "dict":
            return wire.packb(wire.error_dict(kind, message))
        return f"{kind.value}: {message}"

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._server = await serve(
            self.handler,
            self.config.host,
            self.config.port,
            process_request=self.process_request,
            max_size=self.config.max_message_bytes,
            max_queue=MAX_QUEUED_FRAMES,
            compression=None,
            create_connection=bounded_connection(self.budget),
            reuse_port=self.config.reuse_port,
            logger=CONNECTION_LOG,
        )
        # websockets logs two INFO lines per connection, a probe's too (398k lines under a probe flood): they show
        # with --log-level DEBUG only; its warnings and errors always do
        CONNECTION_LOG.setLevel(
            logging.DEBUG if logging.getLogger().getEffectiveLevel() <= logging.DEBUG else logging.WARNING
        )
        self._sweeper = asyncio.ensure_future(self._sweep())
        log.info("listening on ws://%s:%d", self.config.host, self.port)

    async def _sweep(self) -> None:
        """Close connections whose message is unfinished past ``--frame-read-timeout-s`` and sessions idle past
        ``--session-idle-timeout-s``; export buffered bytes and whether the cap is full; give freed buffers back
        to the system."""
        period = min(1.0, self.config.frame_read_timeout_s / 4)
        if self.config.session_idle_timeout_s > 0:
            period = min(period, self.config.session_idle_timeout_s / 4)
        while True:
            await asyncio.sleep(period)
            self.budget.expire()
            self.metrics.buffered_bytes.set(self.budget.total)
            self.memory.observe(self.budget.total)
            self._close_idle()
            self.metrics.connections_full.set(self.connections_full())

    def connections_full(self) -> bool:
        """Every ``--max-connections`` slot taken: the next robot would get 503."""
        return self.sessions.counted() >= self.config.max_connections

    def _close_idle(self) -> None:
        """Close, with 1001, sessions silent past ``--session-idle-timeout-s`` since their last reply (or their
        connect): idle sockets must not hold the connection cap.  A session with a request in flight is not idle."""
        timeout = self.config.session_idle_timeout_s
        if timeout <= 0 or self.ingress.draining:
            return
        for ws in self.sessions.idle_since(time.monotonic() - timeout):
            if ws.protocol.state is not State.OPEN:
                continue  # already closing
            self.metrics.connections_closed.labels("idle_timeout").inc()
            log.info("closing a session idle for %gs (--session-idle-timeout-s)", timeout)
            asyncio.ensure_future(ws.close(GOING_AWAY, f"idle for {timeout:g}s (--session-idle-timeout-s); reconnect"))

    @property
    def port(self) -> int:
        assert self._server is not None
        return self._server.sockets[0].getsockname()[1]

    async def drain(self, grace_s: float) -> bool:
        """Session draining on SIGTERM; True when every request in flight was answered within ``grace_s``.

        At once: ``/readyz`` turns 503 (the Service stops routing here), new
        WebSocket upgrades get 503, and sessions waiting for their next
        request are closed with 1001 (going away), which openpi-client and
        RoboLab clients take as "reconnect" and the Service sends to a ready
        pod.  A session with a request in flight gets its answer first and is
        closed with 1001 right after it; a request that arrives on a session
        during the drain is refused the same way (``NotReady``).  Sessions
        still open when the grace period ends are closed by ``stop()``.
        """
        deadline = time.monotonic() + grace_s
        self.ingress.begin_drain()
        idle = list(self.sessions.idle)
        if idle:
            log.info("draining: closing %d idle session(s) with 1001", len(idle))
        await asyncio.gather(*(ws.close(GOING_AWAY, DRAIN_REASON) for ws in idle), return_exceptions=True)
        drained = await self.ingress.drain(max(0.0, deadline - time.monotonic()))
        # the answers of the last requests are on their way: let their sessions send them and close
        while self.sessions.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return drained

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()


async def drain_sessions(
    server: PolicyWebSocketServer, backend: Backend, *, grace_s: float, heartbeat_s: float
) -> bool:
    """The server's part of a drain: sessions drained up to ``grace_s``, then what still runs failed with
    ``drain_timeout``; ``/readyz`` answers 503 one more heartbeat period and the port closes.  True when every
    request was answered in time.  Rank 0 runs it (``--frontend inline``), or the front-end process when rank 0
    tells it to (``--frontend process``)."""
    drained = await server.drain(grace_s)  # idle sessions closed 1001 at once, busy ones after their reply
    if not drained:
        failed = backend.give_up(
            DrainTimeout(
                f"the server is shutting down and this request was still running when its {grace_s:g}s grace period "
                "(--drain-grace-s) ended; retry it on another server"
            )
        )
        log.warning("grace period over: %d request(s) still running failed with %s", failed, DrainTimeout.kind.value)
        deadline = time.monotonic() + ERROR_SEND_S
        while server.sessions.busy() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
    # Keep answering /readyz (503 now) for a heartbeat period before the port closes,
    # so probes and load balancers observe the drain instead of a refused connection.
    await asyncio.sleep(min(heartbeat_s, grace_s))
    await server.stop()
    return drained
