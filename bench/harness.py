"""One way for every benchmark to run a server: the command line from serve_flags, /readyz, the process group.

``serve(checkpoint, **options)`` starts ``policyserver serve`` as its own
process group on a free port (or the one given), its flags written by
``policy_operator/serve_flags.py``'s ``argv_of`` from ServeOptions field names
(``max_batch=32`` is ``--max-batch 32``; ``flags=[...]`` adds raw words), waits
until ``/readyz`` says ready, and stops the whole group (torchrun and its ranks,
a front-end process) when the ``with`` block ends: SIGTERM, SIGKILL after a
minute.  ``env`` adds environment words (``PYTHONPATH=...`` serves another
tree, laid out by ``import_root``).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_operator.serve_flags import argv_of


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(
    proc: subprocess.Popen[bytes], port: int, exited: Callable[[], str], timeout_s: float = 600, poll_s: float = 0.2
) -> None:
    """Until ``policyserver serve`` on ``port`` says ready on /readyz; ``exited()``: its last words, should the
    process end first."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {exited()[-2000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:  # noqa: S310 - loopback
                if json.loads(r.read())["ready"]:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(poll_s)
    raise TimeoutError("server not ready")


def stop_group(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM to the process's group (it was started with ``start_new_session``), SIGKILL after a minute."""
    try:
        os.killpg(proc.pid, signal.SIGTERM)
    except ProcessLookupError:  # it exited and took its group with it: nothing to stop (and its error stands)
        proc.wait()
        return
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def import_root(tree: Path, work: Path) -> Path:
    """A folder under ``work`` where ``policy_operator`` is ``tree``'s (a git archive of another commit), laid out
    as the import names as ``make lint`` lays them out: put it first on PYTHONPATH to serve that tree."""
    # named by the tree's path, the same in every process (``hash`` of a str is salted per process)
    root = work / f"import-root-{hashlib.sha256(str(tree.resolve()).encode()).hexdigest()[:16]}"
    if not root.exists():
        package = root / "policy_operator"
        shutil.copytree(tree / "policy_operator", package, symlinks=True)
        (package / "runtime").symlink_to(tree.resolve() / "runtime")
        (package / "operator").symlink_to(tree.resolve() / "operator")
    return root


@dataclass
class Served:
    proc: subprocess.Popen[bytes]
    port: int
    log: Path | None

    @property
    def url(self) -> str:
        return f"ws://127.0.0.1:{self.port}"

    def log_text(self) -> str:
        return self.log.read_text() if self.log is not None and self.log.exists() else ""


@contextmanager
def serve(
    checkpoint: str | os.PathLike[str],
    *,
    port: int | None = None,
    env: Mapping[str, str] | None = None,
    log: Path | None = None,
    flags: list[str] | None = None,
    ready_timeout_s: float = 600,
    poll_s: float = 0.2,
    **options: Any,
) -> Iterator[Served]:
    """``policyserver serve --checkpoint CHECKPOINT --host 127.0.0.1 --port PORT`` plus ``options`` (ServeOptions
    field names) and ``flags``, ready; its group stopped on exit.  ``log``: its stdout and stderr go there
    (else nowhere)."""
    port = free_port() if port is None else port
    argv = [
        sys.executable,
        "-P",  # the working directory (often the repository root, whose ./operator/ is not the stdlib's) off sys.path
        "-m",
        "policy_operator.cli",
        "serve",
        *argv_of({"checkpoint": os.fspath(checkpoint), "host": "127.0.0.1", "port": port, **options}),
        *(flags or []),
    ]
    out: Any = log.open("wb") if log is not None else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}, start_new_session=True
        )
    finally:
        if log is not None:
            out.close()  # the server writes its own copy
    served = Served(proc, port, log)
    try:
        wait_ready(proc, port, served.log_text, ready_timeout_s, poll_s)
        yield served
    finally:
        stop_group(proc)
