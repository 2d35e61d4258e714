"""The serving runtime under hostile input and faults: no NaN reply, no unbounded memory or wait, no healthy-looking broken replica.

Real ``policyserver serve`` processes (single process, or torchrun with gloo
ranks on the CPU) on 127.0.0.1 and the tiny reference checkpoint.  Frames go
over a plain WebSocket connection packed with openpi's own msgpack-numpy, so
what is tested is exactly what a robot would send.  Tests that freeze a
process (SIGSTOP) resume it in a ``finally``; every wait is bounded.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import websockets
from openpi_client import msgpack_numpy
from websockets.sync.client import ClientConnection, connect

from policy_operator.exit_codes import ServeExit
from tests.support.net import wait_for
from tests.support.servers import (
    NO_DRAIN,
    VENV_BIN,
    PolicyServerProcess,
    ServerExited,
    proc_stat,
    serve_policy,
    session_checkpoint,
    subprocess_env,
)

JOINT_KEY = "observation/joint_position"
GRIPPER_KEY = "observation/gripper_position"
SESSION_KEY = "session_id"
ERRORS = "policy_request_errors_total"
RECV_TIMEOUT_S = 60.0
# Tiny model, 2 denoising steps, replies as {"type": "error"} maps so the kind can be read.
FAST = ["--steps", "2", "--threads", "1", "--error-format", "dict"]
# torchrun layouts: half-second heartbeats so staleness shows within a second.
RANKS = ["--threads", "1", "--heartbeat-s", "0.5", "--error-format", "dict"]


def observation(seed: int = 0, **changes: Any) -> dict[str, Any]:
    """A valid observation for the tiny checkpoint (7 joints, 1 gripper, 32x32 camera)."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {
        "observation/image": rng.integers(0, 256, size=(32, 32, 3), dtype=np.uint8),
        JOINT_KEY: rng.standard_normal(7).astype(np.float32),
        GRIPPER_KEY: rng.random(1).astype(np.float32),
        "prompt": "pick up the cup",
        "seed": 7,
    }
    obs.update(changes)
    return obs


@contextlib.contextmanager
def connection(server: PolicyServerProcess, open_timeout: float = 30) -> Iterator[ClientConnection]:
    with connect(server.url, compression=None, max_size=None, open_timeout=open_timeout) as ws:
        ws.recv(timeout=RECV_TIMEOUT_S)  # the metadata frame
        yield ws


def ask(ws: ClientConnection, obs: dict[str, Any], timeout: float = RECV_TIMEOUT_S) -> dict[str, Any]:
    ws.send(msgpack_numpy.packb(obs))
    reply = ws.recv(timeout=timeout)
    assert isinstance(reply, bytes), reply
    return msgpack_numpy.unpackb(reply)


def request(server: PolicyServerProcess, obs: dict[str, Any], timeout: float = RECV_TIMEOUT_S) -> dict[str, Any]:
    """One observation on a fresh connection; the reply map, or ``{"closed": code, "reason"}`` if the server closed."""
    try:
        with connection(server) as ws:
            return ask(ws, obs, timeout)
    except websockets.ConnectionClosed as exc:
        return {"closed": exc.rcvd.code if exc.rcvd else None, "reason": exc.rcvd.reason if exc.rcvd else ""}


def error_kind(reply: dict[str, Any]) -> str | None:
    return reply["error"]["kind"] if reply.get("type") == "error" else None


def counter(server: PolicyServerProcess, name: str, **labels: str) -> float:
    return server.metric(name, **labels) or 0.0


