"""A real HTTP server on 127.0.0.1 serving a directory, for fetch and end-to-end tests.

Threaded stdlib ``http.server`` with what a checkpoint download leans on:
single-range ``Range`` requests (206/416), ``If-Range``, strong ETags, HEAD,
optional bearer-token check, optional throttling (to make a download slow
enough to kill mid-file) and a request log a test can count::

    with CheckpointServer(root, token="s3cret") as server:
        url = server.url + "ckpt/"            # http://127.0.0.1:PORT/ckpt/
        ...
        server.count("/ckpt/model.safetensors")           # GETs of that path
        [r.range for r in server.requests]                # e.g. "bytes=1048576-"

``requests`` holds ``RequestRecord(method, path, headers, range)``; secret
headers (Authorization, Cookie) are recorded as ``"<redacted>"`` so a test can
assert the header arrived without the log holding the secret.
"""

from __future__ import annotations

import os
import re
import threading
import time
from email.utils import formatdate
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import BinaryIO, NamedTuple, Self
from urllib.parse import unquote, urlsplit

SECRET_HEADERS = frozenset({"authorization", "cookie", "proxy-authorization"})
_RANGE = re.compile(r"bytes=(\d*)-(\d*)$")
_SEND_CHUNK = 1 << 20


def _canonical(name: str) -> str:
    """``authorization`` (httpx) and ``Authorization`` (urllib) are one header: record it one way."""
    return "-".join(part.capitalize() for part in name.split("-"))


class RequestRecord(NamedTuple):
    method: str
    path: str  # URL path, percent-decoded, without the query
    headers: dict[str, str]  # names Canonical-Cased, secrets replaced by "<redacted>"
    range: str | None  # the Range header as sent, e.g. "bytes=100-"


