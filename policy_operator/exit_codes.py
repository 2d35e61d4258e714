"""Exit codes of the ``policyserver`` commands the operator runs in pods, and what it does with each.

A container's exit code is the one thing the operator learns about a failed
pod without reading its logs, so each code means one thing and is written
here once: the commands return these members, ``policyserver fetch --help``
lists them, the fetch Job's ``podFailurePolicy`` fails at once on
``FETCH_FATAL``, and the operator maps each ``FetchExit`` to the reason of its
``CheckpointReady`` condition (``operator/download_state.py``).

Under torchrun (cfgp x dp > 1) torchrun itself exits 1 whichever rank failed
and why, so each rank notes its non-zero code (``note_rank_exit``) in the
directory ``serve`` names in ``ENV_RANK_EXIT_DIR``, and ``serve`` exits with
the code of the rank that failed first (``first_rank_exit``): the front-end
process killed under cfgp=2 is 6 there as on one rank, not 1.
"""

from __future__ import annotations

import os
import time
from enum import IntEnum
from pathlib import Path
from typing import Final


class _ExitCode(IntEnum):
    """An exit code with a few words of meaning, for ``--help`` texts and docs."""

    meaning: str

    def __new__(cls, value: int, meaning: str) -> _ExitCode:
        member = int.__new__(cls, value)
        member._value_ = value
        member.meaning = meaning
        return member


class FetchExit(_ExitCode):
    """``policyserver fetch`` (the fetch Job)."""

    OK = 0, "ok"
    ERROR = 1, "other"  # a bug, a permission problem on the volume: retried by the Job
    USAGE = 2, "usage"  # bad source, unknown scheme, bad --sha256: the same answer every time
    SOURCE = 3, "source unreachable or auth"  # retried: a network or a registry comes back
    VERIFY = 4, "verification failed"  # a retry downloads the same bytes
    DISK_FULL = 5, "disk full"  # nothing a retry changes
    NOT_FOUND = 6, "repository or revision not found"  # the hub said so (or hides it from this token): no retry
    INTERRUPTED = 130, "interrupted (the next run resumes)"


class ServeExit(_ExitCode):
    """``policyserver serve`` and each torchrun rank of it (the server container)."""

    OK = 0, "ok (drained after SIGTERM)"
    LAYOUT = 2, "layout, guidance, steps or token file refused before anything started"
    LOAD = 3, "the checkpoint or policy did not load"  # the pod restarts, with the reason in its log
    WATCHDOG = 4, "a rank gave up on rank 0 or on its launcher"
    REPLICA_FAILED = 5, "a collective of a replica failed or timed out; its communicator is never reused"
    FRONTEND = 6, "the front-end process (--frontend process) exited while rank 0 served"


class CheckpointExit(_ExitCode):
    """``policyserver checkpoint verify`` (the server pod's init container)."""

    OK = 0, "verified"
    INVALID = 1, "missing, incomplete or changed since fetched"  # the pod does not start


class ProbeExit(_ExitCode):
    """``policyserver probe`` (the chart's ``helm test`` hook: Helm reads the Pod's exit status)."""

    OK = 0, "ok (finite actions of the advertised shape)"
    FAILED = 1, "failed (unreachable, refused, not ready in time or a wrong answer)"
    USAGE = 2, "usage"


def describe(codes: type[_ExitCode]) -> str:
    """``0 ok, 1 other, ...``: the exit codes of one command, for its ``--help``."""
    return ", ".join(f"{int(code)} {code.meaning}" for code in codes)


# The fetch Job fails at once on these (podFailurePolicy FailJob) instead of burning its backoffLimit.
FETCH_FATAL: Final = (FetchExit.USAGE, FetchExit.VERIFY, FetchExit.DISK_FULL, FetchExit.NOT_FOUND)


# serve sets it for torchrun's ranks: the directory where each rank notes the code it exits with
ENV_RANK_EXIT_DIR: Final = "POLICY_RANK_EXIT_DIR"


def note_rank_exit(code: int) -> None:
    """A rank about to exit ``code``: under ``serve``'s torchrun, note it and when (the host's monotonic clock,
    the same in every rank) where ``serve`` reads it.  Nothing for 0 or outside torchrun."""
    directory, rank = os.environ.get(ENV_RANK_EXIT_DIR), os.environ.get("RANK")
    if not directory or rank is None or int(code) == 0:
        return
    try:
        Path(directory, f"rank{int(rank)}").write_text(f"{time.monotonic_ns()} {int(code)}\n")
    except (OSError, ValueError):  # a note lost costs only the precise code: torchrun's 1 stands
        pass


def first_rank_exit(directory: str | os.PathLike[str]) -> tuple[int, int] | None:
    """(rank, code) of the rank that noted a non-zero exit first, or None when none did."""
    noted: list[tuple[int, int, int]] = []
    for path in Path(directory).glob("rank*"):
        try:
            at, noted_code = path.read_text().split()
            noted.append((int(at), int(path.name.removeprefix("rank")), int(noted_code)))
        except (OSError, ValueError):
            continue
    if not noted:
        return None
    _, rank, code = min(noted)
    return rank, code
