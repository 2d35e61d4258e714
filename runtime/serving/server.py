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
from dataclasses import dataclass
from typing import Any, Literal

import websockets
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.datastructures import Headers
from websockets.http11 import Request, Response

from policy_operator.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH
from policy_operator.runtime.serving import wire
from policy_operator.runtime.errors import ErrorKind, NotReady, RequestError
from policy_operator.runtime.serving.ingress import Ingress
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.serve_flags import DEFAULT_MAX_MESSAGE_BYTES

log = logging.getLogger(__name__)

ErrorFormat = Literal["text", "dict"]
GOING_AWAY = 1001  # the close code of a draining server: clients reconnect, through the Service, to a ready pod
DRAIN_REASON = "server is shutting down; reconnect"


@dataclass(frozen=True)
class ServerConfig:
    host: str = "0.0.0.0"
    port: int = 8000
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    error_format: ErrorFormat = "text"
    auth_token: str | None = None


def _response(status: int, body: bytes, content_type: str) -> Response:
    headers = Headers([("Content-Type", content_type), ("Content-Length", str(len(body))), ("Connection", "close")])
    return Response(status, http.HTTPStatus(status).phrase, headers, body)


# A session answered (or sending) this recently counts as coming back: a robot sends its next frame 20-100 ms
# after its reply, however long the reply took to compute.
RECENT_SESSION_S = 1.0


def _json(status: int, payload: dict[str, Any]) -> Response:
    return _response(status, json.dumps(payload).encode(), "application/json")