@contextlib.contextmanager
def frozen(pid: int) -> Iterator[None]:
    """SIGSTOP ``pid`` for the block; always SIGCONT on the way out."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)


def in_background(fn, *args: Any) -> tuple[threading.Thread, dict[str, Any]]:
    box: dict[str, Any] = {}

    def run() -> None:
        started = time.monotonic()
        try:
            box["reply"] = fn(*args)
        except BaseException as exc:  # noqa: BLE001 - the test thread reads it
            box["error"] = exc
        box["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


@pytest.fixture(scope="module")
def server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(tiny_checkpoint, *FAST, *NO_DRAIN) as s:
        yield s


# --- NaN actions ----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "key,value",
    [
        (JOINT_KEY, np.full(7, 3e38, np.float32)),
        (GRIPPER_KEY, np.full(1, -1e30, np.float32)),
    ],
    ids=["joints-3e38", "gripper-minus-1e30"],
)
def test_finite_but_huge_state_is_refused_not_answered_with_nan(server, key: str, value: np.ndarray) -> None:
    with connection(server) as ws:
        reply = ask(ws, observation(0, **{key: value}))
        assert "actions" not in reply, "a huge state must never come back as actions"
        assert error_kind(reply) == "invalid_observation" and key in reply["error"]["message"], reply
        good = ask(ws, observation())
    assert np.isfinite(good["actions"]).all()


@pytest.mark.slow  # its own server (an overflowing checkpoint); test_batching's NaN row is the fast case
def test_non_finite_actions_are_an_error_reply_counted_in_metrics(tmp_path_factory) -> None:
    """A checkpoint whose action scale overflows float32: the reply is an error, never inf or NaN actions."""
    overflowing = session_checkpoint(tmp_path_factory, action_std=[3.0e38] * 8)
    with serve_policy(overflowing, *FAST) as s:
        before = counter(s, ERRORS, kind="non_finite_actions")
        with connection(s) as ws:
            replies = [ask(ws, observation(seed)) for seed in range(2)]
        assert all("actions" not in r and error_kind(r) == "non_finite_actions" for r in replies), replies
        assert counter(s, ERRORS, kind="non_finite_actions") - before == 2
        assert s.readyz().status == 200, "the replica itself is fine; only those replies were bad"


# --- session_id ----------------------------------------------------------------------------------
def test_long_session_ids_are_refused_and_short_ones_stick(server) -> None:
    with connection(server) as ws:
        for length in (257, 64 << 10):
            reply = ask(ws, observation(0, **{SESSION_KEY: "s" * length}))
            assert error_kind(reply) == "invalid_observation", reply
            assert SESSION_KEY in reply["error"]["message"] and "256" in reply["error"]["message"]
            assert len(reply["error"]["message"]) < 300, "the message must not echo the id"
        # a string past the frame's structural limit (docs/protocol.md) is refused while the frame is decoded
        reply = ask(ws, observation(0, **{SESSION_KEY: "s" * (15 << 20)}))
        assert error_kind(reply) == "bad_frame" and "max_str_len" in reply["error"]["message"], reply
        assert len(reply["error"]["message"]) < 300, "the message must not echo the id"
        for session in ("é" * 128, 2**62, "robot-7"):  # 256 bytes of UTF-8, an int, a plain name
            reply = ask(ws, observation(0, **{SESSION_KEY: session}))
            assert np.isfinite(reply["actions"]).all(), reply
        reply = ask(ws, observation(0, **{SESSION_KEY: "é" * 129}))  # 258 bytes, 129 characters
        assert error_kind(reply) == "invalid_observation", reply


# --- serve flags ------------------------------------------------------------------------------------
def serve_cli(checkpoint: Path, *args: str, timeout: float = 45) -> subprocess.CompletedProcess[str]:
    """``policyserver serve`` expected to refuse before it starts anything: a hang fails the test."""
    argv = [str(VENV_BIN / "policyserver"), "serve", "--checkpoint", str(checkpoint), "--host", "127.0.0.1", *args]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=subprocess_env(), start_new_session=True
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
        pytest.fail(f"serve {' '.join(args)} was still running after {timeout}s:\n{out[-2000:]}\n{err[-2000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@pytest.mark.parametrize(
    "args,flag",
    [
        (["--heartbeat-s", "0"], "--heartbeat-s"),
        (["--heartbeat-s", "-1"], "--heartbeat-s"),
        (["--heartbeat-s", "nan"], "--heartbeat-s"),
        (["--port", "70000"], "--port"),
        (["--port", "-1"], "--port"),
        (["--pg-timeout-s", "0"], "--pg-timeout-s"),
        (["--drain-grace-s", "-1"], "--drain-grace-s"),
        (["--max-message-bytes", "0"], "--max-message-bytes"),
        (["--threads", "0"], "--threads"),
        (["--max-batch", "0"], "--max-batch"),
        (["--batch-window-ms", "-1"], "--batch-window-ms"),
        (["--gil-switch-ms", "0"], "--gil-switch-ms"),
        (["--gil-switch-ms", "inf"], "--gil-switch-ms"),
        (["--max-connections", "0"], "--max-connections"),
        (["--max-buffered-bytes", "1000"], "--max-buffered-bytes"),
        (["--frame-read-timeout-s", "0"], "--frame-read-timeout-s"),
        (["--latency-budget-ms", "0"], "--latency-budget-ms"),
        (["--latency-budget-ms", "nan"], "--latency-budget-ms"),
        (["--cfgp", "2", "--heartbeat-s", "0"], "--heartbeat-s"),
        # --frontend-processes N: each front-end takes a share of --max-buffered-bytes, so each share must admit a
        # largest message (--max-connections bounds their sessions together: any value of it will do)
        (["--frontend", "process", "--frontend-processes", "0"], "--frontend-processes must be in 1..16, got 0"),
        (["--frontend", "process", "--frontend-processes", "17"], "--frontend-processes must be in 1..16, got 17"),
        (["--frontend", "inline", "--frontend-processes", "2"], "--frontend-processes 2 needs --frontend process"),
        (
            ["--frontend", "process", "--frontend-processes", "4", "--max-message-bytes", "1000"]
            + ["--max-buffered-bytes", "3999"],
            "--max-buffered-bytes must be at least --max-message-bytes (1000) times --frontend-processes (4), got 3999",
        ),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_bad_serve_flags_are_one_line_and_exit_2(
    policyserver_main, tiny_checkpoint, args: list[str], flag: str
) -> None:
    res = policyserver_main("serve", "--checkpoint", str(tiny_checkpoint), "--host", "127.0.0.1", *args)
    assert res.returncode == ServeExit.LAYOUT, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("policyserver: error: ") and flag in lines[0], res.stderr[-3000:]
    assert "listening" not in res.stdout


@pytest.mark.parametrize(
    "args",
    [
        # one connection for the pod, whichever front-end it reaches: --max-connections is not split
        ["--frontend", "process", "--frontend-processes", "16", "--max-connections", "1"]
        + ["--max-message-bytes", "1000", "--max-buffered-bytes", "16000"],
        ["--frontend", "process", "--frontend-processes", "4", "--max-connections", "1"]
        + ["--max-message-bytes", "1000", "--max-buffered-bytes", "4000"],
        ["--frontend", "process", "--frontend-processes", "1", "--max-connections", "1"],
        ["--frontend", "inline", "--frontend-processes", "1"],
    ],
    ids=["16-at-every-bound", "4-at-every-bound", "process-1", "inline-1"],
)
def test_frontend_processes_at_their_bounds_are_accepted(args: list[str]) -> None:
    from policy_operator import serve_flags
    from tests.support.serve_options import parse_serve

    opts = parse_serve(["--checkpoint", "/nowhere", *args])
    serve_flags.check_values(opts)
    assert opts.frontend_processes == int(args[args.index("--frontend-processes") + 1])


@pytest.mark.parametrize("total,parts", [(1, 1), (10, 2), (33, 2), (7, 3), (5, 5), (64, 64), (100, 7), (256 << 20, 3)])
def test_split_evenly_adds_up_and_differs_by_at_most_one(total: int, parts: int) -> None:
    from policy_operator.runtime.rank0_front import split_evenly

    shares = split_evenly(total, parts)
    assert len(shares) == parts and sum(shares) == total
    assert max(shares) - min(shares) <= 1 and min(shares) >= 1
    assert shares == sorted(shares, reverse=True)  # the first front-ends take the remainder


@pytest.mark.parametrize("processes", [1, 2, 3, 7, 20])
def test_frontend_configs_give_each_process_its_share_and_a_ring_that_fits_it(processes: int) -> None:
    """The configuration ``worker.make_front`` builds (each front-end's ring follows from its share of the
    buffered bytes), split over ``processes`` front-ends; the connection limit is not split (the pod's, counted
    over all of them)."""
    from dataclasses import replace

    from policy_operator.layout import ParallelLayout
    from policy_operator.runtime import ipc
    from policy_operator.runtime.rank0_front import frontend_configs
    from policy_operator.runtime.serving.server import ServerConfig

    server = ServerConfig(
        "127.0.0.1",
        8000,
        1000,  # a slot: 1024 bytes (aligned)
        "dict",
        "t0ken",
        max_connections=33,
        max_buffered_bytes=20_000,  # 20 front-ends: 1000 each, one message, less than a 1024-byte slot
        frame_read_timeout_s=7.0,
    )
    config = ipc.FrontendConfig(server, ParallelLayout(cfgp=2, dp=1), 0.5, 30.0, "asyncio", 5.0, "info")
    configs = frontend_configs(config, processes)
    assert [c.index for c in configs] == list(range(processes))
    assert {c.processes for c in configs} == {processes}  # each knows how many share the session counts
    assert [c.server.max_connections for c in configs] == [33] * processes  # 20 front-ends, 33 for the pod
    buffered = [c.server.max_buffered_bytes for c in configs]
    assert sum(buffered) == 20_000 and max(buffered) - min(buffered) <= 1
    for c, share in zip(configs, buffered, strict=True):
        assert c.server.reuse_port is (processes > 1)  # one front-end binds the port as it always did
        assert (c.slots, c.slot_bytes) == ipc.ring_geometry(1000, share)
        assert 1 <= c.slots <= ipc.MAX_SLOTS and c.slot_bytes >= server.max_message_bytes  # a slot holds any frame
        # the ring fits the share; at least one slot, even where the share is less than an aligned slot
        assert c.slots * c.slot_bytes <= max(share, c.slot_bytes)
        # nothing else differs from the configuration split
        assert replace(c.server, max_buffered_bytes=20_000, reuse_port=False) == server
        assert replace(c, server=server, index=0, processes=1) == config


@pytest.mark.parametrize(
    "args,reuse_port",
    [([], False), (["--cfgp", "2"], False), (["--frontend", "process", "--frontend-processes", "2"], True)],
    ids=["1-rank", "cfgp2", "front-ends-against-reuseport"],
)
def test_a_port_in_use_is_refused_before_any_rank_starts(tiny_checkpoint, args: list[str], reuse_port: bool) -> None:
    """``reuse_port``: the port is held as a running server's front-ends hold it (SO_REUSEPORT), which a second
    server's front-ends would otherwise join, the kernel splitting the robots between two servers: the port
    check binds without it and refuses, as it refuses any port in use."""
    with socket.socket() as taken:
        if reuse_port:
            taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        res = serve_cli(tiny_checkpoint, "--port", str(port), *args)
    assert res.returncode == ServeExit.LAYOUT, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], res.stderr[-3000:]


# --- /readyz is public --------------------------------------------------------------------------
def test_readyz_shows_states_and_reasons_but_no_pids_or_paths(tiny_checkpoint) -> None:
    bodies: list[str] = []
    with serve_policy(tiny_checkpoint, *FAST, wait="listening") as s:

        def ready() -> bool:
            r = s.readyz()
            bodies.append(r.text)
            return r.status == 200

        wait_for(ready, timeout=90, interval=0.01, what="/readyz 200")
    for body in bodies:
        assert '"pid"' not in body, body
        assert str(tiny_checkpoint) not in body and "/tmp" not in body, body
    last = __import__("json").loads(bodies[-1])
    assert [r["state"] for r in last["ranks"]] in (["warm"], ["serving"]) and "detail" in last["ranks"][0]


def load_error_in_readyz(s: PolicyServerProcess) -> str:
    """Start a server whose checkpoint cannot load; the last ``error`` its /readyz gave before it exited."""
    seen: list[Any] = []

    def failed() -> bool:
        r = s.readyz()
        seen.append(r)
        return r.status == 503 and bool(r.json().get("error"))

    try:
        s.start(wait="listening")
        # the process exits soon after: what it answered before that is what counts
        with contextlib.suppress(TimeoutError, OSError, ServerExited):
            s.wait_until(failed, timeout=60, what="/readyz with the load error")
    finally:
        s.stop()
    errors = [r.json()["error"] for r in seen if r.status == 503 and r.json().get("error")]
    assert errors, [r.text for r in seen][-3:]
    return errors[-1]


@pytest.mark.slow  # a broken checkpoint's own server; the file:// source below is the fast case
def test_readyz_load_error_keeps_the_reason_without_the_path(tmp_path: Path, tiny_checkpoint) -> None:
    broken = tmp_path / "broken-checkpoint"
    broken.mkdir()
    (broken / "config.json").write_text((tiny_checkpoint / "config.json").read_text())
    error = load_error_in_readyz(PolicyServerProcess(broken, *FAST))
    assert "model.safetensors" in error and str(broken) not in error and "/tmp" not in error, error


def test_readyz_error_of_a_file_source_keeps_the_reason_without_the_path(tmp_path: Path) -> None:
    """``--checkpoint file:///...`` that is not there: /readyz (read by anyone) says why, not where."""
    missing = tmp_path / "nowhere" / "ckpt"
    error = load_error_in_readyz(
        PolicyServerProcess(f"file://{missing}", *FAST, "--cache-dir", str(tmp_path / "cache"))
    )
    assert "no such file or directory" in error, error
    assert str(missing) not in error and str(tmp_path) not in error and "/tmp" not in error, error
    assert "<checkpoint>" in error, error


