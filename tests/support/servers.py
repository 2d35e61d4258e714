"""Real ``policyserver serve`` processes for tests, on 127.0.0.1, always cleaned up.

One class, :class:`PolicyServerProcess`, used as a context manager (or through
:func:`serve_policy`)::

    with serve_policy(checkpoint, "--steps", "2") as server:
        server.url                 # ws://127.0.0.1:PORT
        server.get("/readyz")      # HttpReply(status, headers, body); .json()
        server.metric("policy_requests_in_flight")

By default the server is started with ``--port 0`` and the port is read from
its ``listening on ws://HOST:PORT`` line, so there is no window in which
another test can take a port we picked; pass ``--port N`` yourself to choose
one.  Extra args go verbatim to ``serve``; with ``--cfgp 2`` / ``--dp 2`` serve
execs torchrun in the same process, so ``.proc`` is torchrun and its ranks are
its children (in sessions of their own: torchrun starts them that way).
``stop()`` therefore signals our process group *and* every descendant found
under ``/proc``, then SIGKILLs whatever is left after a bound, so no rank
outlives a test.

``send_signal`` / ``wait_exit`` let a test drive shutdown itself (SIGTERM
drain, a killed rank, ...); every wait is bounded and a failure carries the
tail of the server's log.

A server a module's tests share (a module-scoped fixture) passes ``*NO_DRAIN``: its teardown
has nothing to drain.  Two configurations are shared by the whole session (tests/conftest.py):
``shared_server`` (``SHARED_SERVER_ARGS``) and ``auth_server`` (the same with ``AUTH_TOKEN``).

Checkpoints: :func:`session_checkpoint` makes one per (size, seed, overrides)
per test session; the ``tiny_checkpoint`` fixture (tests/conftest.py) is the
common case.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pytest

from policy_operator.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH

from .net import wait_for

VENV_BIN = Path(sys.executable).parent
# Test plug-ins load by import path in served processes (``--policy held_policy:HeldPolicy``).  Only this
# folder goes on their PYTHONPATH: the repository root would shadow the standard library's ``operator``.
PLUGIN_DIR = Path(__file__).resolve().parent / "plugins"
START_TIMEOUT_S = 90.0  # import torch + load + warm-up on 2 busy cores; torchrun adds a few seconds
STOP_TIMEOUT_S = 30.0
# For a server that a module's tests share: its fixture stops it with no request in flight, so SIGTERM needs no
# drain.  Without it the drain keeps /readyz at 503 for a heartbeat period (1 s) before the port closes.
NO_DRAIN = ("--drain-grace-s", "0")
# The session's shared servers (tests/conftest.py: ``shared_server``, ``auth_server``): the flags and token the
# modules that use them rely on.
SHARED_STEPS = 2
SHARED_MAX_MESSAGE_BYTES = 1_000_000  # a RoboLab frame (224x224x3 image) is ~150 kB
SHARED_SERVER_ARGS = ("--steps", str(SHARED_STEPS), "--max-message-bytes", str(SHARED_MAX_MESSAGE_BYTES))
AUTH_TOKEN = "s3cret-token"
_LISTENING = re.compile(r"listening on ws://([0-9.]+):(\d+)")

WaitFor = Literal["ready", "listening", "started"]
# ``POLICY_TEST_FRONTEND=process pytest tests/test_server.py ...`` runs a module's servers with that --frontend
# (a server whose test names one keeps it): the whole server test set in either mode, without parametrizing it.
FRONTEND_ENV = "POLICY_TEST_FRONTEND"


class ServerExited(RuntimeError):
    """The server process ended while a test waited for it."""


def subprocess_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The venv's scripts (policyserver, torchrun) first on PATH, unbuffered, no stray tokens.

    ``PLUGIN_DIR`` goes on PYTHONPATH so test plug-ins load by import path.
    """
    env = dict(os.environ)
    env["PATH"] = f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PLUGIN_DIR), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.pop("HF_TOKEN", None)
    env.update(extra or {})
    return env


@dataclass(frozen=True)
class HttpReply:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", "replace")


def http_get(
    host: str, port: int, path: str, headers: Mapping[str, str] | None = None, timeout: float = 10.0
) -> HttpReply:
    conn = http.client.HTTPConnection(host, port, timeout=timeout)
    try:
        conn.request("GET", path, headers=dict(headers or {}))
        resp = conn.getresponse()
        return HttpReply(resp.status, {k.lower(): v for k, v in resp.getheaders()}, resp.read())
    finally:
        conn.close()


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text -> {(sample name, sorted labels): value}, via prometheus_client's own parser."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


