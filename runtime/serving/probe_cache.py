"""What a probe or a scrape costs the event loop the robots share: bounded, however often they come.

``/metrics`` renders every series (and under ``--frontend process`` reads every front-end's files) and
``/readyz`` reads the heartbeat board: each costs the loop that carries the robots' requests.  A flood of them
(16 threads scraping as fast as answered) took one robot's p99 from 10 ms to 131 ms.  ``Recomputed`` computes
such an answer afresh at most ``rate`` times a second (``burst`` at once) and hands out the last one in
between: a kubelet probing every few seconds, Prometheus scraping every 15 s and a test polling every 50 ms
always get a fresh answer, a flood (once past the burst) the same bytes again, at most 50 ms old.

Even the same bytes cost the loop an accepted connection, a parsed request and a written answer each (~0.2 ms):
16 threads asking as fast as they are answered kept the loop busy most of the time.  ``ProbePacer`` lets
``PROBES_PER_S`` of them through at once and answers the rest ``PACE_S`` later: a flooder that waits for its
answer before asking again (as every HTTP client does) is slowed to a pace the loop does not notice, while a
kubelet's probe answers at once (and at most ``PACE_S`` late during a flood).  At most ``MAX_PACED`` wait at
a time; past that they are answered at once (a sleeping answer holds a socket).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

FRESH_PER_S = 20.0  # fresh answers a second, per path, beyond the burst
FRESH_BURST = 50.0  # a test's or an operator's scrapes in a row are all fresh; only a flood runs out
PROBES_PER_S = 100.0  # probes and scrapes answered at once, all paths together (a kubelet sends 1-3 a second)
PACE_S = 0.2  # how much later the rest are answered
MAX_PACED = 1024


class TokenBucket:
    """``rate`` a second, ``burst`` deep, on ``clock`` (seconds; tests drive their own)."""

    def __init__(self, rate: float, burst: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.burst = rate, burst
        self._clock = clock
        self._tokens = burst
        self._at = clock()

    def take(self) -> bool:
        now = self._clock()
        self._tokens = min(self.burst, self._tokens + (now - self._at) * self.rate)
        self._at = now
        if self._tokens < 1.0:
            return False
        self._tokens -= 1.0
        return True


class Recomputed[T]:
    """``compute()``'s value, recomputed while a token bucket (``rate`` a second, ``burst`` deep) allows."""

    def __init__(
        self,
        compute: Callable[[], T],
        rate: float = FRESH_PER_S,
        burst: float = FRESH_BURST,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._compute = compute
        self._bucket = TokenBucket(rate, burst, clock)
        self._value: T | None = None
        self._have = False
        self.computed = 0  # how many times it was computed, for tests

    def get(self) -> T:
        if self._bucket.take() or not self._have:
            self._value = self._compute()
            self._have = True
            self.computed += 1
        return self._value  # type: ignore[return-value]


class ProbePacer:
    """Answers past ``PROBES_PER_S`` go out ``PACE_S`` later (see the module's docstring)."""

    def __init__(self, rate: float = PROBES_PER_S, pace_s: float = PACE_S, max_paced: int = MAX_PACED) -> None:
        self._bucket = TokenBucket(rate, rate)
        self._pace_s = pace_s
        self._max_paced = max_paced
        self.paced = 0  # waiting now
        self.paced_total = 0  # since the start, for tests

    def pace[T](self, answer: Callable[[], T]) -> T | Awaitable[T]:
        """``answer()`` now, or an awaitable of it ``pace_s`` from now."""
        if self._bucket.take() or self.paced >= self._max_paced:
            return answer()
        self.paced += 1  # counted now: the coroutine runs only once websockets awaits it
        self.paced_total += 1
        return self._later(answer)

    async def _later[T](self, answer: Callable[[], T]) -> T:
        try:
            await asyncio.sleep(self._pace_s)
        finally:
            self.paced -= 1
        return answer()