# --- probes never wait on the store ---------------------------------------------------------------
@pytest.mark.slow
def test_probes_answer_while_the_torchrun_agent_is_frozen(tiny_checkpoint) -> None:
    """The agent hosts the TCPStore the heartbeats live in; freezing it must not freeze /readyz or the handshake."""
    with serve_policy(tiny_checkpoint, "--cfgp", "2", "--steps", "2", *RANKS) as s:
        stat = proc_stat(s.rank_pids()[0])
        assert stat is not None, "rank 0 is running"
        agent = stat[0]  # the ranks' parent: torchrun's agent
        with frozen(agent):
            time.sleep(1.0)  # past the staleness bound: heartbeats cannot be published now
            t0 = time.monotonic()
            ready = s.get("/readyz", timeout=5)
            health = s.get("/healthz", timeout=5)
            with connect(s.url, compression=None, open_timeout=5) as ws:
                meta = msgpack_numpy.unpackb(ws.recv(timeout=5))
            elapsed = time.monotonic() - t0
        assert ready.status == 503 and health.status == 200 and "policy_name" in meta
        assert elapsed < 6, elapsed
        assert all(not r["ready"] for r in ready.json()["ranks"]), ready.text
        s.wait_until(lambda: s.readyz().status == 200, timeout=30, what="/readyz 200 after SIGCONT")
        assert np.isfinite(request(s, observation())["actions"]).all()


