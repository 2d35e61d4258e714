"""The cfgp x dp runtime under real torchrun processes (CPU, gloo), on 127.0.0.1.

Each scenario is a failure mode a multi-rank server is prone to, or a guarantee:
identical actions in every layout; a bad request with cfgp=2 leaves both ranks
alive (the driver must validate before its peer waits on a collective); idling
past the process-group timeout is harmless (idle ranks must not sit in a
collective); a dead or frozen rank flips /readyz; SIGTERM drains; rank 0's
death ends every rank.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.sync.client import connect

from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.serving import wire
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.net import wait_for
from tests.support.servers import PolicyServerProcess, proc_stat, serve_policy, subprocess_env

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
# Only tests/support on the ranks' path: the repo root would shadow the stdlib `operator` module.
ENV = {"PYTHONPATH": str(REPO / "tests" / "support")}
FAULTY = ["--policy", "faulty_policy:FaultyPolicy"]
COMMON = ["--threads", "1", "--steps", "4", "--heartbeat-s", "0.5", "--log-level", "INFO"]


def request(
    url: str, seed: int | None = 11, prompt: str = "pick up the cup", session: str | None = None, **extra
) -> dict | str:
    """One observation on a fresh connection; the decoded reply, or the error text frame."""
    with connect(url, compression=None, open_timeout=30) as ws:
        meta = wire.unpackb(ws.recv(timeout=30))
        obs = robolab_observation(meta, 3, fixed_seed=seed)
        obs["prompt"] = prompt
        if session is not None:
            obs["session_id"] = session
        obs.update(extra)
        ws.send(wire.packb(obs))
        reply = ws.recv(timeout=120)
        return reply if isinstance(reply, str) else wire.unpackb(reply)


def answered(url: str, **kwargs: Any) -> dict[str, Any]:
    """``request`` for one that must be answered, not refused with an error text frame."""
    reply = request(url, **kwargs)
    assert isinstance(reply, dict), reply
    return reply


def rank_pids(server: PolicyServerProcess) -> dict[int, int]:
    return server.rank_pids()  # from the processes: /readyz publishes no PIDs


def alive(pid: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and Path(f"/proc/{pid}/status").read_text().find("State:\tZ") < 0


LAYOUTS = [(1, 1), (2, 1), (1, 2), (2, 2)]


@pytest.fixture(scope="module")
def layout_actions(tiny_checkpoint):
    """Actions for one fixed seed from every layout, plus what each server showed while serving."""
    out = {}
    for cfgp, dp in LAYOUTS:
        with serve_policy(tiny_checkpoint, "--cfgp", str(cfgp), "--dp", str(dp), *COMMON) as server:
            ready = server.readyz().json()
            first = request(server.url, seed=42)
            # two concurrent requests, same seed: on dp=2 they run on different replicas
            replies: list = []

            def ask(url=server.url, replies=replies):
                replies.append(request(url, seed=42))

            threads = [threading.Thread(target=ask) for _ in range(2)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
            # a session sticks within its connection (a session is its connection's: docs/protocol.md, "Sessions")
            with connect(server.url, compression=None, open_timeout=30) as ws:
                meta = wire.unpackb(ws.recv(timeout=30))
                sticky = []
                for _ in range(3):
                    ws.send(wire.packb({**robolab_observation(meta, 3, fixed_seed=1), "session_id": "robot-7"}))
                    sticky.append(wire.unpackb(ws.recv(timeout=120))["server_timing"]["replica"])
            out[(cfgp, dp)] = {
                "ready": ready,
                "first": first,
                "pair": replies,
                "sticky": sticky,
                "pids": rank_pids(server),
            }
    return out


@pytest.mark.parametrize("cfgp,dp", LAYOUTS)
def test_same_seed_same_actions_in_every_layout(layout_actions, cfgp: int, dp: int) -> None:
    got = layout_actions[(cfgp, dp)]
    reference = np.asarray(layout_actions[(1, 1)]["first"]["actions"])
    actions = np.asarray(got["first"]["actions"])
    assert actions.dtype == np.float32 and actions.shape == reference.shape
    # Same batch-1 kernels at one thread per rank: bitwise equal, not merely close.
    assert np.array_equal(actions, reference), np.abs(actions - reference).max()
    for reply in got["pair"]:  # on one replica the pair may share a batch: then equal within the batching tolerance
        pair = np.asarray(reply["actions"])
        if reply["server_timing"]["batch_size"] == 1:
            assert np.array_equal(pair, reference)
        else:
            assert float(np.abs(pair - reference).max()) <= 1e-5
    ready = got["ready"]
    assert ready["ready"] and ready["ranks_ready"] == cfgp * dp == ready["world_size"]
    assert sorted((r["dp_index"], r["cfg_index"]) for r in ready["ranks"]) == [
        (d, c) for d in range(dp) for c in range(cfgp)
    ]
    assert len(set(got["pids"].values())) == cfgp * dp  # one process per rank


@pytest.mark.parametrize("cfgp,dp", [(1, 2), (2, 2)])
def test_dp_replicas_serve_concurrent_requests_and_sessions_stick(layout_actions, cfgp: int, dp: int) -> None:
    got = layout_actions[(cfgp, dp)]
    assert sorted(r["server_timing"]["replica"] for r in got["pair"]) == [0, 1]
    assert len(set(got["sticky"])) == 1


def test_batched_cfg_matches_within_bound(tiny_checkpoint, layout_actions) -> None:
    with serve_policy(tiny_checkpoint, "--cfg-mode", "batched", *COMMON) as server:
        batched = np.asarray(answered(server.url, seed=42)["actions"])
    reference = np.asarray(layout_actions[(1, 1)]["first"]["actions"])
    # batch-2 GEMMs reduce in another order: documented bound in docs/architecture.md
    np.testing.assert_allclose(batched, reference, rtol=0, atol=1e-4)


@pytest.mark.parametrize("cfgp,dp", [(2, 1), (1, 2)])
def test_failed_request_leaves_every_rank_alive(tiny_checkpoint, cfgp: int, dp: int) -> None:
    with serve_policy(tiny_checkpoint, "--cfgp", str(cfgp), "--dp", str(dp), *FAULTY, *COMMON, env=ENV) as server:
        pids = rank_pids(server)
        good = request(server.url)
        assert isinstance(good, dict)
        bad = [
            request(server.url, prompt=123),  # type: ignore[arg-type]  # invalid: refused on rank 0 before any broadcast
            request(server.url, prompt="explode:cond"),  # fails inside the driver's branch
            request(server.url, prompt="explode:cond"),  # (dp=2: the other replica gets one too)
        ]
        if cfgp == 2:
            bad.append(request(server.url, prompt="explode:uncond"))  # fails on the peer rank only
        for reply in bad:
            assert isinstance(reply, str), reply
        assert isinstance(bad[0], str) and bad[0].startswith("invalid_observation:") and "'prompt'" in bad[0]
        assert all("planted failure" in r or "cfg rank" in r for r in bad[1:]), bad
        for _ in range(dp):
            again = answered(server.url)
            assert np.array_equal(np.asarray(again["actions"]), np.asarray(good["actions"]))
        assert rank_pids(server) == pids and all(alive(p) for p in pids.values())
        assert server.readyz().status == 200
        assert server.alive


def test_idle_longer_than_the_pg_timeout(tiny_checkpoint) -> None:
    with serve_policy(tiny_checkpoint, "--cfgp", "2", "--pg-timeout-s", "2", *COMMON) as server:
        pids = rank_pids(server)
        first = answered(server.url)
        time.sleep(4)  # idle for twice the collective timeout: ranks wait on the long-timeout gloo group
        second = answered(server.url)
        assert np.array_equal(np.asarray(first["actions"]), np.asarray(second["actions"]))
        assert rank_pids(server) == pids and server.readyz().status == 200


def test_frozen_rank_flips_readyz_within_two_periods(tiny_checkpoint) -> None:
    with serve_policy(tiny_checkpoint, "--dp", "2", *COMMON) as server:
        pid = rank_pids(server)[1]
        os.kill(pid, signal.SIGSTOP)
        try:
            stale = server.wait_until(
                lambda: (r := server.readyz()).status == 503 and r.json(),
                timeout=2 * 0.5 + 3.0,
                what="/readyz 503 after SIGSTOP",
            )
        finally:
            os.kill(pid, signal.SIGCONT)
        rank1 = next(r for r in stale["ranks"] if r["rank"] == 1)
        assert rank1["state"] == "stale" and not rank1["ready"]
        assert stale["ranks_ready"] == 1
        server.wait_until(lambda: server.readyz().status == 200, timeout=10, what="/readyz 200 after SIGCONT")


def test_killed_rank_flips_readyz_and_launcher_exits_nonzero(tiny_checkpoint) -> None:
    with serve_policy(tiny_checkpoint, "--cfgp", "2", *COMMON) as server:
        pids = rank_pids(server)
        os.kill(pids[1], signal.SIGKILL)
        statuses: list[int | None] = []

        def seen_503() -> bool:
            try:
                statuses.append(server.readyz().status)
            except OSError:
                statuses.append(None)
            return 503 in statuses

        wait_for(seen_503, timeout=20, interval=0.02, what="/readyz 503 after SIGKILL of rank 1")
        code = server.wait_exit(timeout=40)
        assert code != 0
        wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=20, what="every rank gone")


def test_rank0_death_ends_every_rank(tiny_checkpoint) -> None:
    with serve_policy(tiny_checkpoint, "--cfgp", "2", "--dp", "2", *COMMON) as server:
        pids = rank_pids(server)
        os.kill(pids[0], signal.SIGKILL)
        assert server.wait_exit(timeout=40) != 0
        wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=20, what="no rank holds on")


def test_sigterm_drains_the_request_in_flight(tiny_checkpoint) -> None:
    args = ["--cfgp", "2", "--threads", "1", "--steps", "600", "--heartbeat-s", "0.5", "--drain-grace-s", "20"]
    with serve_policy(tiny_checkpoint, *args) as server:
        pids = rank_pids(server)
        box: list = []
        worker = threading.Thread(target=lambda: box.append(request(server.url)))
        worker.start()
        server.wait_until(lambda: server.readyz().json()["in_flight"] == 1, timeout=30, what="request in flight")
        server.send_signal(signal.SIGTERM)  # to torchrun, as kubelet does to the container
        worker.join(120)
        assert box and isinstance(box[0], dict), box
        assert np.asarray(box[0]["actions"]).shape == (16, 8)
        server.wait_exit(timeout=60)
        log = server.log_text()
        for rank in pids:
            assert f"rank {rank} exiting 0" in log, server.log_tail()
        assert "rank 0 exiting 0 (drained)" in log
        wait_for(lambda: not any(alive(p) for p in pids.values()), timeout=20, what="ranks gone")


def test_mismatched_world_size_fails_before_loading(tiny_checkpoint) -> None:
    """Started by hand under torchrun with the wrong --nproc-per-node: one line per rank, no model load."""
    cmd = [
        str(Path(sys.executable).parent / "torchrun"),
        "--standalone",
        "--nproc-per-node=3",
        "--max-restarts=0",
        "-m",
        "policy_operator.runtime.worker",
        "--checkpoint",
        str(tiny_checkpoint),
        "--cfgp",
        "2",
        "--dp",
        "1",
        "--port",
        "0",
        "--host",
        "127.0.0.1",
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert proc.returncode != 0
    lines = [ln for ln in proc.stderr.splitlines() if ln.startswith("policyserver: error:")]
    # every rank that got to speak says the same one line (torchrun stops the rest after the first exit)
    assert lines and all("world size 3 does not match cfgp x dp = 2 x 1" in ln for ln in lines), proc.stderr[-2000:]
    assert "listening" not in proc.stdout and "loading" not in proc.stderr


def test_only_rank0_downloads_a_source_checkpoint(tiny_checkpoint, tmp_path: Path, layout_actions) -> None:
    """Started with a URL instead of a volume: global rank 0 fetches once, the other ranks wait for its path."""
    root = tmp_path / "srv"
    shutil.copytree(tiny_checkpoint, root / "ckpt")
    cache = tmp_path / "cache"
    with CheckpointServer(root) as http:
        url = http.url_for("ckpt/")
        with serve_policy(url, "--cfgp", "2", "--dp", "2", "--cache-dir", str(cache), *COMMON) as server:
            actions = np.asarray(answered(server.url, seed=42)["actions"])
        # four ranks, one download: every file of the checkpoint was fetched exactly once
        paths = sorted(r.path for r in http.requests if r.method == "GET")
        assert paths == sorted(f"/ckpt/{p.name}" for p in (root / "ckpt").iterdir()), paths
    assert np.array_equal(actions, np.asarray(layout_actions[(1, 1)]["first"]["actions"]))
    fetched = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(fetched) == 1 and (fetched[0] / ".complete.json").is_file()
