"""Servers on 127.0.0.1 that misbehave at each step of an openpi session, for ``policyserver probe``.

Two kinds, both real listening sockets on a thread: ``RawServer`` answers the
TCP connection with whatever bytes it is given (or nothing, or a reset) before
any WebSocket exists; ``BadWsServer`` completes a real WebSocket handshake
(the ``websockets`` library's own server) and then sends the frames it is given.
Each stops, and joins its thread, when its ``with`` block ends.
"""

from __future__ import annotations

import socket
import struct
import threading
from collections.abc import Callable
from typing import Any

from websockets.sync.server import ServerConnection, serve

ACCEPT_TIMEOUT_S = 0.2
HOLD_S = 30.0  # how long a "never answers" server keeps a connection open: longer than any probe timeout used


class RawServer:
    """Reads the request, then ``reply`` (bytes), ``None`` = say nothing and hold, ``b""`` = close, ``"reset"`` = RST."""

    def __init__(self, reply: bytes | str | None) -> None:
        self.reply = reply
        self._sock = socket.create_server(("127.0.0.1", 0))
        self._sock.settimeout(ACCEPT_TIMEOUT_S)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="raw-server", daemon=True)
        self._open: list[socket.socket] = []
        self.url = f"ws://127.0.0.1:{self._sock.getsockname()[1]}"

    def __enter__(self) -> RawServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)
        for conn in self._open:
            conn.close()
        self._sock.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except TimeoutError:
                continue
            self._open.append(conn)
            conn.settimeout(5)
            if self.reply != b"":
                try:
                    conn.recv(65536)  # the upgrade request
                except OSError:
                    pass
            if self.reply is None:
                self._stop.wait(HOLD_S)
            elif self.reply == "reset":
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()
            else:
                assert isinstance(self.reply, bytes)
                try:
                    conn.sendall(self.reply)
                except OSError:
                    pass
                conn.close()


class BadWsServer:
    """A real WebSocket server whose session is ``script(connection)``."""

    def __init__(self, script: Callable[[ServerConnection], Any]) -> None:
        self._server = serve(self._handler(script), "127.0.0.1", 0, compression=None)
        self._thread = threading.Thread(target=self._server.serve_forever, name="bad-ws-server", daemon=True)
        self.url = f"ws://127.0.0.1:{self._server.socket.getsockname()[1]}"

    def _handler(self, script: Callable[[ServerConnection], Any]) -> Callable[[ServerConnection], None]:
        def handle(ws: ServerConnection) -> None:
            try:
                script(ws)
            except Exception:  # noqa: BLE001 - the client went away; nothing to report
                pass

        return handle

    def __enter__(self) -> BadWsServer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._thread.join(timeout=10)