# --- a failed communicator is never reused; every in-request wait is bounded ------------------------
@pytest.mark.slow
def test_cfg_peer_frozen_past_the_pg_timeout_fails_the_replica_instead_of_serving_errors(tiny_checkpoint) -> None:
    with serve_policy(tiny_checkpoint, "--cfgp", "2", "--steps", "600", "--pg-timeout-s", "3", *RANKS) as s:
        peer = s.rank_pids()[1]
        thread, box = in_background(request, s, observation())
        s.wait_until(lambda: s.readyz().json()["in_flight"] == 1, timeout=30, what="the request in flight")
        statuses: list[int | None] = []
        with frozen(peer):
            thread.join(3 + 10)  # the driver's collective times out after --pg-timeout-s
            assert not thread.is_alive(), "the in-flight request waited past the PG timeout"
            with contextlib.suppress(OSError):
                statuses.append(s.readyz().status)
        reply = box.get("reply", {})
        kind = error_kind(reply)
        assert "actions" not in reply and (kind in ("replica_failed", "replica_unavailable") or reply.get("closed")), (
            box
        )

        def gone() -> bool:
            try:
                statuses.append(s.readyz().status)
            except OSError:
                statuses.append(None)
            return not s.alive

        wait_for(gone, timeout=60, interval=0.1, what="the pod's ranks to exit after the failed collective")
        assert s.returncode != 0
        assert 200 not in statuses, statuses
        log = s.log_text()
        assert "collective" in log and "exiting" in log, s.log_tail()


