"""Serve a policy over the openpi WebSocket protocol, on 1 rank or under torchrun.

``--cfgp C --dp D`` with C*D > 1 runs ``torchrun --standalone
--nproc-per-node=C*D -m policy_operator.runtime.worker`` with the same flags
as a child process; a single-rank layout runs in this process.  The layout is
checked before anything starts.

Why a child and not ``exec``: in a pod this process is the container's
entrypoint, the one process the kubelet signals.  torchrun answers SIGTERM by
raising its own ``SignalException`` and exits 1 however cleanly its ranks
drained, so Kubernetes would record every rollout as an ``Error``
termination.  Instead this process forwards SIGTERM (and SIGINT) to the
*ranks* themselves: each drains and exits 0, torchrun sees every worker
succeed and exits 0, and so does ``serve``.  Any rank that fails still makes
torchrun, and therefore ``serve``, exit non-zero.  A signal that arrives
before torchrun has started its ranks goes to torchrun itself (nothing to
drain yet), whose exit code is passed on as is.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from policy_operator import serve_flags
from policy_operator.exit_codes import ENV_RANK_EXIT_DIR, ServeExit, first_rank_exit

FORWARDED = (signal.SIGTERM, signal.SIGINT)
_SIGTERM_BIT = 1 << (signal.SIGTERM - 1)  # in /proc/PID/status signal masks
_PR_SET_PDEATHSIG = 1
SAFE_PATH_ENV = "PYTHONSAFEPATH"  # python -P for every interpreter started with it: no cwd on sys.path
POLL_S = 0.2  # how often the launcher looks at torchrun and at signals to pass on


def add_arguments(parser: argparse.ArgumentParser) -> None:
    serve_flags.add_arguments(parser)


def children(pid: int) -> list[int]:
    """PIDs whose parent is ``pid``, read from ``/proc`` (torchrun starts its ranks in sessions of their own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after the last ')'
        if int(stat.rpartition(")")[2].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def takes_sigterm(pid: int) -> bool:
    """Whether a rank handles SIGTERM yet: its main thread blocks it (for its signal thread, runtime/lifecycle.py) or
    catches it.  Before that, SIGTERM's default action would kill it -- by signal 15, a failure for torchrun."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    masks = (int(line.split(":", 1)[1], 16) for line in status.splitlines() if line.startswith(("SigBlk:", "SigCgt:")))
    return any(mask & _SIGTERM_BIT for mask in masks)


def _launcher_setup() -> None:
    """In torchrun, before exec: a process group of its own, and SIGTERM when ``serve`` dies (even by SIGKILL)."""
    os.setpgid(0, 0)
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)


def run_torchrun(argv: list[str], extra_env: dict[str, str] | None = None) -> int:
    """Run torchrun as a child, forward SIGTERM/SIGINT to its ranks, return its exit code (0: every rank exited 0).

    torchrun gets a process group of its own, so a terminal's Ctrl-C reaches
    only this process, which forwards it as the kubelet's SIGTERM would be.
    """
    # torchrun starts each rank as ``python -u -m ...``, which would put the working directory first on sys.path
    # (a struct.py there would replace the standard library's); PYTHONSAFEPATH leaves it off, in every rank.
    env = {**os.environ, SAFE_PATH_ENV: "1", **(extra_env or {})}
    child = subprocess.Popen(argv, preexec_fn=_launcher_setup, env=env)  # noqa: PLW1509 - setpgid + prctl, no locks
    received: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        received.append(signum)

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    handled = 0  # signals received and passed on
    signalled: set[int] = set()  # ranks that got SIGTERM
    try:
        while True:
            # never an unbounded wait(): waitpid is retried after a signal (PEP 475), so poll instead
            try:
                code = child.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                pass
            if len(received) > handled:
                handled = _forward(child.pid, len(received), handled, signalled)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return code if code >= 0 else 128 - code  # killed by signal N: 128+N, as a shell reports it


def _forward(torchrun: int, received: int, handled: int, signalled: set[int]) -> int:
    """SIGTERM every rank of ``torchrun`` that handles it yet; how many signals are now handled.

    Before torchrun has started its ranks there is nobody to drain: the signal
    stays pending (looked at again every ``POLL_S``) until the ranks exist,
    unless a second one came (a second Ctrl-C), which goes to torchrun itself.
    A rank still starting its interpreter gets it a poll later, once it takes
    it (``takes_sigterm``): killed by the signal itself, it would make torchrun
    report a failure.
    """
    ranks = children(torchrun)
    for pid in ranks:
        if pid not in signalled and takes_sigterm(pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            signalled.add(pid)
    if ranks and signalled.issuperset(ranks):
        return received
    if received - handled > 1:
        with contextlib.suppress(ProcessLookupError):
            os.kill(torchrun, signal.SIGTERM)
        return received
    return handled


def main(args: argparse.Namespace) -> int:
    from policy_operator.runtime.worker import preflight  # torch-free

    opts = serve_flags.ServeOptions.from_args(args)
    try:
        layout = preflight(opts)  # here too, or every torchrun rank would print it and torchrun a traceback
    except ValueError as exc:  # LayoutError is one
        print(f"policyserver: error: {exc}", file=sys.stderr)
        return ServeExit.LAYOUT
    if layout.world_size == 1 and "WORLD_SIZE" not in os.environ:
        from policy_operator.runtime.worker import run

        return run(opts)
    cmd = serve_flags.torchrun_argv(layout.world_size, serve_flags.to_argv(opts))
    exe = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    sys.stdout.flush()
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="policyserver-exits-") as exits:
        code = run_torchrun([exe, *cmd[1:]], {ENV_RANK_EXIT_DIR: exits})
        first = first_rank_exit(exits) if code != ServeExit.OK else None
    took = f"after {time.monotonic() - started:.0f}s"
    if first is None:
        print(f"policyserver: torchrun exited {code} {took}", file=sys.stderr, flush=True)
        return code
    # torchrun exits 1 whichever rank failed: the pod's exit code is the first failed rank's, as on one rank
    rank, rank_code = first
    meaning = next((c.meaning for c in ServeExit if c == rank_code), "?")
    print(
        f"policyserver: torchrun exited {code} {took}; rank {rank} failed first, exiting {rank_code} ({meaning})",
        file=sys.stderr,
        flush=True,
    )
    return rank_code
