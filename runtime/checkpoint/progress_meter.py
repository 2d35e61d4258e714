"""Progress of a long download, visible in ``kubectl logs`` as well as on a terminal.

A Job's log is not a TTY, so a carriage-return bar would be one endless line
there: off a TTY we print a plain line every few seconds from a ticker thread
(so the log moves even while one socket read blocks); on a TTY we hand the
same numbers to tqdm.  Each plain line ends in the machine-readable tail of
``policy_operator/fetch_progress.py``; ``on_update`` hands the same numbers to
the fetch Job's progress endpoint (``progress_server.py``, which the operator
reads into ``status.checkpoint.progress``) and to a server downloading its own
checkpoint, for its metrics.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from policy_operator.fetch_progress import FetchProgress, human_bytes

__all__ = ["DEFAULT_INTERVAL_S", "Progress", "human_bytes"]

DEFAULT_INTERVAL_S = 2.0


class Progress:
    """Byte counter with a periodic reporter; ``advance`` is safe from any thread.

    ``poll`` is for downloads done by someone else (huggingface_hub): instead of
    being told about bytes, the reporter asks how many are on disk.
    """

    def __init__(
        self,
        total: int | None,
        *,
        label: str = "fetch",
        initial: int = 0,
        enabled: bool = True,
        stream: TextIO | None = None,
        interval: float = DEFAULT_INTERVAL_S,
        poll: Callable[[], int] | None = None,
        on_update: Callable[[FetchProgress], None] | None = None,
    ) -> None:
        self.total = total
        self.label = label
        self.initial = initial
        self.done = initial
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.interval = interval
        self.poll = poll
        self.on_update = on_update
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._bar = None
        self._started = time.monotonic()

    # --- counting ----------------------------------------------------------------
    def advance(self, n: int) -> None:
        with self._lock:
            self.done += n

    def _current(self) -> int:
        if self.poll is not None:
            try:
                self.done = max(self.done, int(self.poll()))
            except OSError:
                pass
        return self.done

    # --- reporting -----------------------------------------------------------------
    def snapshot(self) -> FetchProgress:
        """Bytes done, the total when known, and bytes per second over this run (resumed bytes excluded)."""
        done = self._current()
        elapsed = max(time.monotonic() - self._started, 1e-9)
        return FetchProgress(done, self.total or None, (done - self.initial) / elapsed)

    def line(self) -> str:
        return self.snapshot().line(self.label)

    def _tick(self) -> FetchProgress:
        snapshot = self.snapshot()
        if self.on_update is not None:
            self.on_update(snapshot)
        return snapshot

    def __enter__(self) -> Progress:
        self._started = time.monotonic()
        if not (self.enabled or self.on_update):
            return self
        if self.enabled and self.stream.isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total,
                initial=self.initial,
                unit="B",
                unit_scale=True,
                unit_divisor=1024,
                desc=self.label,
                file=self.stream,
                dynamic_ncols=True,
            )
        self._thread = threading.Thread(target=self._run, name="fetch-progress", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        shown = self.initial
        interval = 0.5 if self._bar is not None else self.interval
        while not self._stop.wait(interval):
            snapshot = self._tick()
            if self._bar is not None:
                self._bar.update(snapshot.done - shown)
                shown = snapshot.done
            elif self.enabled:
                print(snapshot.line(self.label), file=self.stream, flush=True)

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._tick()  # the last count, so a listener does not stop a few seconds short
        if self._bar is not None:
            self._bar.update(self._current() - self._bar.n)
            self._bar.close()

    def summary(self, files: int, path: object) -> str:
        elapsed = max(time.monotonic() - self._started, 1e-9)
        moved = self._current() - self.initial
        resumed = f", {human_bytes(self.initial)} already present" if self.initial else ""
        return (
            f"done, {files} files, {human_bytes(moved)} in {elapsed:.1f}s "
            f"({moved / elapsed / 1e6:.1f} MB/s{resumed}) -> {path}"
        )
