"""Containers as host processes for the local node: path mapping, environment, process trees.

A process cannot mount a volume at ``/models``, so the local node maps each
volumeMount's path to a host directory and rewrites the container's
``command``/``args``/``env`` values and ``workingDir`` that *start with* a
mount path (``/models/abc`` -> ``<node>/pvc/ns/claim/abc``), including the
value part of ``--flag=/models/abc`` and ``KEY=/models/abc``.  Paths buried
inside a string (``sh -c 'cat /models/x'``) are not rewritten: keep paths
in their own arguments.  See docs/e2e.md, "Local node".

A container is every process started from its entrypoint, whatever session
or parent it ends up in (torchrun puts its ranks in sessions of their own, and
orphans are re-parented to init), so each container's processes carry an
environment tag (``LOCAL_NODE_CONTAINER=<node>/<pod uid>/<container>#<n>``)
read back from ``/proc/PID/environ``: the local node's stand-in for a cgroup.
When the entrypoint exits, whatever still carries its tag is SIGKILLed, as a
container runtime tears down a container's cgroup.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_operator.constants import ENV_LOCAL_NODE_CONTAINER

from .servers import proc_stat

EXIT_START_ERROR = 128  # what containerd reports for an entrypoint that could not be exec'd
TERMINATION_MESSAGE_LINES = 80  # the kubelet's FallbackToLogsOnError: last 80 lines, at most 2048 bytes
TERMINATION_MESSAGE_BYTES = 2048
_VAR_REF = re.compile(r"\$\$|\$\(([-._a-zA-Z][-._a-zA-Z0-9]*)\)")


class ContainerConfigError(ValueError):
    """A container that cannot be created as specified (the kubelet's CreateContainerConfigError)."""


# --- paths --------------------------------------------------------------------------------


@dataclass(frozen=True)
class PathMap:
    """Container mount paths -> host directories; the longest mount path wins, as with nested mounts."""

    mounts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, mounts: Mapping[str, str | os.PathLike[str]]) -> PathMap:
        items = [(_norm(c), str(h)) for c, h in mounts.items()]
        return cls(tuple(sorted(items, key=lambda m: len(m[0]), reverse=True)))

    def host(self, value: str) -> str:
        """``value`` with a leading mount path replaced (also after ``--flag=`` or ``KEY=``)."""
        mapped = self._path(value)
        if mapped is not None:
            return mapped
        head, eq, tail = value.partition("=")
        if eq and tail.startswith("/") and "/" not in head:
            mapped = self._path(tail)
            if mapped is not None:
                return f"{head}={mapped}"
        return value

    def _path(self, value: str) -> str | None:
        for container, host in self.mounts:
            if value == container or value.startswith(container.rstrip("/") + "/"):
                return host + value[len(container.rstrip("/")) :]
        return None

    def container(self, value: str) -> str:
        """The inverse, for messages: a host path shown as the container sees it."""
        for container, host in sorted(self.mounts, key=lambda m: len(m[1]), reverse=True):
            if value == host or value.startswith(host + "/"):
                return container.rstrip("/") + value[len(host) :]
        return value


def _norm(path: str) -> str:
    if not path.startswith("/"):
        raise ContainerConfigError(f"mountPath {path!r} must be absolute")
    return "/" + path.strip("/") if path != "/" else "/"


# --- environment --------------------------------------------------------------------------


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion: defined names are replaced, ``$$`` escapes, the rest stays."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))

    return _VAR_REF.sub(sub, value)


def argv_of(container: Mapping[str, Any], env: Mapping[str, str], paths: PathMap) -> list[str]:
    """command + args, expanded and path-mapped; the image's entrypoint is not known here."""
    command = list(container.get("command") or [])
    args = list(container.get("args") or [])
    if not command:
        raise ContainerConfigError(
            f"container {container.get('name')!r} has no command: the local node runs no "
            f"images, so it cannot use image {container.get('image')!r}'s entrypoint"
        )
    return [paths.host(expand(str(a), env)) for a in command + args]


# --- processes ----------------------------------------------------------------------------


@dataclass(frozen=True)
class ProcInfo:
    """One live process of a container."""

    pid: int
    ppid: int
    start: int  # /proc start time: tells a reused pid apart
    argv: tuple[str, ...]
    env: Mapping[str, str]
    tag: str


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, eq, value = item.partition(b"=")
        if eq:
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def tagged_processes(prefix: str) -> list[ProcInfo]:
    """Every live process whose container tag starts with ``prefix`` (a node, pod or container)."""
    found = []
    needle = f"{ENV_LOCAL_NODE_CONTAINER}={prefix}".encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        pid = int(entry)
        try:
            raw = Path(f"/proc/{pid}/environ").read_bytes()
        except OSError:
            continue
        if needle not in raw:
            continue
        env = _environ(pid) or {}
        tag = env.get(ENV_LOCAL_NODE_CONTAINER, "")
        stat = proc_stat(pid)
        if not tag.startswith(prefix) or stat is None:
            continue
        try:
            argv = tuple(
                a.decode(errors="replace") for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0") if a
            )
        except OSError:
            continue
        if not argv:  # a zombie: exited, waiting for its parent to reap it
            continue
        found.append(ProcInfo(pid, stat[0], stat[1], argv, env, tag))
    return sorted(found, key=lambda p: p.pid)


