"""The ingress learns of a failed replica from its lane, whenever the reply comes.

In-process, with a lane and a heartbeat board stood in for: the race is one of
timing (the request's own bound against the replica's late ``replica_failed``
reply), which a real pod cannot hit on demand.
"""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import RankReadiness, RankState
from policy_operator.runtime.errors import ErrorKind, ReplicaUnavailable
from policy_operator.runtime.parallel.dispatch import InferenceRequest, Lane, Reply
from policy_operator.runtime.policy.interface import Sample
from policy_operator.runtime.policy.sampler import SamplerSettings
from policy_operator.runtime.serving.ingress import Ingress


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
        self.futures: list[asyncio.Future[Reply]] = []
        self.requests: list[InferenceRequest] = []

    def submit(self, request: InferenceRequest) -> asyncio.Future[Reply]:
        self.requests.append(request)
        self.futures.append(asyncio.get_running_loop().create_future())
        return self.futures[-1]

    def kick(self) -> None:
        pass


def held_ingress(board: Board, lane: HeldLane, request_timeout_s: float, **kwargs: Any) -> Ingress:
    """An ingress of one replica behind ``lane``, its readiness from ``board``, polled every 20 ms."""
    ingress = Ingress(
        ParallelLayout(),
        SamplerSettings(steps=2, guidance=None, cfg_mode="sequential"),
        board,  # type: ignore[arg-type]  # a stand-in with the one method Ingress reads, snapshot()
        request_timeout_s=request_timeout_s,
        poll_s=0.02,
        **kwargs,
    )
    ingress.lanes = [cast(Lane, lane)]
    return ingress


def test_a_replica_failed_reply_after_the_request_gave_up_still_fails_the_replica() -> None:
    async def scenario() -> tuple[list[tuple[int, str]], dict[int, str]]:
        board, lane, failures = Board(), HeldLane(), []
        ingress = held_ingress(
            board, lane, 0.2, on_replica_failed=lambda index, reason: failures.append((index, reason))
        )
        answer = asyncio.ensure_future(ingress.submit(cast(Sample, object()), 7, None))
        await asyncio.sleep(0.05)
        board.fresh = False  # the replica stops heartbeating while it holds the request
        with pytest.raises(ReplicaUnavailable):
            await asyncio.wait_for(answer, timeout=5)
        assert not failures, "nothing has failed yet: the replica is only stale"
        late = Reply(
            lane.requests[0].request_id, 0.0, error_kind=ErrorKind.REPLICA_FAILED, error="cfg collective failed"
        )
        lane.futures[0].set_result(late)
        await asyncio.sleep(0)  # the lane's done callbacks
        return failures, ingress.failed

    failures, failed = asyncio.run(scenario())
    assert failures == [(0, "cfg collective failed")] and failed == {0: "cfg collective failed"}


def test_the_bound_counts_one_unready_stretch_not_the_sum_of_several() -> None:
    """A replica stale twice, each time for less than the request timeout, still answers the request it held;
    and a request routed after that, its replica then stale for good, fails one timeout after the stretch began."""

    async def scenario() -> tuple[Reply, float]:
        board, lane = Board(), HeldLane()
        ingress = held_ingress(board, lane, 0.3)
        first = asyncio.ensure_future(ingress.submit(cast(Sample, object()), 7, None))
        for _ in range(2):  # two stale stretches of ~0.2 s: 0.4 s unready in all, never 0.3 s in a row
            await asyncio.sleep(0.15)  # fresh for three routing snapshots' age: the watch sees it between
            board.fresh = False
            await asyncio.sleep(0.2)
            board.fresh = True
        await asyncio.sleep(0.15)
        assert not first.done(), "no stretch lasted the timeout"
        lane.futures[0].set_result(Reply(lane.requests[0].request_id, 1.0))
        answered = await asyncio.wait_for(first, timeout=5)
        # now stale for good: a request routed while fresh fails one timeout after the stretch began
        second = asyncio.ensure_future(ingress.submit(cast(Sample, object()), 8, None))
        await asyncio.sleep(0.05)
        board.fresh = False
        stale_at = asyncio.get_running_loop().time()
        with pytest.raises(ReplicaUnavailable):
            await asyncio.wait_for(second, timeout=5)
        return answered, asyncio.get_running_loop().time() - stale_at

    answered, waited = asyncio.run(scenario())
    assert answered.infer_ms == 1.0 and answered.error_kind is None
    assert 0.3 <= waited < 1.0, waited  # the timeout, plus a poll and the routing snapshot's age at most
