"""How a rank ends on SIGTERM: exit 0, promptly while loading, within the grace period plus a few seconds after.

A pod deleted while it starts, and a drain whose last request outlasts
``--drain-grace-s``, are normal events of a rollout: every rank exits 0, so
torchrun and ``serve`` exit 0 and Kubernetes records no ``Error``.

* **Signals go to one thread.** ``install`` blocks SIGTERM and SIGINT in the
  calling (main) thread before torch starts any other, so every thread
  inherits the mask and only ``Lifecycle``'s own thread receives them
  (``sigwait``).  A main thread blocked in C (a gloo or NCCL call, loading
  weights) cannot delay the answer, and a rank is never killed by the signal
  itself, whatever it is doing.
* **Loading: exit 0 at once.** Nothing is served yet, so there is nothing to
  drain; every rank got the signal (``serve`` passes it to each).
* **Serving: drain, bounded.** The first signal starts the drain
  (``on_stop``, rank 0's session drain) and arms a last-resort exit at
  ``grace + heartbeat + EXIT_MARGIN_S``.  From then on a peer that vanishes
  mid-collective or a silent rank 0 is the shutdown, not a fault: ``stopping``
  tells the rank's exit path to report 0 instead of ``REPLICA_FAILED`` or
  ``WATCHDOG``.
* **Stopping together.** When the grace period ends with requests still
  running, rank 0 fails them (``drain_timeout``), writes ``STOP_KEY`` to the
  heartbeat store and exits; every other rank polls that key with its
  watchdog and exits 0 within a heartbeat period, even from inside a
  collective that would otherwise wait for ``--pg-timeout-s``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, NoReturn, Protocol

from policy_operator.exit_codes import ServeExit, note_rank_exit

if TYPE_CHECKING:
    from policy_operator.runtime.engine.core import Engine

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)
STOP_KEY = "policy-operator/stop"  # in the heartbeat store: rank 0 wrote it, every rank exits 0 now
EXIT_MARGIN_S = 5.0  # after grace + one heartbeat, a rank still running exits 0 whatever it is blocked in
STOP_POLL_S = 0.25  # how often the other ranks look for STOP_KEY (at most)


class KV(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...


def exit_now(code: int) -> NoReturn:
    """Leave the process at once with ``code`` (threads stuck in a batch or a collective included); under
    ``serve``'s torchrun the code is noted first, so ``serve`` exits with the first failed rank's code."""
    note_rank_exit(code)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


def announce_stop(kv: KV) -> None:
    """Rank 0: tell every rank to exit 0 now (their watchdogs read it within a heartbeat period)."""
    try:
        kv.set(STOP_KEY, b"1")
    except Exception as exc:  # noqa: BLE001 - the store is gone: the agent is going down, and the ranks with it
        log.warning("could not announce the stop to the other ranks: %s", exc)


def stop_announced(kv: KV) -> bool:
    try:
        return kv.get(STOP_KEY) is not None
    except Exception:  # noqa: BLE001 - unreadable for now; the watchdog's silence bound covers a store gone for good
        return False


class Lifecycle:
    """One per rank process: what SIGTERM/SIGINT do at each stage (module docstring)."""

    def __init__(self, rank: int, grace_s: float, heartbeat_s: float) -> None:
        self.rank = rank
        self.grace_s = grace_s
        self.heartbeat_s = heartbeat_s
        self.stopping = threading.Event()
        self._on_stop: Callable[[], object] | None = None  # set by serving(): None while loading
        self._lock = threading.Lock()

    def install(self) -> Lifecycle:
        """Route SIGTERM/SIGINT to this object's thread; call first, before torch starts threads of its own."""
        signal.pthread_sigmask(signal.SIG_BLOCK, SIGNALS)
        for sig in SIGNALS:  # a thread started before the mask (none expected) hands it over the same way
            signal.signal(sig, lambda signum, frame: self.received(signum))
        threading.Thread(target=self._wait, name="signals", daemon=True).start()
        return self

    def _wait(self) -> None:
        while True:
            self.received(signal.sigwait(SIGNALS))

    def serving(self, on_stop: Callable[[], object]) -> None:
        """Loaded: a signal now starts the drain, by calling ``on_stop`` (from the signal thread)."""
        with self._lock:
            self._on_stop = on_stop
        if self.stopping.is_set():  # signalled in between: the drain starts now
            on_stop()

    def received(self, signum: int) -> None:
        name = signal.Signals(signum).name
        with self._lock:
            on_stop = self._on_stop
            first = not self.stopping.is_set()
            self.stopping.set()
        if on_stop is None:
            log.info("rank %d: %s while loading: nothing to drain, exiting 0", self.rank, name)
            exit_now(ServeExit.OK)
        if not first:
            log.info("rank %d: %s again; already stopping", self.rank, name)
            return
        limit = self.grace_s + self.heartbeat_s + EXIT_MARGIN_S
        log.info("rank %d: %s: stopping (exit 0 at the latest %.0fs from now)", self.rank, name, limit)
        timer = threading.Timer(limit, self._overdue, args=(limit,))
        timer.daemon = True
        timer.start()
        assert on_stop is not None
        on_stop()

    def _overdue(self, limit: float) -> None:
        log.warning("rank %d: still running %.0fs after the signal; exiting 0", self.rank, limit)
        exit_now(ServeExit.OK)

    def exit_code(self, code: int, why: str) -> int:
        """``code``, unless this rank is stopping: then a failure caused by the shutdown itself is no failure."""
        if code != ServeExit.OK and self.stopping.is_set():
            log.info("rank %d: %s during the shutdown; exiting 0 instead of %d", self.rank, why, code)
            return ServeExit.OK
        return code


async def stop_ranks(ingress: Engine, *, drained: bool, kv: KV) -> None:
    """After the sessions' drain: drained, ``Shutdown`` down every lane; either way ``STOP_KEY`` for every rank."""
    if drained:
        await asyncio.get_running_loop().run_in_executor(None, ingress.stop_lanes)
    announce_stop(kv)
    if not drained:
        await asyncio.sleep(2 * STOP_POLL_S)  # the others leave first: none sees rank 0 vanish mid-collective
