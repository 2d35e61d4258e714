"""Request routing across the dp replicas of one pod.

Least in-flight first, ties broken round-robin so an idle pod spreads load
evenly; a ``session_id`` sticks to the replica it first landed on (bounded LRU),
as realtime sessions do in the DP-serving seed.  The LRU keeps a 16-byte digest
of each session key, never the key itself, so its size is bounded whatever
clients send.  A replica the caller marks unusable (stale, failed) gets no new
request; a session stuck to it moves.  Pure and synchronous: the asyncio
ingress calls it on the event loop thread only, so it needs no lock.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence


def _digest(session_id: str) -> bytes:
    return hashlib.blake2b(session_id.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class Router:
    def __init__(self, replicas: int, *, max_sessions: int = 4096) -> None:
        if replicas < 1:
            raise ValueError("a router needs at least one replica")
        self.in_flight = [0] * replicas
        self._next = 0
        self._sessions: OrderedDict[bytes, int] = OrderedDict()
        self._max_sessions = max_sessions

    @property
    def replicas(self) -> int:
        return len(self.in_flight)

    def session_keys(self) -> list[bytes]:
        """What the session table holds, least recently used first: one 16-byte digest per session, never the id
        itself, so the table's size is bounded whatever ids clients send."""
        return list(self._sessions)

    def acquire(self, session_id: str | None = None, usable: Sequence[bool] | None = None) -> int:
        """Pick a replica for one request and count it in flight until ``release``.

        ``usable[i]`` False keeps replica ``i`` out; at least one must be usable (ValueError).
        """
        n = len(self.in_flight)
        allowed = [i for i in range(n) if usable is None or usable[i]]
        if not allowed:
            raise ValueError("no usable replica")
        key = _digest(session_id) if session_id is not None else None
        index = self._sessions.get(key) if key is not None else None
        if index is None or index not in allowed:
            low = min(self.in_flight[i] for i in allowed)
            index = next(
                i % n for i in range(self._next, self._next + n) if i % n in allowed and self.in_flight[i % n] == low
            )
            self._next = (index + 1) % n
        if key is not None:
            self._sessions[key] = index
            self._sessions.move_to_end(key)
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
