"""The ingress learns of a failed replica from its lane, whenever the reply comes.

In-process, with a lane and a heartbeat board stood in for: the race is one of
timing (the request's own bound against the replica's late ``replica_failed``
reply), which a real pod cannot hit on demand.
"""

from __future__ import annotations

import asyncio
from typing import cast

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


def test_a_replica_failed_reply_after_the_request_gave_up_still_fails_the_replica() -> None:
    async def scenario() -> tuple[list[tuple[int, str]], dict[int, str]]:
        board, lane, failures = Board(), HeldLane(), []
        ingress = Ingress(
            ParallelLayout(),
            SamplerSettings(steps=2, guidance=None, cfg_mode="sequential"),
            board,
            request_timeout_s=0.2,
            poll_s=0.02,
            on_replica_failed=lambda index, reason: failures.append((index, reason)),
        )
        ingress.lanes = [cast(Lane, lane)]
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
