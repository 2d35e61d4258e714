"""Heartbeats and /readyz: fresh + warm is ready; a silent rank goes stale within 1.5 periods."""

from __future__ import annotations

import json
import time

import pytest

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import RankReadiness, RankState, Readiness, all_ranks_ready
from policy_operator.runtime.parallel.heartbeat import KEY_PREFIX, Board, Heartbeat, MemoryKV
from tests.support.net import wait_for


def test_board_states() -> None:
    kv = MemoryKV()
    board = Board(kv, ParallelLayout(2, 1), period_s=1.0)
    now = time.time()
    assert board.read(0).state == "unknown" and not board.read(0).ready
    kv.set(f"{KEY_PREFIX}0", json.dumps({"state": "warm", "ts": now, "pid": 1}).encode())
    kv.set(f"{KEY_PREFIX}1", json.dumps({"state": "loading", "ts": now, "pid": 2}).encode())
    snap = board.snapshot()
    assert [s.ready for s in snap] == [True, False]
    assert snap[1].state == "loading" and snap[1].cfg_index == 1
    stale = board.read(0, now=now + 1.6)
    assert stale.state == "stale" and not stale.ready


def test_heartbeat_publishes_and_stops() -> None:
    kv = MemoryKV()
    board = Board(kv, ParallelLayout(1, 1), period_s=0.05)
    hb = Heartbeat(lambda: kv, 0, 0.05).start()
    try:
        wait_for(lambda: board.read(0).state == "loading", 5, what="first beat")
        hb.set_state(RankState.WARM)
        wait_for(lambda: board.read(0).ready, 5, what="warm beat")
    finally:
        hb.stop()
    wait_for(lambda: not board.read(0).ready, 5, what="stale after stop")


def rank(index: int, ready: bool) -> RankReadiness:
    return RankReadiness(
        rank=index,
        dp_index=0,
        cfg_index=index,
        state=RankState.WARM if ready else RankState.LOADING,
        age_s=0.1,
        ready=ready,
    )


def test_ready_only_when_every_rank_answers() -> None:
    ranks = [rank(0, True), rank(1, True)]
    assert all_ranks_ready(ranks, 2)
    assert not all_ranks_ready(ranks[:1], 2)  # a replica that never reported
    assert not all_ranks_ready([ranks[0], rank(1, False)], 2)
    assert not all_ranks_ready([], 1)


def test_readyz_document_round_trips_and_refuses_drift() -> None:
    """What the runtime serves is what the operator parses; a renamed field or unknown state is refused."""
    board = Board(MemoryKV(), ParallelLayout(2, 1), period_s=1.0)
    doc = Readiness(ready=False, world_size=2, ranks_ready=0, ranks=board.snapshot(), in_flight=0, draining=False)
    body = doc.to_json()
    assert b'"error"' not in body  # only when loading failed
    assert Readiness.parse(body) == doc
    assert Readiness.parse(Readiness(**{**doc.model_dump(), "error": "boom"}).to_json()).error == "boom"
    assert b'"max_batch"' not in body and b'"batch_buckets_ms"' not in body  # set once loaded / under a budget
    budget = Readiness(**{**doc.model_dump(), "max_batch": 2, "batch_buckets_ms": {1: 14.5, 2: 19.25}})
    assert json.loads(budget.to_json())["batch_buckets_ms"] == {"1": 14.5, "2": 19.25}
    assert Readiness.parse(budget.to_json()) == budget
    good = doc.model_dump(mode="json")
    for broken in (
        {**good, "ranksReady": 0, "ranks_ready": None},
        {**good, "ranks": [{**good["ranks"][0], "state": "warming"}]},
        {**good, "ranks": [{**good["ranks"][0], "rank": -1}]},
    ):
        with pytest.raises(ValueError) as info:
            Readiness.parse(json.dumps(broken))
        assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="JSON"):
        Readiness.parse(b"<html>")
