"""Idle sockets cannot hold the connection cap: sessions silent past ``--session-idle-timeout-s`` are closed with
1001, and while every ``--max-connections`` slot is taken ``/readyz`` and ``/metrics`` say so.

16 idle sessions against a cap of 16 kept a robot out with HTTP 503 for 75 s and more while ``/readyz`` said 200.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from openpi_client import msgpack_numpy
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from tests.support.servers import PolicyServerProcess, serve_policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

IDLE_S = 2.0
CAP = 2


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    args = ["--steps", "2", "--max-connections", str(CAP), "--session-idle-timeout-s", str(IDLE_S)]
    with serve_policy(tiny_checkpoint, *args, "--drain-grace-s", "0") as s:
        yield s


def session(server: PolicyServerProcess) -> ClientConnection:
    ws = connect(server.url, compression=None, max_size=None, open_timeout=10)
    assert "policy_name" in msgpack_numpy.unpackb(ws.recv(timeout=30))
    return ws


def closed_by_server(ws: ClientConnection, timeout: float) -> tuple[int, str] | None:
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        ws.recv(timeout=timeout)
    close = ws.protocol.close_rcvd
    return (close.code, close.reason) if close is not None else None


def test_idle_sessions_are_closed_and_a_full_cap_is_signalled(server: PolicyServerProcess) -> None:
    idle_closed = server.metric("policy_connections_closed_total", reason="idle_timeout") or 0.0
    assert server.readyz().json()["connections_full"] is False
    started = time.monotonic()
    holders = [session(server) for _ in range(CAP)]
    try:
        server.wait_until(lambda: server.readyz().json()["connections_full"], 5, "/readyz connections_full")
        assert server.readyz().status == 200  # the sessions it has are served: a signal, not unreadiness
        server.wait_until(lambda: server.metric("policy_connections_full") == 1, 5, "policy_connections_full 1")
        with pytest.raises(InvalidStatus) as refused:
            connect(server.url, open_timeout=10).close()
        assert refused.value.response.status_code == 503
        for ws in holders:  # nobody sent a frame: each is closed once idle past the timeout
            code_reason = closed_by_server(ws, 4 * IDLE_S)
            assert code_reason is not None and code_reason[0] == 1001 and "idle" in code_reason[1], code_reason
        assert time.monotonic() - started >= IDLE_S
    finally:
        for ws in holders:
            ws.close()
    assert server.metric("policy_connections_closed_total", reason="idle_timeout") == idle_closed + CAP
    server.wait_until(lambda: not server.readyz().json()["connections_full"], 5, "cap free again")
    robot = session(server)  # the robot kept out gets in
    robot.close()


def test_a_robot_sending_within_the_timeout_is_never_closed(server: PolicyServerProcess) -> None:
    obs = example_observation(PolicyConfig())
    with session(server) as robot:
        deadline = time.monotonic() + 2.5 * IDLE_S
        while time.monotonic() < deadline:  # a slow robot: one request every half timeout
            robot.send(msgpack_numpy.packb(obs))
            reply = msgpack_numpy.unpackb(robot.recv(timeout=30))
            assert "actions" in reply
            time.sleep(IDLE_S / 2)  # the robot's control period, not a synchronisation
        assert robot.protocol.close_rcvd is None
