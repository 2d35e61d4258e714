"""Heartbeats: fresh + warm is ready; a silent rank goes stale within 1.5 periods."""

from __future__ import annotations

import json
import time

from policy_operator.layout import ParallelLayout
from policy_operator.runtime.health import KEY_PREFIX, Board, Heartbeat, MemoryKV, RankState
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
