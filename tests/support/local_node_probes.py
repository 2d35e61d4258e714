"""Probes and lifecycle hooks for the local node, executed as the kubelet does.

One :class:`ProbeWorker` thread per (container, probe kind): it waits
``initialDelaySeconds``, then runs the probe every ``periodSeconds`` with
``timeoutSeconds``, and turns ``successThreshold``/``failureThreshold``
consecutive results into a verdict the pod runner reads (``result``): None
until decided, then True or False.  httpGet (2xx/3xx is success, against the
pod IP unless ``host`` is set, named ports resolved from the container's
ports), tcpSocket and exec are supported; grpc is reported as a failure that
says so.
"""

from __future__ import annotations

import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from typing import Any

ExecFn = Callable[[Sequence[str], float], int]  # (command, timeout) -> exit code (non-zero on timeout)

STARTUP, LIVENESS, READINESS = "startup", "liveness", "readiness"
PROBE_FIELDS = {STARTUP: "startupProbe", LIVENESS: "livenessProbe", READINESS: "readinessProbe"}


class _NoRedirect(urllib.request.HTTPRedirectHandler):
    """A redirect is a success by itself (the kubelet does not follow redirects to other hosts)."""

    def redirect_request(self, *args: Any, **kwargs: Any) -> None:
        return None


_OPENER = urllib.request.build_opener(_NoRedirect, urllib.request.ProxyHandler({}))


def resolve_port(port: Any, container: Mapping[str, Any]) -> int:
    """A probe's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int) or (isinstance(port, str) and port.isdigit()):
        return int(port)
    for p in container.get("ports") or []:
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(f"port {port!r} is not a number nor the name of a port of container {container.get('name')!r}")


def http_get(spec: Mapping[str, Any], ip: str, container: Mapping[str, Any], timeout: float) -> tuple[bool, str]:
    scheme = str(spec.get("scheme") or "HTTP").lower()
    host = spec.get("host") or ip
    port = resolve_port(spec.get("port"), container)
    url = f"{scheme}://{host}:{port}{spec.get('path') or '/'}"
    request = urllib.request.Request(url, headers={h["name"]: h["value"] for h in spec.get("httpHeaders") or []})
    request.add_header("User-Agent", "kube-probe/local-node")
    try:
        with _OPENER.open(request, timeout=timeout) as response:
            return 200 <= response.status < 400, f"HTTP {response.status}"
    except urllib.error.HTTPError as exc:
        with exc:
            return 300 <= exc.code < 400, f"HTTP probe failed with statuscode: {exc.code}"
    except (OSError, ValueError) as exc:
        return False, f'Get "{url}": {getattr(exc, "reason", exc)}'


def tcp_socket(spec: Mapping[str, Any], ip: str, container: Mapping[str, Any], timeout: float) -> tuple[bool, str]:
    host, port = spec.get("host") or ip, resolve_port(spec.get("port"), container)
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True, "connected"
    except OSError as exc:
        return False, f"dial tcp {host}:{port}: {exc.strerror or exc}"


def run_handler(
    handler: Mapping[str, Any],
    *,
    ip: str,
    container: Mapping[str, Any],
    timeout: float,
    exec_fn: ExecFn,
    stop: threading.Event | None = None,
) -> tuple[bool, str]:
    """One probe or lifecycle handler (exec, httpGet, tcpSocket, sleep): (success, message)."""
    try:
        if "exec" in handler:
            command = list((handler["exec"] or {}).get("command") or [])
            if not command:
                return False, "exec handler without a command"
            code = exec_fn(command, timeout)
            return code == 0, f"command {command!r} exited with {code}"
        if "httpGet" in handler:
            return http_get(handler["httpGet"], ip, container, timeout)
        if "tcpSocket" in handler:
            return tcp_socket(handler["tcpSocket"], ip, container, timeout)
        if "sleep" in handler:
            seconds = float((handler["sleep"] or {}).get("seconds") or 0)
            (stop or threading.Event()).wait(min(seconds, timeout))
            return True, f"slept {seconds:g}s"
        if "grpc" in handler:
            return False, "grpc probes are not supported by the local node"
    except ValueError as exc:
        return False, str(exc)
    return False, f"handler with none of exec, httpGet, tcpSocket, sleep: {sorted(handler)}"


class ProbeWorker:
    """Runs one probe periodically; ``result`` is the kubelet's verdict (None: not decided yet)."""

    def __init__(
        self,
        kind: str,
        probe: Mapping[str, Any],
        *,
        ip: str,
        container: Mapping[str, Any],
        exec_fn: ExecFn,
        on_change: Callable[[], None],
    ) -> None:
        self.kind = kind
        self.probe = probe
        self.ip, self.container, self.exec_fn, self.on_change = ip, container, exec_fn, on_change
        self.initial_delay = float(probe.get("initialDelaySeconds") or 0)
        self.period = float(probe.get("periodSeconds") or 10)
        self.timeout = float(probe.get("timeoutSeconds") or 1)
        self.success_threshold = int(probe.get("successThreshold") or 1)
        self.failure_threshold = int(probe.get("failureThreshold") or 3)
        self.result: bool | None = None
        self.message = ""
        self.runs = 0
        self._successes = self._failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"probe:{kind}:{container.get('name')}", daemon=True)

    def start(self) -> ProbeWorker:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        if self._stop.wait(self.initial_delay):
            return
        while not self._stop.is_set():
            started = time.monotonic()
            ok, message = run_handler(
                self.probe,
                ip=self.ip,
                container=self.container,
                timeout=self.timeout,
                exec_fn=self.exec_fn,
                stop=self._stop,
            )
            if self._stop.is_set():
                return
            self.runs += 1
            self.message = message
            before = self.result
            if ok:
                self._successes, self._failures = self._successes + 1, 0
                if self._successes >= self.success_threshold:
                    self.result = True
            else:
                self._successes, self._failures = 0, self._failures + 1
                if self._failures >= self.failure_threshold:
                    self.result = False
            if self.result != before:
                self.on_change()
            if self.kind == STARTUP and self.result is not None:
                return  # the kubelet stops a startup probe once it has decided
            self._stop.wait(max(0.0, self.period - (time.monotonic() - started)))
