"""Routing across dp replicas, in the style of the DP-serving seed's test_dp_routing.py."""

from __future__ import annotations

import pytest

from policy_operator.runtime.engine.router import Router


def test_single_replica_is_degenerate() -> None:
    r = Router(1)
    assert [r.acquire() for _ in range(3)] == [0, 0, 0]
    assert r.in_flight == [3]


def test_idle_pod_round_robins() -> None:
    r = Router(3)
    picks = []
    for _ in range(6):
        i = r.acquire()
        picks.append(i)
        r.release(i)
    assert picks == [0, 1, 2, 0, 1, 2]


def test_least_in_flight_wins() -> None:
    r = Router(2)
    a = r.acquire()
    b = r.acquire()
    assert {a, b} == {0, 1}  # concurrent requests spread over both replicas
    r.release(a)
    assert r.acquire() == a  # the one that finished is the least loaded
    c = r.acquire()
    assert r.in_flight == [2, 1] or r.in_flight == [1, 2]
    assert c in (0, 1)


def test_busy_replica_is_skipped() -> None:
    r = Router(3)
    first = r.acquire()
    for _ in range(4):
        i = r.acquire()
        assert i != first  # the busy replica never gets a request while others idle
        r.release(i)


def test_session_sticks_even_when_busy() -> None:
    r = Router(2)
    s = r.acquire("robot-a")
    other = r.acquire("robot-b")
    assert other != s
    for _ in range(3):
        assert r.acquire("robot-a") == s  # state of a session lives on its replica
    assert r.in_flight[s] == 4


def take(r: Router, session: str | None = None, usable: list[bool] | None = None) -> int:
    """One request routed and finished at once: the replica it went to."""
    index = r.acquire(session, usable=usable)
    r.release(index)
    return index


def test_session_table_is_bounded() -> None:
    r = Router(2, max_sessions=2)
    assert [take(r, s) for s in "abc"] == [0, 1, 0]  # "c" evicts "a"
    # "c" and "b" stick where round-robin would swap them; "a" was forgotten, so it goes where round-robin says
    assert [take(r, "c"), take(r, "b"), take(r, "a")] == [0, 1, 1]
    assert len(r.session_keys()) == 2


def test_the_table_holds_digests_not_session_ids() -> None:
    r = Router(2)
    r.acquire("s" * 256)
    assert [len(key) for key in r.session_keys()] == [16], "a long session id must not be stored as is"


def test_unusable_replicas_get_no_requests_and_sessions_move() -> None:
    r = Router(3)
    s = take(r, "robot-a")
    usable = [i != s for i in range(3)]
    moved = take(r, "robot-a", usable=usable)
    assert moved != s and take(r, "robot-a") == moved, "the session sticks to the replica it moved to"
    assert all(r.acquire(usable=usable) != s for _ in range(4))
    with pytest.raises(ValueError):
        r.acquire(usable=[False, False, False])


def test_release_without_acquire_is_an_error() -> None:
    r = Router(2)
    with pytest.raises(RuntimeError):
        r.release(1)