@pytest.mark.slow
def test_a_request_handed_to_a_frozen_cfg_peer_fails_the_replica_within_the_pg_timeout(tiny_checkpoint) -> None:
    """The peer freezes before its driver hands it a request: the hand-over is bounded by --pg-timeout-s.

    Two-second heartbeats keep the frozen peer looking warm for three seconds, so the request is routed to it
    every time; the driver must give up on the hand-over after the PG timeout and take the pod down (exit 5).
    """
    pg_timeout_s = 2
    args = ["--cfgp", "2", "--steps", "2", "--pg-timeout-s", str(pg_timeout_s), "--heartbeat-s", "2"]
    with serve_policy(tiny_checkpoint, *args, "--threads", "1", "--error-format", "dict") as s:
        peer = s.rank_pids()[1]
        statuses: list[int | None] = []
        errors: list[str] = []

        def readyz() -> None:
            try:
                r = s.readyz()
            except OSError:
                statuses.append(None)
                return
            statuses.append(r.status)
            if r.status == 503 and r.json().get("error"):
                errors.append(r.json()["error"])

        with connection(s) as ws, frozen(peer):
            t0 = time.monotonic()
            ws.send(msgpack_numpy.packb(observation()))
            reply = msgpack_numpy.unpackb(ws.recv(timeout=pg_timeout_s + 10))
            elapsed = time.monotonic() - t0

            def polled_errors() -> list[str]:
                readyz()
                return errors

            wait_for(polled_errors, timeout=10, interval=0.1, what="/readyz with the failure")
        assert error_kind(reply) == "replica_failed" and "actions" not in reply, reply
        assert pg_timeout_s - 0.5 < elapsed < pg_timeout_s + 5, elapsed
        assert "replica 0 failed" in errors[-1] and "collective" in errors[-1], errors

        def gone() -> bool:
            readyz()
            return not s.alive

        wait_for(gone, timeout=60, interval=0.1, what="the pod to exit after the failed hand-over")
        assert s.returncode != 0 and 200 not in statuses, (s.returncode, statuses)
        assert "rank 0 exiting 5" in s.log_text(), s.log_tail()