def signal_processes(procs: Iterable[ProcInfo], sig: int) -> None:
    for p in procs:
        stat = proc_stat(p.pid)
        if stat is not None and stat[1] == p.start:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(p.pid, sig)


def kill_tagged(prefix: str, timeout: float = 10.0) -> list[ProcInfo]:
    """SIGKILL every process of ``prefix`` until none is left (bounded); returns what was still there."""
    deadline = time.monotonic() + timeout
    left = tagged_processes(prefix)
    while left and time.monotonic() < deadline:
        signal_processes(left, signal.SIGKILL)
        time.sleep(0.05)
        left = tagged_processes(prefix)
    return left


def rfc3339(t: float) -> str:
    """A Kubernetes timestamp (seconds), as the kubelet writes container states."""
    return datetime.datetime.fromtimestamp(t, datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def exit_code(returncode: int) -> int:
    """Popen's -N for a signal is the container runtime's 128+N."""
    return 128 - returncode if returncode < 0 else returncode


class ContainerProcess:
    """One run of a container's entrypoint: a process in its own session, logs timestamped like CRI logs."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], cwd: str, log_path: Path, tag: str) -> None:
        self.argv = list(argv)
        self.env = {**env, ENV_LOCAL_NODE_CONTAINER: tag}
        self.cwd = cwd
        self.log_path = log_path
        self.tag = tag
        self.proc: subprocess.Popen[bytes] | None = None
        self.start_error: str | None = None
        self.started_at = time.time()
        self.finished_at: float | None = None
        self._reader: threading.Thread | None = None
        self._log_lock = threading.Lock()

    def start(self) -> ContainerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        exe = shutil.which(self.argv[0], path=self.env.get("PATH")) if "/" not in self.argv[0] else self.argv[0]
        try:
            if exe is None:
                raise FileNotFoundError(f'exec: "{self.argv[0]}": executable file not found in $PATH')
            self.proc = subprocess.Popen(
                [exe, *self.argv[1:]],
                env=self.env,
                cwd=self.cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self.start_error = f"failed to start container process: {exc.strerror or exc}"
            self.finished_at = time.time()
            self._write_line(self.start_error)
            return self
        self.started_at = time.time()
        self._reader = threading.Thread(target=self._read, name=f"log:{self.tag}", daemon=True)
        self._reader.start()
        return self

    def _write_line(self, line: str) -> None:
        stamp = datetime.datetime.now(datetime.UTC).isoformat(timespec="microseconds").replace("+00:00", "Z")
        with self._log_lock, open(self.log_path, "a", encoding="utf-8") as log:
            log.write(f"{stamp} {line}\n")

    def _read(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for raw in iter(self.proc.stdout.readline, b""):
            self._write_line(raw.decode("utf-8", "replace").rstrip("\n"))
        self.proc.stdout.close()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def poll(self) -> int | None:
        """The exit code once the entrypoint has exited (leftover processes are killed then), else None."""
        if self.start_error is not None:
            return EXIT_START_ERROR
        assert self.proc is not None
        code = self.proc.poll()
        if code is None:
            return None
        if self.finished_at is None:
            self.finished_at = time.time()
            kill_tagged(self.tag)  # the container's PID 1 is gone: so is everything in it
            if self._reader is not None:
                self._reader.join(timeout=5)
        return exit_code(code)

    def processes(self) -> list[ProcInfo]:
        return tagged_processes(self.tag)

    def signal(self, sig: int) -> None:
        """Signal the entrypoint only, as a container runtime signals PID 1."""
        if self.proc is not None and self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def stop(self, grace_s: float) -> int:
        """SIGTERM the entrypoint, SIGKILL everything of the container after ``grace_s``; the exit code."""
        if self.poll() is None:
            self.signal(signal.SIGTERM)
            assert self.proc is not None
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(max(0.0, grace_s))
            if self.proc.poll() is None:
                kill_tagged(self.tag)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self.proc.wait(10)
        code = self.poll()
        return code if code is not None else exit_code(-signal.SIGKILL)

    def log_lines(self) -> list[str]:
        """The log without timestamps."""
        try:
            text = self.log_path.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return []
        return [line.split(" ", 1)[1] if " " in line else "" for line in text.splitlines()]

    def termination_message(self) -> str:
        tail = "\n".join(self.log_lines()[-TERMINATION_MESSAGE_LINES:])
        return tail.encode()[-TERMINATION_MESSAGE_BYTES:].decode("utf-8", "ignore")
