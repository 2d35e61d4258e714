"""A session belongs to the connection that names it (issue 40 item 3), in both front-end modes.

A real server (``POLICY_TEST_FRONTEND=process`` runs it with ``--frontend
process``) serving a policy with a history of two observations
(``tests/support/plugins/history_policy.py``): a second connection that sends
the victim's ``session_id`` between the victim's requests must not change the
victim's next chunk, and a reconnect starts its session afresh
(docs/protocol.md, "Sessions").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.sync.client import ClientConnection, connect

from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from policy_operator.runtime.serving import wire
from tests.support.servers import PolicyServerProcess, serve_policy

RECV_TIMEOUT_S = 60.0
SESSION = "robot-1"


def observation(variant: int, **changes: Any) -> dict[str, Any]:
    obs = example_observation(PolicyConfig(), variant)
    obs.update(changes)
    return obs


@contextlib.contextmanager
def opened(server: PolicyServerProcess) -> Iterator[ClientConnection]:
    with connect(server.url, compression=None, max_size=None, open_timeout=30) as ws:
        wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))  # the metadata
        yield ws


def chunk(ws: ClientConnection, obs: dict[str, Any]) -> np.ndarray:
    ws.send(wire.packb(obs))
    reply = wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
    assert "actions" in reply, reply
    return np.asarray(reply["actions"])


@pytest.fixture(scope="module")
def history_server(tiny_checkpoint: Path) -> Any:
    with serve_policy(
        tiny_checkpoint, "--steps", "2", "--threads", "1", "--policy", "history_policy:HistoryPolicy"
    ) as s:
        yield s


@pytest.mark.slow  # its own server
def test_another_connection_naming_the_victims_session_does_not_change_its_next_chunk(
    history_server: PolicyServerProcess,
) -> None:
    first, second = observation(0, session_id=SESSION, seed=1), observation(1, session_id=SESSION, seed=2)
    with opened(history_server) as victim:  # undisturbed: what its second chunk is
        chunk(victim, first)
        expected = chunk(victim, second)
    with opened(history_server) as victim, opened(history_server) as attacker:
        chunk(victim, first)
        chunk(attacker, observation(7, session_id=SESSION, seed=3))  # a far other state, the victim's id
        got = chunk(victim, second)
        # the attacker's own session is its own too: its next chunk follows its own last state
        attacked = chunk(attacker, second)
    with opened(history_server) as fresh:
        alone = chunk(fresh, second)
    assert not np.array_equal(alone, expected), "the history changes the chunk (else this test proves nothing)"
    np.testing.assert_array_equal(got, expected)
    assert not np.array_equal(attacked, expected), "the attacker's history is its own observation, not the victim's"


@pytest.mark.slow  # its own server
def test_a_reconnect_starts_the_session_afresh(history_server: PolicyServerProcess) -> None:
    first, second = observation(0, session_id=SESSION, seed=1), observation(1, session_id=SESSION, seed=2)
    with opened(history_server) as fresh:
        alone = chunk(fresh, second)  # a first request: padded with itself
    with opened(history_server) as robot:
        chunk(robot, first)
    with opened(history_server) as again:  # the same robot, reconnected
        assert np.array_equal(chunk(again, second), alone)
