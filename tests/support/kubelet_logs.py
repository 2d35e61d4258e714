"""The kubelet's container-log endpoint for the local node, so ``pods/log`` works on the real control plane.

``GET /api/v1/namespaces/NS/pods/POD/log`` is answered by the kube-apiserver
proxying to the kubelet of the pod's node: ``https://ADDRESS:PORT/containerLogs/NS/POD/CONTAINER``
with ``tailLines``, ``limitBytes``, ``previous`` and ``timestamps``, where
ADDRESS and PORT are the Node's ``status.addresses`` and
``status.daemonEndpoints.kubeletEndpoint.Port``.  This serves exactly that
endpoint over TLS (a throwaway self-signed certificate: the apiserver here has
no ``--kubelet-certificate-authority``, so, like a default kubeadm cluster, it
does not verify the kubelet's certificate) from the log files the local node
writes (``<root>/logs/NS_POD_UID8/CONTAINER/N.log``, one ``TIMESTAMP line`` per
line, N counting the container's runs), then points the Node at it.

    with ContainerLogServer(node) as logs:     # after node.start()
        kubectl logs POD -c CONTAINER --tail 5  # works; so does the operator's read of pods/log
"""

from __future__ import annotations

import re
import ssl
import subprocess
import tempfile
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import parse_qs, urlsplit

if TYPE_CHECKING:
    from tests.support.local_node import LocalNode

_PATH = re.compile(r"^/containerLogs/([^/]+)/([^/]+)/([^/]+)$")
_RUN = re.compile(r"^(\d+)\.log$")


def container_log(root: Path, namespace: str, pod: str, container: str, *, previous: bool = False) -> str | None:
    """The current (or previous) run's log of one container, timestamps stripped; None when there is none."""
    dirs = sorted((root / "logs").glob(f"{namespace}_{pod}_*/{container}"))
    if not dirs:
        return None
    runs = sorted((int(m.group(1)), p) for p in dirs[-1].iterdir() if (m := _RUN.match(p.name)))
    if len(runs) < (2 if previous else 1):
        return None
    text = runs[-2 if previous else -1][1].read_text(encoding="utf-8", errors="replace")
    return "".join(line.split(" ", 1)[1] if " " in line else "\n" for line in text.splitlines(keepends=True))


def tail(text: str, tail_lines: int | None, limit_bytes: int | None) -> bytes:
    if tail_lines is not None:
        lines = text.splitlines(keepends=True)
        text = "".join(lines[-tail_lines:]) if tail_lines > 0 else ""
    data = text.encode()
    return data[:limit_bytes] if limit_bytes is not None else data


class ContainerLogServer:
    """``/containerLogs`` of one LocalNode on ``node.host_ip``; ``start()`` also patches the Node to name it."""

    def __init__(self, node: LocalNode) -> None:
        self.node = node
        self._httpd: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._certs = tempfile.TemporaryDirectory(prefix="kubelet-logs-")
        self.requests: list[str] = []  # request paths with their queries, for a test to see who asked what

    def start(self) -> ContainerLogServer:
        cert, key = Path(self._certs.name, "tls.crt"), Path(self._certs.name, "tls.key")
        subprocess.run(
            [
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-days",
                "1",
                "-subj",
                f"/CN={self.node.name}",
                "-addext",
                f"subjectAltName=IP:{self.node.host_ip}",
                "-keyout",
                str(key),
                "-out",
                str(cert),
            ],
            check=True,
            capture_output=True,
            timeout=60,
        )
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(cert, key)
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                server.requests.append(self.path)
                url = urlsplit(self.path)
                match = _PATH.match(url.path)
                if match is None:
                    self.send_error(404)
                    return
                query = {k: v[-1] for k, v in parse_qs(url.query).items()}
                text = container_log(server.node.root, *match.groups(), previous=query.get("previous") == "true")
                if text is None:
                    self.send_error(404, "no such container log")
                    return
                body = tail(
                    text,
                    int(query["tailLines"]) if "tailLines" in query else None,
                    int(query["limitBytes"]) if "limitBytes" in query else None,
                )
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:  # noqa: A002 - quiet tests
                pass

        self._httpd = ThreadingHTTPServer((self.node.host_ip, 0), Handler)
        self._httpd.socket = context.wrap_socket(self._httpd.socket, server_side=True)
        self._thread = threading.Thread(target=self._httpd.serve_forever, name="kubelet-logs", daemon=True)
        self._thread.start()
        # The apiserver prefers a Hostname address, which would not resolve here: name the node by its IP only
        # (a JSON merge patch replaces the list; a strategic one would merge it by type and keep the Hostname).
        from tests.support.local_node_api import MERGE

        self.node.api.patch_status(
            "v1",
            "nodes",
            self.node.name,
            {
                "addresses": [{"type": "InternalIP", "address": self.node.host_ip}],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": self.port}},
            },
            content_type=MERGE,
        )
        return self

    @property
    def port(self) -> int:
        assert self._httpd is not None
        return int(self._httpd.server_address[1])

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None
        self._certs.cleanup()

    def __enter__(self) -> ContainerLogServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
