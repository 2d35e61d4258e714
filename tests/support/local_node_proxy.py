"""The Service proxy of the local node: a 127.0.0.1 port per Service port, forwarding TCP to a ready endpoint.

kube-proxy makes a Service's ClusterIP reach its ready endpoints through
iptables/nftables rules; on this machine nothing may program the host's
packet filter, and the ClusterIPs the API server allocates are not
addresses of this machine.  So the node plays kube-proxy's old *userspace*
mode instead: for each port of each Service it serves, one listening socket
on ``127.0.0.1:<host port>`` (picked by the kernel, fixed for the Service
port's lifetime); every accepted connection goes to a ready endpoint picked
at random (iptables mode's choice), trying the others if that one refuses,
and bytes are copied both ways until both sides are done, so anything over
TCP works, WebSocket included.  With no ready endpoint the connection is
closed at once, as kube-proxy rejects it.

The endpoints themselves are computed by the node (``local_node``) and
handed to :meth:`ServiceProxy.update`; this module only moves bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

log = logging.getLogger("local_node.proxy")

CONNECT_TIMEOUT_S = 5.0
CHUNK = 1 << 16


@dataclass(frozen=True)
class ServicePort:
    """One port of one Service, as a client names it."""

    namespace: str
    service: str
    name: str  # the port's name ("" when the Service has a single unnamed port)
    port: int  # the Service port (not the target port)


@dataclass
class _Listener:
    server: asyncio.base_events.Server
    host_port: int
    backends: list[tuple[str, int]] = field(default_factory=list)
    connections: set[asyncio.Task[None]] = field(default_factory=set)


class ServiceProxy:
    """Listeners in one asyncio loop on a thread of its own; ``update()`` from any thread."""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self.host = host
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local-node-proxy", daemon=True)
        self._listeners: dict[ServicePort, _Listener] = {}
        self._lock = threading.Lock()
        self.connections = 0  # accepted in all, for tests and describe()

    def start(self) -> ServiceProxy:
        self._thread.start()
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self._close_all(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()

    def address(self, namespace: str, service: str, port: int | str | None = None) -> tuple[str, int] | None:
        """(host, port) of a Service port, by its name or number (None: the only port); None if not served."""
        with self._lock:
            found = [
                (k, lst)
                for k, lst in self._listeners.items()
                if k.namespace == namespace
                and k.service == service
                and (port is None or k.name == str(port) or str(k.port) == str(port))
            ]
        if not found or (port is None and len(found) > 1):
            return None
        return self.host, found[0][1].host_port

    def backends(self, namespace: str, service: str) -> list[tuple[str, int]]:
        with self._lock:
            return sorted(
                {
                    b
                    for k, lst in self._listeners.items()
                    if (k.namespace, k.service) == (namespace, service)
                    for b in lst.backends
                }
            )

    def update(self, wanted: Mapping[ServicePort, Sequence[tuple[str, int]]]) -> None:
        """Open listeners for new Service ports, close those of ports gone, set every port's ready endpoints."""
        asyncio.run_coroutine_threadsafe(self._update(dict(wanted)), self._loop).result(timeout=30)

    # --- inside the loop ------------------------------------------------------------------------

    async def _update(self, wanted: dict[ServicePort, Sequence[tuple[str, int]]]) -> None:
        for key in [k for k in self._listeners if k not in wanted]:
            await self._close(key)
        for key, backends in wanted.items():
            listener = self._listeners.get(key)
            if listener is None:
                server = await asyncio.start_server(functools.partial(self._accept, key), self.host, 0)
                port = server.sockets[0].getsockname()[1]
                listener = _Listener(server, port)
                with self._lock:
                    self._listeners[key] = listener
                log.info("service %s/%s port %s -> %s:%d", key.namespace, key.service, key.port, self.host, port)
            with self._lock:
                listener.backends = list(backends)

    async def _close(self, key: ServicePort) -> None:
        with self._lock:
            listener = self._listeners.pop(key)
        listener.server.close()
        for task in list(listener.connections):
            task.cancel()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(listener.server.wait_closed(), 5)

    async def _close_all(self) -> None:
        for key in list(self._listeners):
            await self._close(key)

    async def _accept(self, key: ServicePort, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        listener = self._listeners.get(key)
        task = asyncio.current_task()
        if listener is None or task is None:
            writer.close()
            return
        listener.connections.add(task)
        self.connections += 1
        try:
            await self._forward(list(listener.backends), reader, writer)
        except asyncio.CancelledError:
            pass
        finally:
            listener.connections.discard(task)
            writer.close()

    async def _forward(
        self, backends: list[tuple[str, int]], reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        random.shuffle(backends)
        for host, port in backends:
            try:
                up_reader, up_writer = await asyncio.wait_for(asyncio.open_connection(host, port), CONNECT_TIMEOUT_S)
            except (TimeoutError, OSError) as exc:
                log.info("endpoint %s:%d refused: %s", host, port, exc)
                continue
            try:
                await asyncio.gather(_pipe(reader, up_writer), _pipe(up_reader, writer))
            finally:
                up_writer.close()
            return
        # no ready endpoint (or none answered): the connection is refused, as kube-proxy's REJECT rule does


async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Copy until EOF, then half-close the other side (a WebSocket close handshake needs both directions)."""
    try:
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
        if writer.can_write_eof():
            writer.write_eof()
    except (ConnectionError, OSError):
        writer.close()