class PolicyWebSocketServer:
    def __init__(self, ingress: Ingress, config: ServerConfig) -> None:
        self.ingress = ingress
        self.config = config
        self.metrics = ServerMetrics()
        self.metrics.set_layout(ingress.layout)
        ingress.on_batch = self.metrics.observe_batch
        self._server: Server | None = None
        # open sessions, and those of them waiting for their next request: what a drain closes at once
        self._sessions: set[ServerConnection] = set()
        self._idle: set[ServerConnection] = set()
        # monotonic time of each session's last frame or reply: a robot's next frame follows its reply
        self._last_active: dict[ServerConnection, float] = {}
        ingress.recent_sessions = self.recent_sessions

    def recent_sessions(self) -> int:
        """Open sessions with a request in flight, or that sent one or got a reply within ``RECENT_SESSION_S``:
        robots in a control loop, likely to send again within milliseconds of their reply -- what a lane's batch
        window waits for.  A request in flight counts however long its batch computes: its robot comes back."""
        since = time.monotonic() - RECENT_SESSION_S
        return sum(1 for ws, t in self._last_active.items() if t >= since or ws not in self._idle)

    # --- HTTP before the upgrade ---------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if self.config.auth_token is None:
            return True
        header = request.headers.get("Authorization", "")
        scheme, _, token = header.partition(" ")
        if scheme.lower() not in ("bearer", "api-key"):
            return False
        return hmac.compare_digest(token.strip().encode(), self.config.auth_token.encode())

    def process_request(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.split("?", 1)[0]
        if path == HEALTHZ_PATH:
            return _json(200, {"status": "ok"})
        if path == READYZ_PATH:
            readiness = self.ingress.readiness()
            self.metrics.ranks_ready.set(readiness.ranks_ready)
            return _response(200 if readiness.ready else 503, readiness.to_json(), "application/json")
        if path == METRICS_PATH:
            # ranks ready as of this scrape, not as of the last kubelet probe
            self.metrics.ranks_ready.set(self.ingress.readiness().ranks_ready)
            return _response(200, self.metrics.render(), self.metrics.content_type)
        if not self._authorized(request):
            self.metrics.errors.labels(ErrorKind.UNAUTHORIZED.value).inc()
            return _json(401, {"error": "missing or invalid token (Authorization: Bearer <token> or Api-Key <token>)"})
        if not self.ingress.accepting:
            return _json(503, {"error": "server is shutting down" if self.ingress.draining else "server is not ready yet"})
        if request.headers.get("Upgrade", "").lower() != "websocket":
            return _json(404, {"error": f"no such path {path}; WebSocket clients connect to /"})
        return None

    # --- the WebSocket session ---------------------------------------------------------
    async def handler(self, ws: ServerConnection) -> None:
        self.metrics.connections.inc()
        self._sessions.add(ws)
        try:
            await ws.send(wire.packb(self.ingress.metadata()))
            prev_total_ms: float | None = None
            self._idle.add(ws)
            async for message in ws:
                self._idle.discard(ws)
                self._last_active[ws] = time.monotonic()
                started = time.perf_counter()
                self.metrics.in_flight.inc()
                try:
                    reply = await self._answer(message)
                except NotReady as exc:
                    self.metrics.errors.labels(exc.kind.value).inc()
                    await ws.close(1001, str(exc))
                    return
                except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
                    kind = exc.kind if isinstance(exc, RequestError) else ErrorKind.INTERNAL
                    if kind is ErrorKind.INTERNAL:
                        log.exception("request failed")
                    self.metrics.errors.labels(kind.value).inc()
                    if not await self._send_error(ws, kind, str(exc)) or not await self._answered(ws):
                        return
                    continue
                finally:
                    self.metrics.in_flight.dec()
                reply["server_timing"]["prev_total_ms"] = prev_total_ms
                # frame received -> reply ready: what the server itself adds is total_ms - infer_ms
                reply["server_timing"]["total_ms"] = (time.perf_counter() - started) * 1e3
                await ws.send(wire.packb(reply))
                prev_total_ms = (time.perf_counter() - started) * 1e3
                self.metrics.latency.observe(prev_total_ms / 1e3)
                if ws.latency > 0:  # 0 until the first keepalive ping of this connection came back
                    self.metrics.network_rtt.observe(ws.latency)
                if not await self._answered(ws):
                    return
        except websockets.ConnectionClosed:
            pass
        finally:
            self._sessions.discard(ws)
            self._idle.discard(ws)
            self._last_active.pop(ws, None)
            self.metrics.connections.dec()

    async def _answered(self, ws: ServerConnection) -> bool:
        """After any reply, actions or error: the session is between requests (what a drain closes at once, what
        the batch window counts as coming back), or closed with 1001 when draining.  False when closed."""
        self._last_active[ws] = time.monotonic()
        if self.ingress.draining:  # this session's request is answered: send it to a ready pod
            await ws.close(GOING_AWAY, DRAIN_REASON)
            return False
        self._idle.add(ws)
        return True

    async def _answer(self, message: bytes | str) -> dict[str, Any]:
        started = time.perf_counter()
        obs = wire.decode_observation(message)
        decode_ms = (time.perf_counter() - started) * 1e3
        result = await self.ingress.infer(obs)
        self.metrics.observe_request(result.replica, result.infer_ms / 1e3, result.queue_ms / 1e3)
        return {
            "actions": result.actions,
            "server_timing": {"infer_ms": result.infer_ms, "queue_ms": result.queue_ms, "decode_ms": decode_ms,
                              "prepare_ms": result.prepare_ms, "replica": result.replica,
                              "batch_size": result.batch_size},
        }

    async def _send_error(self, ws: ServerConnection, kind: ErrorKind, message: str) -> bool:
        """Reply with the error; False when the connection is closed afterwards."""
        if self.config.error_format == "dict":
            await ws.send(wire.packb(wire.error_dict(kind, message)))
            return True
        await ws.send(f"{kind.value}: {message}")
        # A close reason may hold 123 bytes of UTF-8; cut by bytes, not characters, or close() itself raises.
        await ws.close(1011, f"{kind.value}: {message}".encode()[:123].decode("utf-8", "ignore"))
        return False

    # --- lifecycle ----------------------------------------------------------------------
    async def start(self) -> None:
        self._server = await serve(
            self.handler, self.config.host, self.config.port,
            process_request=self.process_request,
            max_size=self.config.max_message_bytes,
            compression=None,
        )
        log.info("listening on ws://%s:%d", self.config.host, self.port)

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
        self.ingress.draining = True
        idle = list(self._idle)
        if idle:
            log.info("draining: closing %d idle session(s) with 1001", len(idle))
        await asyncio.gather(*(ws.close(GOING_AWAY, DRAIN_REASON) for ws in idle), return_exceptions=True)
        drained = await self.ingress.drain(max(0.0, deadline - time.monotonic()))
        # the answers of the last requests are on their way: let their sessions send them and close
        while self._sessions - self._idle and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        return drained

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close(close_connections=True)
            await self._server.wait_closed()


