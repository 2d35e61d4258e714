"""Checkpoint servers that misbehave the way real ones do, for the fetch's fault tests.

Each is a :class:`CheckpointServer` (real HTTP on 127.0.0.1, real files) that
serves only the first ``cut`` bytes of every file response and then fails the
connection in one way:

* ``"close"``: a clean FIN, as a proxy that gives up mid-body does;
* ``"reset"``: a TCP RST (``SO_LINGER`` 0), as a crashed peer or a load balancer does;
* ``"stall"``: nothing more, connection held open, until the server stops or ``stall_s`` passes.

``ignore_range=True`` answers every request with the whole file from byte 0
(200, no ``Accept-Ranges``), like a server or CDN without Range support.
``cut`` may be a fraction of the file (``0.3``) or a byte count; ``faults``
limits how many responses misbehave (None: all).  Small files (the manifest,
config) are served whole: only files larger than ``min_size`` are cut.
"""

from __future__ import annotations

import os
import socket
import struct
import threading
import time
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import BinaryIO, Literal

from .http_checkpoint_server import CheckpointServer

Fault = Literal["close", "reset", "stall"]


class FaultyCheckpointServer(CheckpointServer):
    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        fault: Fault,
        cut: float | int,
        ignore_range: bool = False,
        faults: int | None = None,
        min_size: int = 64 << 10,
        stall_s: float = 60.0,
        **kwargs: object,
    ) -> None:
        super().__init__(root, **kwargs)
        self.fault = fault
        self.cut = cut
        self.ignore_range = ignore_range
        self.faults_left = faults
        self.min_size = min_size
        self.stall_s = stall_s
        self._fault_lock = threading.Lock()
        self._current: threading.local = threading.local()

    def handle(self, handler: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        if self.ignore_range:
            del handler.headers["Range"]
            del handler.headers["If-Range"]
        file = (self.root / path.lstrip("/")).resolve()
        self._current.size = file.stat().st_size if file.is_file() else 0
        super().handle(handler, path, head)

    def send_file(
        self,
        handler: BaseHTTPRequestHandler,
        file: Path,
        *,
        head: bool,
        log_path: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        extra = dict(headers or {})
        if self.ignore_range:
            extra["Accept-Ranges"] = "none"
        super().send_file(handler, file, head=head, log_path=log_path, headers=extra)

    def _take_fault(self) -> bool:
        with self._fault_lock:
            if self.faults_left is None:
                return True
            if self.faults_left <= 0:
                return False
            self.faults_left -= 1
            return True

    def _send_body(self, handler: BaseHTTPRequestHandler, f: BinaryIO, offset: int, length: int, log_path: str) -> None:
        size = self._current.size
        if size < self.min_size or not self._take_fault():
            super()._send_body(handler, f, offset, length, log_path)
            return
        cut = int(size * self.cut) if isinstance(self.cut, float) else int(self.cut)
        n = max(0, min(length, cut))
        f.seek(offset)
        handler.connection.sendall(f.read(n))
        with self._lock:
            self.bytes_sent[log_path] = self.bytes_sent.get(log_path, 0) + n
        handler.close_connection = True
        if self.fault == "stall":
            deadline = time.monotonic() + self.stall_s
            while time.monotonic() < deadline and not self._stopping.wait(0.1):
                pass
        elif self.fault == "reset":
            time.sleep(0.2)  # let the bytes reach the client before the RST, which would discard them
            # socketserver would shut the socket down (a FIN) before closing it: take the descriptor
            # away from it and close it with SO_LINGER 0, which sends a bare RST.
            raw = socket.socket(fileno=handler.connection.detach())
            raw.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            raw.close()
        # "close" and "stall": the handler ends the connection with a FIN
