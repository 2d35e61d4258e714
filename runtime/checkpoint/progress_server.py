"""The fetch's newest progress line over HTTP, so the operator needs no access to pod logs.

``status.checkpoint.progress`` used to come from the last progress line of the
fetch pod's log, which needs ``pods/log``; that grant lets the operator read
the log of any pod in the namespace, and together with creating Jobs, any
Secret.  The fetch container instead answers ``GET /progress`` on a fixed port
(``FETCH_PROGRESS_PORT``) with the same line it logs
(``policy_operator/fetch_progress.py``), and the operator reads it the way it
reads the server pods' ``/readyz``.  The answer holds byte counts only; a port
that cannot be bound costs the status its progress, never the download.
"""

from __future__ import annotations

import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from policy_operator.constants import ENV_HOST, PROGRESS_PATH
from policy_operator.fetch_progress import FetchProgress


class ProgressServer:
    """Serves the newest :class:`FetchProgress` handed to ``update`` (204 before the first)."""

    def __init__(self, port: int, host: str | None = None, label: str = "fetch") -> None:
        self.port, self.label = port, label
        self.host = host if host is not None else os.environ.get(ENV_HOST) or "0.0.0.0"  # noqa: S104 - the pod's IP
        self._latest: FetchProgress | None = None
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None

    def update(self, progress: FetchProgress) -> None:
        with self._lock:
            self._latest = progress

    @property
    def bound_port(self) -> int | None:
        """The port it listens on (``port`` 0 picks one), None when it could not bind."""
        return None if self._server is None else int(self._server.server_address[1])

    def line(self) -> str | None:
        with self._lock:
            return None if self._latest is None else self._latest.line(self.label)

    def __enter__(self) -> ProgressServer:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                if self.path.split("?", 1)[0] != PROGRESS_PATH:
                    self.send_error(404)
                    return
                line = owner.line()
                body = b"" if line is None else (line + "\n").encode()
                self.send_response(200 if line is not None else 204)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
                pass  # a poll every few seconds is no news for the Job's log

        try:
            self._server = ThreadingHTTPServer((self.host, self.port), Handler)
        except OSError as exc:
            print(f"fetch: progress not served on {self.host}:{self.port}: {exc}", file=sys.stderr, flush=True)
            return self
        self._server.daemon_threads = True
        threading.Thread(target=self._server.serve_forever, name="fetch-progress-http", daemon=True).start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
