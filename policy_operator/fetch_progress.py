"""Download progress as one line: printed by ``policyserver fetch``, read back by the operator.

The fetch Job logs its progress every few seconds for people running
``kubectl logs``.  The operator needs the same numbers for
``status.checkpoint.progress`` (and the PROGRESS column of ``kubectl get
ps``); the fetch pod has no API access (no token is mounted), so its container
serves the newest line at ``GET /progress`` (``runtime/checkpoint/progress_server.py``)
and the operator reads it there, never the pod's log (no ``pods/log`` grant).
Every line ends in a fixed machine-readable tail::

    fetch: 1.2 GiB / 3.4 GiB (35.0%) 12.3 MB/s [progress 1288490188/3650722201 12300000]

Both sides use this module, so the format is written once.  torch-free: the
operator image imports it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

_TAIL = re.compile(r"\[progress (\d+)/(\d+|\?) (\d+)\]\s*$")
MAX_BYTES = 4096  # the most the operator reads of one /progress answer: one line


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"  # pragma: no cover - the loop always returns


@dataclass(frozen=True)
class FetchProgress:
    """Bytes done of a download, its size when known, and its rate over the current attempt."""

    done: int
    total: int | None
    rate: float  # bytes per second

    @property
    def percent(self) -> float | None:
        return 100.0 * self.done / self.total if self.total else None

    @property
    def text(self) -> str:
        """``1.2 GiB / 3.4 GiB (35.0%) 12.3 MB/s``: what people read, in the log and in ``kubectl get ps``."""
        rate = f"{self.rate / 1e6:.1f} MB/s"
        if self.total:
            return f"{human_bytes(self.done)} / {human_bytes(self.total)} ({self.percent:.1f}%) {rate}"
        return f"{human_bytes(self.done)} {rate}"

    def line(self, label: str = "fetch") -> str:
        """The log line: human text, then the tail the operator parses."""
        total = "?" if self.total is None else str(self.total)
        return f"{label}: {self.text} [progress {self.done}/{total} {round(self.rate)}]"

    def as_status(self) -> dict[str, Any]:
        """``status.checkpoint.progress``."""
        status: dict[str, Any] = {"bytesDone": self.done, "bytesPerSecond": round(self.rate), "text": self.text}
        if self.total is not None:
            status["bytesTotal"] = self.total
        return status


def parse_line(line: str) -> FetchProgress | None:
    match = _TAIL.search(line)
    if match is None:
        return None
    done, total, rate = match.groups()
    return FetchProgress(int(done), None if total == "?" else int(total), float(rate))


def last_progress(log: str) -> FetchProgress | None:
    """The newest progress line of a log excerpt, or None when it has none (yet)."""
    for line in reversed(log.splitlines()):
        progress = parse_line(line)
        if progress is not None:
            return progress
    return None