@pytest.mark.slow
def test_a_stale_replica_gets_no_work_and_the_wait_is_bounded(tiny_checkpoint) -> None:
    """cfgp=2: the idle cfg peer is frozen; a request must not wait for it to come back."""
    with serve_policy(tiny_checkpoint, "--cfgp", "2", "--steps", "2", "--pg-timeout-s", "3", *RANKS) as s:
        peer = s.rank_pids()[1]
        with frozen(peer):
            s.wait_until(lambda: s.readyz().status == 503, timeout=10, what="/readyz 503 with the peer frozen")
            t0 = time.monotonic()
            reply = request(s, observation(), timeout=30)
            elapsed = time.monotonic() - t0
            time.sleep(1)
        assert elapsed < 3 + 3, f"the request waited {elapsed:.1f}s for a frozen peer"
        assert "actions" not in reply and (error_kind(reply) or reply.get("closed")), reply
        s.wait_until(lambda: s.readyz().status == 200, timeout=30, what="/readyz 200 after SIGCONT")
        assert np.isfinite(request(s, observation())["actions"]).all()


@pytest.mark.slow
def test_in_flight_request_on_a_frozen_replica_fails_and_others_serve(tiny_checkpoint) -> None:
    """dp=2: replica 1's driver freezes mid-request; that request fails with a clear kind, replica 0 keeps serving."""
    with serve_policy(tiny_checkpoint, "--dp", "2", "--steps", "600", "--pg-timeout-s", "3", *RANKS) as s:
        remote = s.rank_pids()[1]
        with connection(s) as ws:  # occupy replica 0 first, so the next request lands on replica 1
            ws.send(msgpack_numpy.packb(observation(1)))
            s.wait_until(lambda: s.readyz().json()["in_flight"] == 1, timeout=30, what="replica 0 busy")
            thread, box = in_background(request, s, observation(2))
            s.wait_until(lambda: s.readyz().json()["in_flight"] == 2, timeout=30, what="replica 1 busy")
            with frozen(remote):
                thread.join(3 + 10)
                assert not thread.is_alive(), "the request on the frozen replica waited past the PG timeout"
                first = msgpack_numpy.unpackb(ws.recv(timeout=120))
                again = request(s, observation(3), timeout=120)
        reply = box.get("reply", {})
        assert error_kind(reply) == "replica_unavailable", box
        assert first["server_timing"]["replica"] == 0 and again["server_timing"]["replica"] == 0, (first, again)
        s.wait_until(lambda: s.readyz().status == 200, timeout=60, what="/readyz 200 after SIGCONT")