# --- processes -----------------------------------------------------------------------
def proc_stat(pid: int) -> tuple[int, int] | None:
    """(ppid, start time) of a live process, or None; the start time tells a reused pid apart."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live descendant of ``pid``: {pid: start time}."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = proc_stat(int(entry))
            if stat is not None:
                children.setdefault(stat[0], []).append((int(entry), stat[1]))
    found: dict[int, int] = {}
    todo = [pid]
    while todo:
        for child, start in children.get(todo.pop(), []):
            if child not in found:
                found[child] = start
                todo.append(child)
    return found


def rank_pids(pid: int) -> dict[int, int]:
    """{global rank: pid} of the torchrun ranks under ``pid``, read from their environment (``RANK``).

    ``/readyz`` does not publish PIDs (anyone may read it), so a test that
    signals one rank finds it here.  A single-rank server has no torchrun:
    ``pid`` itself is rank 0.
    """
    ranks = {}
    for child in descendants(pid):
        try:
            env = dict(v.split(b"=", 1) for v in Path(f"/proc/{child}/environ").read_bytes().split(b"\0") if b"=" in v)
        except OSError:
            continue
        if b"RANK" in env and b"LOCAL_RANK" in env:
            ranks[int(env[b"RANK"])] = child
    return ranks or {0: pid}


def stop_process(proc: subprocess.Popen, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Signal a child, wait ``timeout``, then SIGKILL it: for helpers (operator, ...) that own one process."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _kill_if_same(pid: int, start: int, sig: int) -> None:
    stat = proc_stat(pid)
    if stat is not None and stat[1] == start:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)


class PolicyServerProcess:
    """``policyserver serve --checkpoint CKPT --host 127.0.0.1 [--port 0] ARGS...`` as a subprocess."""

    host = "127.0.0.1"

    def __init__(
        self,
        checkpoint: str | os.PathLike[str],
        *args: str,
        env: Mapping[str, str] | None = None,
        cwd: str | os.PathLike[str] | None = None,
        command: list[str] | None = None,
    ) -> None:
        self.args = [str(a) for a in args]
        base = command or [str(VENV_BIN / "policyserver"), "serve"]
        self.argv = [*base, "--checkpoint", str(checkpoint), "--host", self.host, *self.args]
        if not any(a == "--port" or a.startswith("--port=") for a in self.args):
            self.argv += ["--port", "0"]
        frontend = os.environ.get(FRONTEND_ENV)
        if frontend and command is None and not any(a.startswith("--frontend") for a in self.args):
            self.argv += ["--frontend", frontend]
        self.env = subprocess_env(env)
        self.cwd = str(cwd) if cwd is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self._port: int | None = None
        self._log_dir: str | None = None
        self._log_path: Path | None = None
        self._final_log: str | None = None
        self._known: dict[int, int] = {}  # descendants seen so far: {pid: start time}
        self._lock = threading.Lock()

    # --- lifecycle ------------------------------------------------------------------
    def start(self, wait: WaitFor = "ready", timeout: float = START_TIMEOUT_S) -> PolicyServerProcess:
        """Spawn, then wait (bounded) for ``ready`` (/readyz 200), ``listening`` (/healthz 200) or ``started``."""
        self._log_dir = tempfile.mkdtemp(prefix="policyserver-")
        self._log_path = Path(self._log_dir, "server.log")
        with open(self._log_path, "wb") as log:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                cwd=self.cwd,
                start_new_session=True,
            )
        try:
            if wait in ("listening", "ready"):
                self.wait_listening(timeout)
            if wait == "ready":
                self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise
        self.descendants()
        return self

    def __enter__(self) -> PolicyServerProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.proc is not None, "server not started"
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def send_signal(self, sig: int = signal.SIGTERM) -> None:
        """Signal the main process (``serve``, or torchrun under cfgp/dp > 1) only."""
        self._remember_descendants()
        assert self.proc is not None
        self.proc.send_signal(sig)

    def wait_exit(self, timeout: float = STOP_TIMEOUT_S) -> int:
        """The exit status; raises TimeoutError (with the log tail) if it is still running after ``timeout``."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            raise TimeoutError(f"server still running after {timeout}s\n{self.log_tail()}") from None

    def stop(self, timeout: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the group and every descendant, SIGKILL what is left after ``timeout``; idempotent."""
        if self.proc is None:
            return None
        self._remember_descendants()
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)  # stragglers of our own group
        self._reap_descendants(timeout)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)
        if self._final_log is None and self._log_path is not None:
            self._final_log = self._read_log()
            with contextlib.suppress(OSError):
                self._log_path.unlink()
                os.rmdir(self._log_dir)  # type: ignore[arg-type]
        return self.proc.poll()

    def descendants(self) -> dict[int, int]:
        """Live descendants now ({pid: start time}: torchrun's ranks, ...); ``stop`` reaps every one ever seen."""
        found = descendants(self.proc.pid) if self.proc is not None and self.proc.poll() is None else {}
        with self._lock:
            self._known.update(found)
        return found

    def rank_pids(self) -> dict[int, int]:
        """{global rank: pid} of this server's ranks (the server itself when it has one rank)."""
        self.descendants()
        return rank_pids(self.pid)

    def _remember_descendants(self) -> None:
        self.descendants()

    def _reap_descendants(self, timeout: float) -> None:
        """Ranks live in sessions of their own: give them ``timeout`` to follow torchrun, then SIGKILL."""
        with self._lock:
            known = dict(self._known)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            alive = {p: s for p, s in known.items() if (st := proc_stat(p)) is not None and st[1] == s}
            if not alive:
                return
            for p, s in alive.items():
                _kill_if_same(p, s, signal.SIGTERM)
            time.sleep(0.1)
        for p, s in known.items():
            _kill_if_same(p, s, signal.SIGKILL)

    # --- log --------------------------------------------------------------------------
    def _read_log(self) -> str:
        if self._log_path is None:
            return ""
        try:
            return self._log_path.read_text(errors="replace")
        except OSError:
            return ""

    def log_text(self) -> str:
        """Everything the server wrote to stdout and stderr so far (kept after ``stop``)."""
        return self._final_log if self._final_log is not None else self._read_log()

    def log_tail(self, lines: int = 40) -> str:
        return "--- server log (tail) ---\n" + "\n".join(self.log_text().splitlines()[-lines:])

    def wait_for_log(self, pattern: str, timeout: float = START_TIMEOUT_S) -> re.Match[str]:
        rx = re.compile(pattern)

        return self._wait(lambda: rx.search(self.log_text()), timeout, f"log line {pattern!r}")

    # --- addresses and probes -----------------------------------------------------------
    @property
    def port(self) -> int:
        if self._port is None:
            self._port = int(self.wait_for_log(_LISTENING.pattern).group(2))
        return self._port

    @property
    def url(self) -> str:
        return f"ws://{self.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def get(self, path: str, headers: Mapping[str, str] | None = None, timeout: float = 10.0) -> HttpReply:
        return http_get(self.host, self.port, path, headers, timeout)

    def readyz(self) -> HttpReply:
        return self.get(READYZ_PATH)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return parse_metrics(self.get(METRICS_PATH).text)

    def metric(self, name: str, **labels: str) -> float | None:
        """One sample of /metrics (e.g. ``metric("policy_request_errors_total", kind="bad_frame")``), or None."""
        return self.metrics().get((name, tuple(sorted(labels.items()))))

    # --- bounded waits ------------------------------------------------------------------
    def _wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """net.wait_for, ending at once (ServerExited) when the process is gone instead of at the timeout."""
        dead = object()

        def check() -> Any:
            try:
                value = predicate()
            except Exception:
                if not self.alive:
                    return dead
                raise  # wait_for counts it as 'not yet' and keeps the last one for its timeout message
            if not value and not self.alive:
                return dead
            return value

        try:
            value = wait_for(check, timeout, interval=0.05, what=what)
        except TimeoutError as exc:
            raise TimeoutError(f"{exc}\n{self.log_tail()}") from None
        if value is dead:
            raise ServerExited(f"server exited with {self.returncode} while waiting for {what}\n{self.log_tail()}")
        return value

    def wait_listening(self, timeout: float = START_TIMEOUT_S) -> None:
        self.port  # noqa: B018 - waits for the listening line
        self._wait(lambda: self.get(HEALTHZ_PATH, timeout=2).status == 200, timeout, "/healthz 200")

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> HttpReply:
        return self._wait(lambda: (r := self.readyz()).status == 200 and r, timeout, "/readyz 200")

    def wait_until(self, predicate: Callable[[], Any], timeout: float = 30.0, what: str = "condition") -> Any:
        """Poll ``predicate`` (exceptions count as 'not yet') until truthy; fails fast if the server died."""
        return self._wait(predicate, timeout, what)


@contextlib.contextmanager
def serve_policy(
    checkpoint: str | os.PathLike[str],
    *args: str,
    wait: WaitFor = "ready",
    timeout: float = START_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> Iterator[PolicyServerProcess]:
    server = PolicyServerProcess(checkpoint, *args, env=env)
    server.start(wait=wait, timeout=timeout)
    try:
        yield server
    finally:
        server.stop()


# --- checkpoints ------------------------------------------------------------------------
_CHECKPOINTS: dict[tuple[str, str, int, str], Path] = {}
_CHECKPOINT_LOCK = threading.Lock()


def session_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, size: str = "tiny", seed: int = 0, **overrides: Any
) -> Path:
    """A reference-policy checkpoint made once per session per (size, seed, overrides); treat it as read-only."""
    from policy_operator.runtime.policy.reference import init_checkpoint

    base = tmp_path_factory.getbasetemp()
    key = (str(base), size, seed, json.dumps(overrides, sort_keys=True))
    with _CHECKPOINT_LOCK:
        if key not in _CHECKPOINTS:
            name = f"ckpt-{size}-{seed}-{len(_CHECKPOINTS)}"
            _CHECKPOINTS[key] = init_checkpoint(tmp_path_factory.mktemp(name, numbered=True), size, seed, **overrides)
        return _CHECKPOINTS[key]
