"""Per-rank heartbeats: the source of truth for ``/readyz``.

Every rank publishes ``{state, ts, detail}`` every heartbeat period from its
own thread; the ingress reads all of them.  A rank is ready when its state is
warm or serving and its last beat is younger than ``stale_after`` (1.5
periods), so a dead or frozen rank flips ``/readyz`` to 503 within two
periods.  Under torchrun the board lives in the c10d TCPStore hosted by the
torchrun agent, so it survives any one rank; single-process serving keeps it
in memory.

The ingress never reads the store itself: a ``BoardWatcher`` thread copies the
beats every quarter period (at most 0.25 s) and ``/readyz``, the router and the WebSocket
handshake read that copy.  A frozen agent (the store host) then makes the
copy age -- every rank reads as stale -- instead of blocking the event loop
for the store client's timeout.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Protocol

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import RankReadiness, RankState

log = logging.getLogger(__name__)

KEY_PREFIX = "policy-operator/heartbeat/"


class KV(Protocol):
    def set(self, key: str, value: bytes) -> None: ...
    def get(self, key: str) -> bytes | None: ...


class MemoryKV:
    def __init__(self) -> None:
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value: bytes) -> None:
        with self._lock:
            self._data[key] = value

    def get(self, key: str) -> bytes | None:
        with self._lock:
            return self._data.get(key)


class StoreKV:
    """A c10d TCPStore client of its own (one per thread that uses it)."""

    def __init__(self, host: str, port: int, timeout_s: float = 30.0) -> None:
        import torch.distributed as dist

        self._store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout_s))

    @classmethod
    def from_env(cls) -> StoreKV:
        return cls(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]))

    def set(self, key: str, value: bytes) -> None:
        self._store.set(key, value)  # type: ignore[arg-type]  # the binding takes bytes; torch's stub says str

    def get(self, key: str) -> bytes | None:
        # check() never blocks, unlike get() on a key that is not there yet
        return self._store.get(key) if self._store.check([key]) else None


class Heartbeat:
    """Publishes this rank's state every period until stopped."""

    def __init__(self, kv_factory: Callable[[], KV], rank: int, period_s: float) -> None:
        self._kv_factory = kv_factory
        self.rank = rank
        self.period_s = period_s
        self._state = RankState.LOADING
        self._detail = ""
        self._stop = threading.Event()
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"heartbeat-{rank}", daemon=True)

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def set_state(self, state: RankState, detail: str = "") -> None:
        """Publish at once, except warm <-> serving: both are ready, and every request flips between them.

        Publishing those at once would wake this thread twice per request, mid-inference, for a JSON
        dump and a TCPStore write that contend for the GIL with the thread launching the model's
        kernels; the next periodic beat shows them instead.
        """
        routine = {state, self._state} <= {RankState.WARM, RankState.SERVING}
        if state != self._state and not routine:
            log.info("rank %d: %s -> %s %s", self.rank, self._state.value, state.value, detail)
        self._state, self._detail = state, detail
        if not routine:
            self._wake.set()

    @property
    def state(self) -> RankState:
        return self._state

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=5)

    def _run(self) -> None:
        kv = self._kv_factory()
        while not self._stop.is_set():
            value = json.dumps({"state": self._state.value, "ts": time.time(), "detail": self._detail})
            try:
                kv.set(f"{KEY_PREFIX}{self.rank}", value.encode())
            except Exception:  # noqa: BLE001 - the store is gone: the launcher is going down
                log.warning("rank %d: heartbeat store unreachable", self.rank)
            self._wake.wait(self.period_s)
            self._wake.clear()


class Board:
    """Reads every rank's heartbeat for ``/readyz`` and the watchdog."""

    def __init__(self, kv: KV, layout: ParallelLayout, period_s: float, stale_factor: float = 1.5) -> None:
        self._kv = kv
        self.layout = layout
        self.stale_after = period_s * stale_factor

    def beat(self, rank: int) -> dict | None:
        """The rank's last published beat as stored, or None before its first."""
        raw = self._kv.get(f"{KEY_PREFIX}{rank}")
        return None if raw is None else json.loads(raw)

    def row(self, rank: int, beat: dict | None, now: float, missing: str = "no heartbeat yet") -> RankReadiness:
        """The ``/readyz`` row of ``rank`` given its last beat (None: ``missing`` says why there is none)."""
        dp_index, cfg_index = self.layout.coords(rank)
        if beat is None:
            return RankReadiness(
                rank=rank,
                dp_index=dp_index,
                cfg_index=cfg_index,
                state=RankState.UNKNOWN,
                age_s=None,
                ready=False,
                detail=missing,
            )
        age = max(0.0, now - float(beat["ts"]))
        published = RankState(beat["state"])
        fresh = age <= self.stale_after
        return RankReadiness(
            rank=rank,
            dp_index=dp_index,
            cfg_index=cfg_index,
            state=published if fresh else RankState.STALE,
            age_s=round(age, 3),
            ready=fresh and published.takes_requests,
            detail=beat.get("detail", ""),
        )

    def read(self, rank: int, now: float | None = None) -> RankReadiness:
        """This rank's row of ``/readyz``, read from the store now (blocks while the store does)."""
        now = time.time() if now is None else now
        try:
            beat = self.beat(rank)
        except Exception as exc:  # noqa: BLE001
            return self.row(rank, None, now, f"store error: {exc}")
        return self.row(rank, beat, now)

    def snapshot(self) -> list[RankReadiness]:
        now = time.time()
        return [self.read(r, now) for r in range(self.layout.world_size)]


class BoardWatcher:
    """A copy of the board, refreshed by a thread of its own: readers never wait on the store.

    ``snapshot`` ages the copied beats with the clock, so a refresh stuck on a
    frozen store host reads as every rank going stale, within the usual bound.
    A store error drops the client (a request that timed out may leave it out
    of step with the server) and the next refresh connects again.
    """

    def __init__(self, board_factory: Callable[[], Board], layout: ParallelLayout, period_s: float) -> None:
        self._board_factory = board_factory
        self.layout = layout
        self._interval_s = min(max(period_s / 4, 0.02), 0.25)  # a state change shows within a quarter second
        self._rows = Board(MemoryKV(), layout, period_s)  # only for its row(): never reads
        self.stale_after = self._rows.stale_after
        self._beats: dict[int, dict | None] = {}
        self._error: str | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="board-watcher", daemon=True)

    def start(self) -> BoardWatcher:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        board: Board | None = None
        while not self._stop.is_set():
            try:
                if board is None:
                    board = self._board_factory()
                beats = {r: board.beat(r) for r in range(self.layout.world_size)}
                with self._lock:
                    self._beats, self._error = beats, None
            except Exception as exc:  # noqa: BLE001 - the store is slow or gone; the copy ages meanwhile
                board = None
                with self._lock:
                    self._error = f"heartbeat store not answering: {type(exc).__name__}"
            self._stop.wait(self._interval_s)

    def snapshot(self) -> list[RankReadiness]:
        """Every rank's row from the last copy, aged to now; never blocks on the store."""
        now = time.time()
        with self._lock:
            beats, error = dict(self._beats), self._error
        return [
            self._rows.row(r, beats.get(r), now, error or "no heartbeat yet") for r in range(self.layout.world_size)
        ]
