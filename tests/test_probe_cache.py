"""Probes and scrapes cost the robots' event loop a bounded amount however often they come
(``runtime/serving/probe_cache.py``), and write no log line each."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

from policy_operator.constants import HEALTHZ_PATH, METRICS_PATH, READYZ_PATH
from policy_operator.runtime.serving.probe_cache import ProbePacer, Recomputed, TokenBucket
from tests.support.servers import PolicyServerProcess


class Clock:
    def __init__(self) -> None:
        self.now = 64.0

    def __call__(self) -> float:
        return self.now


def test_recomputed_is_fresh_within_its_rate_and_the_same_value_past_it() -> None:
    values = iter(range(1000))
    clock = Clock()
    answer = Recomputed(lambda: next(values), rate=10.0, burst=3.0, clock=clock)
    assert [answer.get() for _ in range(10)] == [0, 1, 2, 2, 2, 2, 2, 2, 2, 2]  # a burst of 3, then the last one
    clock.now += 0.09  # 0.9 of a token at 10/s: still the last value
    assert answer.get() == 2
    clock.now += 0.02
    assert answer.get() == 3 and answer.get() == 3 and answer.computed == 4


def test_token_bucket_refills_at_its_rate_up_to_its_burst() -> None:
    clock = Clock()
    bucket = TokenBucket(rate=4.0, burst=2.0, clock=clock)
    assert [bucket.take() for _ in range(3)] == [True, True, False]
    clock.now += 0.25  # one token at 4/s (times exact in binary)
    assert [bucket.take() for _ in range(2)] == [True, False]
    clock.now += 60.0  # idle for a minute: the burst, not 600 tokens
    assert [bucket.take() for _ in range(3)] == [True, True, False]


def test_pacer_answers_past_its_rate_later_and_never_more_than_max_paced_wait() -> None:
    async def run() -> tuple[list[float], int]:
        pacer = ProbePacer(rate=2.0, pace_s=0.1, max_paced=3)
        started = time.monotonic()
        answers = [pacer.pace(lambda: time.monotonic() - started) for _ in range(7)]
        now = [a for a in answers if isinstance(a, float)]
        later = await asyncio.gather(*(a for a in answers if not isinstance(a, float)))
        return now + list(later), pacer.paced_total

    delays, paced = asyncio.run(run())
    assert paced == 3  # 2 at once (the bucket), 3 paced, then 2 at once again (max_paced waiting)
    assert sum(d < 0.05 for d in delays) == 4 and sum(d >= 0.1 for d in delays) == 3


def test_probes_write_no_log_line_and_a_flood_is_answered(shared_server: PolicyServerProcess) -> None:
    before = len(shared_server.log_text().splitlines())
    paths = [HEALTHZ_PATH, READYZ_PATH, METRICS_PATH] * 100
    with ThreadPoolExecutor(8) as pool:
        statuses = list(pool.map(lambda p: shared_server.get(p, timeout=10).status, paths))
    assert statuses.count(200) == len(paths)
    new = shared_server.log_text().splitlines()[before:]
    assert not new, new[:5]
