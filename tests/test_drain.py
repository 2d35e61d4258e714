"""Session draining on SIGTERM, end to end on a real ``policyserver serve`` (torchrun, cfgp=2, CPU).

What a rollout needs from the pod that goes away: ``/readyz`` 503 at once
(the Service stops routing to it), no new WebSocket session, the request in
flight answered, every session then closed with 1001 (going away) so
openpi-client/RoboLab clients reconnect to a ready pod, and an exit status
of 0 -- the process the kubelet signals is ``serve``, and a clean drain is
not an ``Error`` termination.
"""

from __future__ import annotations

import signal
from pathlib import Path

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.serve_cli import children
from policy_operator.runtime.serving import wire
from policy_operator.runtime.serving.server import GOING_AWAY
from tests.support.net import wait_for
from tests.support.plugins.held_policy import hold_prompt
from tests.support.servers import serve_policy

pytestmark = pytest.mark.slow
ARGS = [
    "--cfgp",
    "2",
    "--policy",
    "held_policy:HeldPolicy",
    "--threads",
    "1",
    "--steps",
    "2",
    "--heartbeat-s",
    "0.5",
    "--drain-grace-s",
    "60",
]


def _frontend(pid: int) -> bool:
    """``--frontend process``: rank 0's front-end child, neither torchrun nor a rank."""
    try:
        return b"policy_operator.runtime.serving.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def _session(url: str) -> ClientConnection:
    return connect(url, compression=None, open_timeout=30)


def _close_code(ws: ClientConnection, timeout: float = 20.0) -> int | None:
    """The close code the server sent, after any frames still queued (read and dropped)."""
    with pytest.raises(ConnectionClosed) as closed:
        while True:
            ws.recv(timeout=timeout)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


@pytest.mark.parametrize("frontend", ["inline", "process"])
def test_sigterm_drains_sessions_and_exits_0(tiny_checkpoint, tmp_path, frontend) -> None:
    gate = tmp_path / "gate"
    with serve_policy(tiny_checkpoint, *ARGS, "--frontend", frontend) as server:
        assert len(server.rank_pids()) == 2
        with _session(server.url) as idle, _session(server.url) as busy:
            _drain_both(server, idle, busy, gate)
        assert server.wait_exit(timeout=60) == 0, server.log_tail()
        log = server.log_text()
        assert "rank 0 exiting 0 (drained)" in log and "rank 1 exiting 0" in log
        assert "torchrun exited 0" in log
        assert "SignalException" not in log  # torchrun itself was never signalled


def _drain_both(server, idle: ClientConnection, busy: ClientConnection, gate) -> None:
    idle.recv(timeout=30)
    meta = wire.unpackb(busy.recv(timeout=30))
    obs = robolab_observation(meta, 3, fixed_seed=5)
    obs["prompt"] = hold_prompt(gate)
    busy.send(wire.packb(obs))
    server.wait_until(lambda: server.readyz().json()["in_flight"] == 1, timeout=60, what="request in flight")

    server.send_signal(signal.SIGTERM)  # to serve, the container's entrypoint, as the kubelet does
    wait_for(lambda: server.readyz().status == 503, timeout=5, interval=0.02, what="/readyz 503 on SIGTERM")
    assert server.readyz().json()["draining"] is True
    with pytest.raises(InvalidStatus) as refused:
        connect(server.url, compression=None, open_timeout=10)
    assert refused.value.response.status_code == 503  # no new session on a draining pod
    assert _close_code(idle) == GOING_AWAY  # a session between requests goes at once

    assert server.alive  # the held request keeps the pod up, well within --drain-grace-s
    gate.touch()
    reply = wire.unpackb(busy.recv(timeout=60))
    assert np.asarray(reply["actions"]).shape == (16, 8) and np.isfinite(reply["actions"]).all()
    assert _close_code(busy) == GOING_AWAY  # answered, then sent to another pod


def test_sigterm_while_idle_exits_0_at_once(tiny_checkpoint) -> None:
    """Nothing in flight: the drain ends without waiting for the grace period."""
    with serve_policy(tiny_checkpoint, *ARGS) as server:
        ranks = server.rank_pids()
        torchrun = {pid for pid in server.descendants() if pid not in ranks.values() and not _frontend(pid)}
        assert len(torchrun) == 1 and set(children(torchrun.pop())) == set(ranks.values())
        server.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout=40) == 0, server.log_tail()  # far less than the 60 s grace
        assert "rank 0 exiting 0 (drained)" in server.log_text()


@pytest.mark.parametrize("frontend", ["inline", "process"])
def test_a_session_whose_last_request_failed_is_closed_at_once(tiny_checkpoint, frontend) -> None:
    """``--error-format dict`` keeps a session open after a bad request: it is between requests like any other, so
    the drain closes it at once and does not wait the grace period for an answer that is not coming."""
    with serve_policy(tiny_checkpoint, *ARGS, "--error-format", "dict", "--frontend", frontend) as server:
        with _session(server.url) as ws:
            ws.recv(timeout=30)
            ws.send(wire.packb({"prompt": "no images, no state"}))
            reply = wire.unpackb(ws.recv(timeout=30))
            assert reply["type"] == "error" and reply["error"]["kind"] == "invalid_observation", reply
            server.send_signal(signal.SIGTERM)
            assert _close_code(ws) == GOING_AWAY
        assert server.wait_exit(timeout=40) == 0, server.log_tail()  # far less than the 60 s grace
        assert "rank 0 exiting 0 (drained)" in server.log_text()