class LoopbackHTTPServer:
    """Base: lifecycle, request log, auth, throttled Range file serving; subclasses route."""

    def __init__(
        self, *, token: str | None = None, throttle_bps: int | None = None, host: str = "127.0.0.1", port: int = 0
    ) -> None:
        self.token = token
        self.throttle_bps = throttle_bps  # may be changed while running
        self.requests: list[RequestRecord] = []
        self.bytes_sent: dict[str, int] = {}
        self._host, self._port = host, port
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    # --- lifecycle ---------------------------------------------------------------
    def start(self) -> Self:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                owner._dispatch(self, head=False)

            def do_HEAD(self) -> None:  # noqa: N802
                owner._dispatch(self, head=True)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet tests
                pass

        self._stopping.clear()
        self._httpd = ThreadingHTTPServer((self._host, self._port), Handler)
        self._httpd.daemon_threads = True
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, kwargs={"poll_interval": 0.1}, name=f"{type(self).__name__}", daemon=True
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._httpd = self._thread = None

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._httpd is not None, "server not started"
        return self._httpd.server_address[1]

    @property
    def url(self) -> str:
        return f"http://{self._host}:{self.port}/"

    # --- log ------------------------------------------------------------------------
    def count(self, path: str | None = None, method: str | None = "GET") -> int:
        with self._lock:
            return sum(
                1 for r in self.requests if (path is None or r.path == path) and (method is None or r.method == method)
            )

    def reset_log(self) -> None:
        with self._lock:
            self.requests.clear()
            self.bytes_sent.clear()

    def _record(self, handler: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        headers = {
            _canonical(k): ("<redacted>" if k.lower() in SECRET_HEADERS else v) for k, v in handler.headers.items()
        }
        with self._lock:
            self.requests.append(RequestRecord("HEAD" if head else "GET", path, headers, handler.headers.get("Range")))

    # --- request handling -----------------------------------------------------------
    def _dispatch(self, handler: BaseHTTPRequestHandler, head: bool) -> None:
        path = unquote(urlsplit(handler.path).path)
        self._record(handler, path, head)
        try:
            self.handle(handler, path, head)
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            handler.close_connection = True  # the client went away (a killed fetch): nothing to answer

    def handle(self, handler: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        raise NotImplementedError

    def authorized(self, handler: BaseHTTPRequestHandler) -> bool:
        return self.token is None or handler.headers.get("Authorization") == f"Bearer {self.token}"

    def send_status(
        self,
        handler: BaseHTTPRequestHandler,
        status: int,
        body: bytes = b"",
        *,
        head: bool = False,
        headers: dict[str, str] | None = None,
    ) -> None:
        handler.send_response(status)
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.send_header("Content-Length", str(len(body)))
        if body:
            handler.send_header("Content-Type", "text/plain; charset=utf-8")
        handler.end_headers()
        if body and not head:
            handler.wfile.write(body)

    def send_file(
        self,
        handler: BaseHTTPRequestHandler,
        file: Path,
        *,
        head: bool,
        log_path: str,
        headers: dict[str, str] | None = None,
    ) -> None:
        """Serve ``file`` honouring Range / If-Range; counts body bytes under ``log_path``."""
        st = file.stat()
        size = st.st_size
        extra = dict(headers or {})
        etag = extra.pop("ETag", f'"{st.st_size:x}-{st.st_mtime_ns:x}"')
        last_modified = formatdate(st.st_mtime, usegmt=True)
        start, end, status = 0, size - 1, HTTPStatus.OK
        range_header = handler.headers.get("Range")
        if_range = handler.headers.get("If-Range")
        if range_header and (if_range is None or if_range in (etag, last_modified)):
            match = _RANGE.match(range_header.strip())
            if match and (match.group(1) or match.group(2)):
                first, last = match.group(1), match.group(2)
                if first:
                    start, end = int(first), min(int(last), size - 1) if last else size - 1
                else:
                    start, end = max(size - int(last), 0), size - 1
                if start >= size or start > end:
                    self.send_status(
                        handler,
                        HTTPStatus.REQUESTED_RANGE_NOT_SATISFIABLE,
                        head=head,
                        headers={"Content-Range": f"bytes */{size}"},
                    )
                    return
                status = HTTPStatus.PARTIAL_CONTENT
        length = end - start + 1 if size else 0
        handler.send_response(status)
        handler.send_header("Content-Type", "application/octet-stream")
        handler.send_header("Content-Length", str(length))
        handler.send_header("Accept-Ranges", "bytes")
        handler.send_header("ETag", etag)
        handler.send_header("Last-Modified", last_modified)
        if status == HTTPStatus.PARTIAL_CONTENT:
            handler.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        for name, value in extra.items():
            handler.send_header(name, value)
        handler.end_headers()
        if head or not length:
            return
        handler.wfile.flush()
        with open(file, "rb") as f:
            self._send_body(handler, f, start, length, log_path)

    def _send_body(self, handler: BaseHTTPRequestHandler, f: BinaryIO, offset: int, length: int, log_path: str) -> None:
        sock = handler.connection
        while length > 0 and not self._stopping.is_set():
            bps = self.throttle_bps
            if bps:
                n = min(length, max(bps // 20, 4096))
                f.seek(offset)
                sock.sendall(f.read(n))
                time.sleep(n / bps)
            else:
                n = os.sendfile(sock.fileno(), f.fileno(), offset, min(length, 16 * _SEND_CHUNK))
                if n == 0:
                    break
            offset += n
            length -= n
            with self._lock:
                self.bytes_sent[log_path] = self.bytes_sent.get(log_path, 0) + n
        if length > 0:
            handler.close_connection = True


class CheckpointServer(LoopbackHTTPServer):
    """Serves the files under ``root`` (no directory listings, like a bucket behind a CDN)."""

    def __init__(self, root: str | os.PathLike[str], **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.root = Path(root).resolve()

    def url_for(self, relpath: str) -> str:
        return self.url + relpath.lstrip("/")

    def handle(self, handler: BaseHTTPRequestHandler, path: str, head: bool) -> None:
        if not self.authorized(handler):
            self.send_status(
                handler,
                HTTPStatus.UNAUTHORIZED,
                b"token required\n",
                head=head,
                headers={"WWW-Authenticate": 'Bearer realm="checkpoints"'},
            )
            return
        file = (self.root / path.lstrip("/")).resolve()
        if self.root not in file.parents or not file.is_file():
            self.send_status(handler, HTTPStatus.NOT_FOUND, b"not found\n", head=head)
            return
        self.send_file(handler, file, head=head, log_path=path)
