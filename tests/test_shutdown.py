"""SIGTERM at the awkward moments: a drain that outlasts its grace period, and a pod deleted while it loads.

Both are normal events of a rollout, so every layout must exit 0 (no
``Error`` termination in Kubernetes) and promptly: within the grace period
plus a few seconds, at once while loading.  Real ``policyserver serve``
processes (torchrun with gloo ranks on the CPU) on 127.0.0.1; the request
that outlasts the grace period is held by the ``held_policy`` plug-in and the
loading one by ``gated_load_policy``, so no timing guess decides what is in
progress when the signal comes.  Asserted at the level of the wire (the error
kind, the close code) and of exit codes, which hold whatever process layout
the runtime has inside.
"""

from __future__ import annotations

import signal
import time

import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.serving import wire
from policy_operator.runtime.serving.server import GOING_AWAY
from tests.support.plugins.gated_load_policy import GATE_ENV
from tests.support.plugins.held_policy import hold_prompt
from tests.support.servers import serve_policy

pytestmark = pytest.mark.slow
GRACE_S = 3.0
# grace + this: /readyz's last heartbeat period and the ranks' stop (about 1.5 s), then torchrun's own exit, which
# takes 3-6 s after its last worker on a busy 2-core machine (interpreter teardown), and serve's poll
EXIT_SLACK_S = 12.0
LAYOUTS = {
    "1x1": [],
    "cfgp2": ["--cfgp", "2"],
    "dp2": ["--dp", "2"],
    "1x1-frontend-process": ["--frontend", "process"],
    "dp2-frontend-process": ["--dp", "2", "--frontend", "process"],
}
COMMON = ["--threads", "1", "--steps", "2", "--heartbeat-s", "0.5"]


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_drain_that_outlasts_its_grace_fails_the_request_and_exits_0(tiny_checkpoint, tmp_path, layout) -> None:
    never = tmp_path / "never-created"  # the held request would compute for HOLD_LIMIT_S (two minutes)
    args = [
        *layout,
        *COMMON,
        "--policy",
        "held_policy:HeldPolicy",
        "--drain-grace-s",
        str(GRACE_S),
        "--error-format",
        "dict",
    ]
    with serve_policy(tiny_checkpoint, *args) as server:
        with connect(server.url, compression=None, max_size=None, open_timeout=30) as ws:
            obs = robolab_observation(wire.unpackb(ws.recv(timeout=30)), 3, fixed_seed=5)
            obs["prompt"] = hold_prompt(never)
            ws.send(wire.packb(obs))
            server.wait_until(lambda: server.readyz().json()["in_flight"] == 1, timeout=60, what="request in flight")

            signalled = time.monotonic()
            server.send_signal(signal.SIGTERM)  # to serve, the container's entrypoint, as the kubelet does
            reply = wire.unpackb(ws.recv(timeout=GRACE_S + EXIT_SLACK_S))
            answered_s = time.monotonic() - signalled
            assert reply.get("type") == "error" and reply["error"]["kind"] == "drain_timeout", reply
            assert GRACE_S - 0.5 <= answered_s <= GRACE_S + 2.0, answered_s  # at the deadline, not before
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=10)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == GOING_AWAY  # reconnect elsewhere

        code = server.wait_exit(timeout=GRACE_S + 30)
        exited_s = time.monotonic() - signalled
        log = server.log_text()
    assert code == 0, log[-4000:]
    assert exited_s <= GRACE_S + EXIT_SLACK_S, (exited_s, log[-4000:])
    assert "exiting 5" not in log and "silent for" not in log and "collective failed" not in log, log[-4000:]


def test_sigterm_while_the_ranks_load_exits_0_at_once(tiny_checkpoint, tmp_path) -> None:
    """A pod deleted while it starts: cfgp=2, both ranks inside ``Policy.load`` when the signal comes."""
    gate = tmp_path / "load-gate"  # never created: loading would take GATE_LIMIT_S
    args = ["--cfgp", "2", *COMMON, "--policy", "gated_load_policy:GatedLoadPolicy"]
    with serve_policy(tiny_checkpoint, *args, wait="listening", env={GATE_ENV: str(gate)}) as server:

        def both_loading() -> bool:
            ranks = server.readyz().json()["ranks"]
            return len(ranks) == 2 and all(
                r["state"] == "loading" and r["detail"] == "loading the policy" for r in ranks
            )

        server.wait_until(both_loading, timeout=90, what="both ranks loading the policy")
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait_exit(timeout=40)
        exited_s = time.monotonic() - signalled
        log = server.log_text()
    assert code == 0, log[-4000:]
    assert "SIGTERM while loading: nothing to drain, exiting 0" in log, log[-4000:]
    assert exited_s <= 10.0, (exited_s, log[-4000:])  # the ranks at once; torchrun's own exit takes seconds
    assert "silent for" not in log and "exitcode: -15" not in log.replace("  ", " "), log[-4000:]


def test_sigterm_as_the_ranks_start_exits_0(tiny_checkpoint) -> None:
    """A pod deleted the moment it starts: the signal comes while torchrun's ranks are still starting Python.

    ``serve`` passes it on only once a rank takes it; killed by the signal itself, a rank would make torchrun
    report a failure (exit 1).
    """
    with serve_policy(tiny_checkpoint, "--cfgp", "2", *COMMON, wait="started") as server:
        server.wait_until(
            lambda: len(set(server.rank_pids().values()) - {server.pid}) == 2, timeout=60, what="both ranks started"
        )
        signalled = time.monotonic()
        server.send_signal(signal.SIGTERM)
        code = server.wait_exit(timeout=60)
        exited_s = time.monotonic() - signalled
        log = server.log_text()
    assert code == 0, log[-4000:]
    assert exited_s <= 30.0, (exited_s, log[-4000:])  # the ranks' start-up, then they exit at once


def test_a_grace_period_that_ends_inside_cfg_collectives_logs_no_error(tiny_checkpoint) -> None:
    """cfgp=2 computing a long request (2000 denoising steps, each with its collectives) when the grace period
    ends: the request gets drain_timeout, the ranks stop inside its collectives, the pod exits 0, and that
    collective's failure is logged as the shutdown's (INFO), not as an ERROR about a failed replica."""
    args = ["--cfgp", "2", "--threads", "1", "--steps", "2000", "--heartbeat-s", "0.5"]
    with serve_policy(tiny_checkpoint, *args, "--drain-grace-s", "1", "--error-format", "dict") as server:
        with connect(server.url, compression=None, max_size=None, open_timeout=30) as ws:
            ws.send(wire.packb(robolab_observation(wire.unpackb(ws.recv(timeout=30)), 3, fixed_seed=5)))
            server.wait_until(lambda: server.readyz().json()["in_flight"] == 1, timeout=60, what="request in flight")
            server.send_signal(signal.SIGTERM)
            reply = wire.unpackb(ws.recv(timeout=30))
            assert reply.get("type") == "error" and reply["error"]["kind"] == "drain_timeout", reply
        code = server.wait_exit(timeout=40)
        log = server.log_text()
    assert code == 0, log[-4000:]
    errors = [line for line in log.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, errors
