"""The engine learns of a failed replica from its lane, whenever the outcome comes.

In-process, with a lane and a heartbeat board stood in for, on a clock the test
drives: the race is one of timing (the request's own bound against the
replica's late ``replica_failed`` outcome), which a real pod cannot hit on
demand.  The engine's watch is run by hand (``check_unready``) at the times the
test sets, so nothing here sleeps.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, cast

import pytest

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import RankReadiness, RankState
from policy_operator.runtime.engine.core import ROUTING_SNAPSHOT_S, Engine
from policy_operator.runtime.engine_api import PreparedRequest
from policy_operator.runtime.errors import ErrorKind
from policy_operator.runtime.parallel.dispatch import InferenceRequest, Lane, Outcome, Ran
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.sampler import SamplerSettings
from policy_operator.runtime.result import Result


class Clock:
    """Monotonic seconds that move only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class Board:
    """One rank whose heartbeat the test turns stale."""

    def __init__(self) -> None:
        self.fresh = True

    def snapshot(self) -> list[RankReadiness]:
        state = RankState.WARM if self.fresh else RankState.STALE
        return [RankReadiness(rank=0, dp_index=0, cfg_index=0, state=state, age_s=0.0, ready=self.fresh)]


class HeldLane:
    """A lane whose replica answers only when the test says so."""

    index = 0

    def __init__(self) -> None:
        self.futures: list[asyncio.Future[Ran]] = []
        self.requests: list[InferenceRequest] = []

    def submit(self, request: InferenceRequest) -> asyncio.Future[Ran]:
        self.requests.append(request)
        self.futures.append(asyncio.get_running_loop().create_future())
        return self.futures[-1]

    def kick(self) -> None:
        pass

    def answer(self, k: int, outcome: Outcome) -> None:
        self.futures[k].set_result(Ran(outcome, 0.0, 1, 0))


def held_engine(board: Board, lane: HeldLane, clock: Clock, request_timeout_s: float, **kwargs: Any) -> Engine:
    """An engine of one replica behind ``lane``, its readiness from ``board``; its own watch timer never fires
    within a test (an hour), the test runs the watch."""
    engine = Engine(
        ParallelLayout(),
        SamplerSettings(steps=2, guidance=None, cfg_mode="sequential"),
        board,  # type: ignore[arg-type]  # a stand-in with the one method the engine reads, snapshot()
        request_timeout_s=request_timeout_s,
        poll_s=3600.0,
        clock=clock,
        **kwargs,
    )
    engine.policy = cast(Policy, object())  # loaded, as far as routing goes: requests come prepared
    engine.lanes = [cast(Lane, lane)]
    return engine


STEP = 0.0625  # longer than the routing snapshot's age: the engine reads the board afresh after it
assert STEP > ROUTING_SNAPSHOT_S


def prepared(seed: int) -> PreparedRequest:
    return PreparedRequest(cast(Sample, object()), None, seed, None)


async def settled() -> None:
    """The done callbacks of futures resolved so far have run."""
    for _ in range(3):
        await asyncio.sleep(0)


def test_a_replica_failed_outcome_after_the_request_gave_up_still_fails_the_replica() -> None:
    async def scenario() -> tuple[Result, list[tuple[int, str]], dict[int, str]]:
        board, lane, clock, failures = Board(), HeldLane(), Clock(), []
        engine = held_engine(
            board, lane, clock, 0.25, on_replica_failed=lambda index, reason: failures.append((index, reason))
        )
        answer = engine.submit(prepared(7))
        clock.advance(STEP)
        board.fresh = False  # the replica stops heartbeating while it holds the request
        engine.check_unready()
        assert not answer.done(), "stale for no time yet"
        clock.advance(0.25)
        engine.check_unready()
        result = answer.result()
        assert not failures, "nothing has failed yet: the replica is only stale"
        lane.answer(0, Outcome(lane.requests[0].request_id, 0.0, error_kind=ErrorKind.REPLICA_FAILED, error="boom"))
        await settled()  # the lane's done callbacks
        return result, failures, engine.failed

    result, failures, failed = asyncio.run(scenario())
    assert result.error_kind is ErrorKind.REPLICA_UNAVAILABLE
    assert failures == [(0, "boom")] and failed == {0: "boom"}


@pytest.mark.parametrize("decides", [True, False], ids=["worker-decides", "no-worker"])
def test_a_failed_replica_is_logged_by_whoever_takes_the_pod_down(
    decides: bool, caplog: pytest.LogCaptureFixture
) -> None:
    """The engine hands a failed replica to ``on_replica_failed`` and logs nothing of its own: the worker logs an
    error and takes the pod down, or an INFO line when the shutdown itself ended the replica (a drain's grace
    period that ended inside a collective logged an ERROR under --frontend process).  An engine nobody
    watches logs the error itself."""

    async def scenario() -> list[tuple[int, str]]:
        board, lane, clock, failures = Board(), HeldLane(), Clock(), []
        hook = {"on_replica_failed": lambda index, reason: failures.append((index, reason))} if decides else {}
        engine = held_engine(board, lane, clock, 0.25, **hook)
        answer = engine.submit(prepared(7))
        lane.answer(0, Outcome(lane.requests[0].request_id, 0.0, error_kind=ErrorKind.REPLICA_FAILED, error="boom"))
        await settled()
        assert answer.result().error_kind is ErrorKind.REPLICA_FAILED
        return failures

    with caplog.at_level(logging.INFO, logger="policy_operator.runtime.engine.core"):
        failures = asyncio.run(scenario())
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert failures == ([(0, "boom")] if decides else [])
    assert errors == ([] if decides else ["replica 0 failed: boom"])


def test_the_bound_counts_one_unready_stretch_not_the_sum_of_several() -> None:
    """A replica stale twice, each time for less than the request timeout, still answers the request it held;
    and a request routed after that, its replica then stale for good, fails exactly one timeout after the
    stretch began (the times are binary fractions: no rounding)."""

    async def scenario() -> tuple[Result, Result]:
        board, lane, clock = Board(), HeldLane(), Clock()
        engine = held_engine(board, lane, clock, 0.25)
        first = engine.submit(prepared(7))
        for _ in range(2):  # two stale stretches of 0.1875 s: 0.375 s unready in all, never 0.25 s in a row
            clock.advance(STEP)
            engine.check_unready()  # seen ready between the stretches
            clock.advance(STEP)
            board.fresh = False
            engine.check_unready()  # the stretch begins
            clock.advance(0.1875)
            engine.check_unready()
            board.fresh = True
        clock.advance(STEP)
        engine.check_unready()
        assert not first.done(), "no stretch lasted the timeout"
        lane.answer(0, Outcome(lane.requests[0].request_id, 1.0))
        await settled()
        answered = first.result()
        # now stale for good: a request routed while fresh fails one timeout after the stretch began
        second = engine.submit(prepared(8))
        clock.advance(STEP)
        board.fresh = False
        engine.check_unready()  # the stretch begins
        clock.advance(0.1875)
        engine.check_unready()
        assert not second.done(), "0.1875 s of a 0.25 s bound"
        clock.advance(0.0625)
        engine.check_unready()
        return answered, second.result()

    answered, second = asyncio.run(scenario())
    assert answered.infer_ms == 1.0 and answered.error_kind is None
    assert second.error_kind is ErrorKind.REPLICA_UNAVAILABLE
