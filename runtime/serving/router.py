"""Request routing across the dp replicas of one pod.

Least in-flight first, ties broken round-robin so an idle pod spreads load
evenly; a ``session_id`` sticks to the replica it first landed on (bounded LRU),
as realtime sessions do in the DP-serving seed.  Pure and synchronous: the
asyncio ingress calls it on the event loop thread only, so it needs no lock.
"""

from __future__ import annotations

from collections import OrderedDict


class Router:
    def __init__(self, replicas: int, *, max_sessions: int = 4096) -> None:
        if replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.in_flight = [0] * replicas
        self._next = 0
        self._sessions: OrderedDict[str, int] = OrderedDict()
        self._max_sessions = max_sessions

    @property
    def replicas(self) -> int:
        return len(self.in_flight)

    def acquire(self, session_id: str | None = None) -> int:
        """Pick a replica for one request and count it in flight until ``release``."""
        index = self._sessions.get(session_id) if session_id is not None else None
        if index is None:
            low = min(self.in_flight)
            n = self.replicas
            index = next(i % n for i in range(self._next, self._next + n) if self.in_flight[i % n] == low)
            self._next = (index + 1) % n
        if session_id is not None:
            self._sessions[session_id] = index
            self._sessions.move_to_end(session_id)
            while len(self._sessions) > self._max_sessions:
                self._sessions.popitem(last=False)
        self.in_flight[index] += 1
        return index

    def release(self, index: int) -> None:
        if self.in_flight[index] <= 0:
            raise RuntimeError(f"replica {index} released more often than acquired")
        self.in_flight[index] -= 1

    def total_in_flight(self) -> int:
        return sum(self.in_flight)

