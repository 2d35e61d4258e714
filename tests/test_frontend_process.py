"""``--frontend process``: the WebSocket server, decoding and prepare in a child of rank 0, end to end.

The behaviours a robot and a pod rely on, on real ``policyserver serve``
processes: metadata and actions bit for bit what ``--frontend inline`` answers
for the same seed (with the policy's ``Preprocessor`` in the front-end, and a
plug-in that prepares in the model process), per-request errors, auth,
metrics, batching across sessions, real-time chunking's per-connection memory,
readiness across ranks (a frozen rank, a frozen model process), and that
neither process outlives the other.  Draining with 1001 is
``tests/test_drain.py``, run in both modes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import shutil
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from policy_operator.constants import ENV_PROMETHEUS_MULTIPROC_DIR, METRICS_PATH
from policy_operator.exit_codes import ServeExit
from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from policy_operator.runtime.policy.sampler import batch_buckets
from policy_operator.runtime.serving import wire
from policy_operator.runtime.serving.server import GOING_AWAY
from tests.support.net import wait_for
from tests.support.openpi import OpenpiSession
from tests.support.plugins.held_policy import hold_prompt
from tests.support.servers import (
    NO_DRAIN,
    PolicyServerProcess,
    descendants,
    parse_metrics,
    proc_stat,
    serve_policy,
)

CFG = PolicyConfig()
STEPS = ["--steps", "2"]
PROCESS = ["--frontend", "process"]
TOKEN = "fr0nt-token"

pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")


def observation(variant: int = 0, **changes: Any) -> dict[str, Any]:
    obs = example_observation(CFG, variant)
    obs.update(changes)
    return obs


def client(server: PolicyServerProcess, api_key: str | None = None) -> OpenpiSession:
    return OpenpiSession(server.url, api_key=api_key)


def actions(server: PolicyServerProcess, obs: dict[str, Any]) -> np.ndarray:
    with client(server) as c:
        return c.infer(obs)["actions"]


def frontend_pids(server: PolicyServerProcess) -> list[int]:
    """The front-end children (descendants whose command line runs serving.frontend), oldest first: in the order
    rank 0 started them, their ``--frontend-processes`` index (on ``--port 0`` the others follow the first)."""
    found: list[tuple[int, int]] = []
    for pid, start in descendants(server.pid).items():
        with contextlib.suppress(OSError):
            if b"policy_operator.runtime.serving.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append((start, pid))
    return [pid for _, pid in sorted(found)]


def frontend_pid(server: PolicyServerProcess) -> int:
    """The front-end child of a server with one."""
    pids = frontend_pids(server)
    if not pids:
        raise AssertionError("no front-end process")
    assert len(pids) == 1, f"{len(pids)} front-end processes: {pids}"
    return pids[0]


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def metrics_dir(pid: int) -> Path:
    """The front-end's ``PROMETHEUS_MULTIPROC_DIR`` (rank 0's temporary folder, shared by every front-end)."""
    environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    values = [v.split(b"=", 1)[1] for v in environ if v.startswith(ENV_PROMETHEUS_MULTIPROC_DIR.encode() + b"=")]
    assert len(values) == 1, f"front-end {pid} has no {ENV_PROMETHEUS_MULTIPROC_DIR}"
    return Path(values[0].decode())


@pytest.fixture(scope="module")
def inline(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(tiny_checkpoint, *STEPS, "--error-format", "dict", *NO_DRAIN) as s:
        yield s


@pytest.fixture(scope="module")
def process(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS, "--error-format", "dict", "--rtc", "inpaint", *NO_DRAIN) as s:
        yield s


def test_metadata_and_actions_are_bitwise_those_of_inline(
    inline: PolicyServerProcess, process: PolicyServerProcess
) -> None:
    with client(inline) as a, client(process) as b:
        meta_a, meta_b = a.get_server_metadata(), b.get_server_metadata()
        assert {k: v for k, v in meta_a.items() if k != "rtc"} == {k: v for k, v in meta_b.items() if k != "rtc"}
        for variant, seed in ((0, 7), (3, 123), (5, 2**40)):
            obs = observation(variant, seed=seed)
            assert a.infer(obs)["actions"].tobytes() == b.infer(obs)["actions"].tobytes()
        timing = b.infer(observation(1))["server_timing"]
    assert timing["replica"] == 0 and timing["infer_ms"] > 0 and timing["decode_ms"] > 0
    assert "front-end process" in process.log_text()


@pytest.mark.slow  # a two-process server of its own
def test_a_plugin_without_preprocessor_prepares_in_the_model_process(
    inline: PolicyServerProcess, tiny_checkpoint: Path
) -> None:
    """HeldPolicy overrides ``prepare``: the reference's preprocessor must not stand in for it."""
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS, "--policy", "held_policy:HeldPolicy") as held:
        obs = observation(2, seed=99)
        assert actions(held, obs).tobytes() == actions(inline, obs).tobytes()


def test_per_request_errors_keep_the_session(process: PolicyServerProcess) -> None:
    with connect(process.url, compression=None, open_timeout=30) as ws:
        ws.recv(timeout=30)
        for frame, kind in (
            (b"\xc1garbage", "bad_frame"),
            (wire.packb({"prompt": "no images, no state"}), "invalid_observation"),
            (wire.packb(observation(0, rtc={"executed": 2, "inference_delay": 1})), "rtc_no_previous_chunk"),
        ):
            ws.send(frame)
            reply = wire.unpackb(ws.recv(timeout=30))
            assert reply["type"] == "error" and reply["error"]["kind"] == kind, reply
        ws.send(wire.packb(observation(0, seed=1)))
        first = np.asarray(wire.unpackb(ws.recv(timeout=30))["actions"])
        # the short rtc form refers to this connection's last chunk, kept by the front-end
        ws.send(wire.packb(observation(0, seed=2, rtc={"executed": 4, "inference_delay": 3})))
        second = np.asarray(wire.unpackb(ws.recv(timeout=30))["actions"])
    assert second.shape == first.shape
    assert second[:3].tobytes() == first[4:7].tobytes()  # the frozen actions, bit for bit
    assert (process.metric("policy_request_errors_total", kind="bad_frame") or 0.0) >= 1


@pytest.mark.slow  # a two-process server of its own
def test_text_error_format_closes_with_1011(tiny_checkpoint: Path, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKEN)
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS, "--auth-token-file", str(token)) as server:
        with pytest.raises(InvalidStatus) as refused:
            connect(server.url, open_timeout=10)
        assert refused.value.response.status_code == 401
        assert server.readyz().status == 200  # probes stay open
        headers = {"Authorization": f"Bearer {TOKEN}"}
        with connect(server.url, compression=None, open_timeout=30, additional_headers=headers) as ws:
            ws.recv(timeout=30)
            ws.send(wire.packb({"prompt": "no images"}))
            text = ws.recv(timeout=30)
            assert isinstance(text, str) and text.startswith("invalid_observation")
            with pytest.raises(ConnectionClosed) as closed:
                ws.recv(timeout=30)
            assert closed.value.rcvd is not None and closed.value.rcvd.code == 1011
        with client(server, api_key=TOKEN) as c:
            assert c.infer(observation(1))["actions"].shape == (CFG.horizon, CFG.action_dim)
        assert server.metric("policy_request_errors_total", kind="unauthorized") == 1


def test_sessions_batch_and_metrics_count_them(process: PolicyServerProcess) -> None:
    before = process.metric("policy_batch_size_count", replica="0") or 0.0
    requests_before = process.metric("policy_requests_total", replica="0") or 0.0
    sizes: list[int] = []
    errors: list[BaseException] = []

    def robot(i: int) -> None:
        try:
            with client(process) as c:
                for k in range(6):
                    sizes.append(c.infer(observation(i, seed=k))["server_timing"]["batch_size"])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=robot, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    assert len(sizes) == 24 and max(sizes) > 1, sizes  # sessions share batches across the process boundary
    assert (process.metric("policy_requests_total", replica="0") or 0.0) - requests_before == 24
    batches = (process.metric("policy_batch_size_count", replica="0") or 0.0) - before
    assert 0 < batches < 24
    assert (process.metric("policy_load_seconds") or 0.0) > 0
    doc = process.readyz().json()
    assert doc["ready"] and doc["ranks_ready"] == 1 and doc["in_flight"] == 0
    assert doc["max_batch"] >= 1 and "batch_buckets_ms" not in doc  # no --latency-budget-ms: nothing measured


def test_metrics_has_every_series_inline_has(inline: PolicyServerProcess, process: PolicyServerProcess) -> None:
    """A series the dashboard reads exists in both modes from the first scrape: a multiprocess gauge that keeps
    the most recent writer's value has no sample until a process sets one (the checkpoint's download bytes of a
    server that downloads nothing read "no data" under --frontend process, 0 inline)."""
    # (``_created`` timestamps are not kept by prometheus_client's multiprocess files)
    names = [{name for name, _ in server.metrics() if not name.endswith("_created")} for server in (inline, process)]
    assert names[0] - names[1] == set()


@pytest.mark.slow  # a two-process server of its own (256 x 256 chunks)
def test_large_replies_and_rtc_tails_cross_both_ways_at_once(tmp_path_factory: pytest.TempPathFactory) -> None:
    """256 x 256 action chunks (256 kB per reply, more than a socket buffer) to several robots at once, while
    their requests carry 256 kB ``rtc`` tails the other way: neither process ever blocks on the other."""
    from tests.support.servers import session_checkpoint

    checkpoint = session_checkpoint(tmp_path_factory, horizon=256, action_dim=256)
    args = [*STEPS, *PROCESS, "--threads", "1", "--rtc", "inpaint", "--max-batch", "4"]
    with serve_policy(checkpoint, *args) as server:
        errors: list[BaseException] = []

        def robot(i: int) -> None:
            try:
                with connect(server.url, compression=None, max_size=None, open_timeout=30) as ws:
                    meta = wire.unpackb(ws.recv(timeout=30))
                    assert tuple(meta["action_shape"]) == (256, 256)
                    prev: np.ndarray = np.zeros((256, 256), dtype=np.float32)
                    for k in range(4):
                        obs = observation(i, seed=k, rtc={"prev_actions": prev, "inference_delay": 2})
                        ws.send(wire.packb(obs))
                        reply = wire.unpackb(ws.recv(timeout=120))
                        got = np.asarray(reply["actions"])
                        assert got.shape == (256, 256) and got[:2].tobytes() == prev[:2].tobytes(), reply
                        prev = got
            except BaseException as exc:  # noqa: BLE001 - reported below
                errors.append(exc)

        threads = [threading.Thread(target=robot, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(300)
        assert not errors, errors
        assert server.alive and server.readyz().status == 200


@pytest.mark.slow  # fault injection on a server of its own
def test_a_killed_model_process_takes_the_frontend_down(tiny_checkpoint: Path) -> None:
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS) as server:
        front = frontend_pid(server)
        folder = metrics_dir(front)
        try:
            server.send_signal(signal.SIGKILL)  # rank 0 (one rank: serve itself)
            wait_for(lambda: gone(front), timeout=10, interval=0.05, what="the front-end to exit")
            with pytest.raises(OSError):
                connect(server.url, open_timeout=3)
        finally:
            shutil.rmtree(folder, ignore_errors=True)  # a killed rank 0 cannot remove it


@pytest.mark.slow  # fault injection on a server of its own
def test_a_killed_frontend_takes_rank_0_down(tiny_checkpoint: Path) -> None:
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS) as server:
        front = frontend_pid(server)
        folder = metrics_dir(front)
        try:
            os.kill(front, signal.SIGKILL)
            assert server.wait_exit(timeout=20) == ServeExit.FRONTEND, server.log_tail()
            assert "the front-end process exited" in server.log_text()
            assert not folder.exists()  # in memory (/dev/shm): rank 0 removes it even when it exits at once
        finally:
            shutil.rmtree(folder, ignore_errors=True)


@pytest.mark.slow  # fault injection on a server of its own
def test_a_frozen_model_process_is_not_ready(tiny_checkpoint: Path) -> None:
    """The front-end answers /readyz itself; a model process that stopped pushing readiness reads 503."""
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS, "--heartbeat-s", "0.5") as server:
        assert server.readyz().status == 200
        server.send_signal(signal.SIGSTOP)
        try:
            wait_for(lambda: server.readyz().status == 503, timeout=10, interval=0.1, what="/readyz 503")
            assert "no readiness" in server.readyz().json()["error"]
        finally:
            server.send_signal(signal.SIGCONT)
        wait_for(lambda: server.readyz().status == 200, timeout=10, interval=0.1, what="/readyz 200 again")
        assert actions(server, observation(1)).shape == (CFG.horizon, CFG.action_dim)


@pytest.mark.slow  # a two-process server of its own that measures every bucket
def test_a_latency_budget_reaches_readyz_through_the_model_process(tiny_checkpoint: Path) -> None:
    """The front-end serves /readyz from the model process's snapshots: under --latency-budget-ms they carry
    warm-up's time of every bucket (the times /metrics shows) and the max batch the lanes form."""
    args = [*STEPS, *PROCESS, "--max-batch", "4", "--latency-budget-ms", "60000", "--threads", "1"]
    with serve_policy(tiny_checkpoint, *args) as server:
        doc = server.readyz().json()
        assert doc["ready"] and doc["max_batch"] == 4, doc  # a minute fits every bucket
        buckets = {int(size): ms for size, ms in doc["batch_buckets_ms"].items()}
        assert sorted(buckets) == list(batch_buckets(4)), doc
        for size, ms in buckets.items():
            seconds = server.metric("policy_batch_bucket_seconds", replica="0", bucket=str(size))
            assert seconds is not None and ms == pytest.approx(seconds * 1e3, abs=1e-3)


@pytest.mark.slow
def test_readiness_across_ranks_and_sigterm(tiny_checkpoint: Path) -> None:
    """cfgp=2 under torchrun: every rank in /readyz, a frozen cfg peer makes it 503, SIGTERM drains and exits 0."""
    args = ["--cfgp", "2", "--threads", "1", *STEPS, *PROCESS, "--heartbeat-s", "0.5", "--drain-grace-s", "30"]
    with serve_policy(tiny_checkpoint, *args) as server:
        ranks = server.rank_pids()
        assert sorted(ranks) == [0, 1] and frontend_pid(server) not in ranks.values()
        doc = server.readyz().json()
        assert doc["ready"] and [r["rank"] for r in doc["ranks"]] == [0, 1]
        obs = observation(4, seed=5)
        served = actions(server, obs)
        import os

        os.kill(ranks[1], signal.SIGSTOP)
        try:
            wait_for(lambda: server.readyz().status == 503, timeout=10, interval=0.1, what="/readyz 503")
            assert server.readyz().json()["ranks"][1]["state"] == "stale"
        finally:
            os.kill(ranks[1], signal.SIGCONT)
        wait_for(lambda: server.readyz().status == 200, timeout=10, interval=0.1, what="/readyz 200 again")
        assert actions(server, obs).tobytes() == served.tobytes()
        started = time.monotonic()
        server.send_signal(signal.SIGTERM)
        assert server.wait_exit(timeout=60) == 0, server.log_tail()
        assert time.monotonic() - started < 25
        assert "rank 0 exiting 0 (drained)" in server.log_text()


# --- --frontend-processes 2: two front-ends on one port ------------------------------------------------------
# One port, two listening sockets (SO_REUSEPORT): the kernel hashes each connection's addresses to one of them, so
# a test finds out which front-end took a connection from /proc, by the server-side socket's inode.
TWO = [*STEPS, *PROCESS, "--frontend-processes", "2", "--threads", "1", "--max-batch", "4"]
ROBOTS = 16  # all 16 on one front-end of two: 2 * 2**-16 = 2**-15
REQUESTS = 2  # per robot
# the pod's limit, over both front-ends' sessions: room for every robot; odd, so /metrics that summed the two
# front-ends' values (66) or halved it would show
MAX_CONNECTIONS = 2 * ROBOTS + 1
TCP_ESTABLISHED, TCP_LISTEN = "01", "0A"  # /proc/net/tcp's st column
PICK_TRIES = 40  # connections opened until each front-end has one: all 40 on one of two is 2 * 2**-40


@pytest.fixture(scope="module")
def two_fronts(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    args = [*TWO, "--max-connections", str(MAX_CONNECTIONS), "--error-format", "dict", *NO_DRAIN]
    with serve_policy(tiny_checkpoint, *args) as s:
        yield s


def tcp_sockets(port: int, state: str) -> dict[int, int]:
    """{inode: remote port} of the IPv4 TCP sockets in ``state`` whose local port is ``port`` (this network
    namespace's, the server's: 127.0.0.1 only)."""
    found = {}
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local, remote, st, inode = fields[1], fields[2], fields[3], int(fields[9])
        if st == state and inode and int(local.rsplit(":", 1)[1], 16) == port:
            found[inode] = int(remote.rsplit(":", 1)[1], 16)
    return found


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds (its ``/proc/PID/fd`` links ``socket:[INODE]``)."""
    inodes = set()
    with contextlib.suppress(OSError):
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            with contextlib.suppress(OSError):
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def sessions_per_frontend(server: PolicyServerProcess, pids: list[int]) -> list[int]:
    """How many established connections to the port each front-end holds."""
    established = tcp_sockets(server.port, TCP_ESTABLISHED)
    return [len(socket_inodes(pid) & established.keys()) for pid in pids]


def accepted_by(server: PolicyServerProcess, pids: list[int], client_port: int) -> int:
    """The front-end that accepted the connection from our ``client_port`` (waits for its accept, bounded)."""

    def owner() -> int:  # 0: not accepted yet
        ours = {inode for inode, remote in tcp_sockets(server.port, TCP_ESTABLISHED).items() if remote == client_port}
        return next((pid for pid in pids if socket_inodes(pid) & ours), 0)

    return wait_for(owner, timeout=10, interval=0.02, what=f"a front-end to accept the connection from {client_port}")


@contextlib.contextmanager
def a_session_on_each(server: PolicyServerProcess, pids: list[int]) -> Iterator[dict[int, OpenpiSession]]:
    """{front-end pid: an openpi session it serves}: sessions are opened until the kernel gave each front-end one;
    the others are closed at once."""
    chosen: dict[int, OpenpiSession] = {}
    try:
        for _ in range(PICK_TRIES):
            session = client(server)
            pid = accepted_by(server, pids, session.connection.socket.getsockname()[1])
            if pid in chosen:
                session.close()
            else:
                chosen[pid] = session
            if len(chosen) == len(pids):
                break
        assert len(chosen) == len(pids), f"{PICK_TRIES} connections reached only {sorted(chosen)} of {pids}"
        yield chosen
    finally:
        for session in chosen.values():
            session.close()


def metrics_of_each(server: PolicyServerProcess, pids: list[int]) -> dict[int, dict[Any, float]]:
    """{front-end pid: the /metrics it answers}, each read over a connection that front-end accepted."""
    scraped: dict[int, dict[Any, float]] = {}
    for _ in range(PICK_TRIES):
        conn = http.client.HTTPConnection(server.host, server.port, timeout=10)
        try:
            conn.connect()
            assert conn.sock is not None
            pid = accepted_by(server, pids, conn.sock.getsockname()[1])
            if pid not in scraped:
                conn.request("GET", METRICS_PATH)
                reply = conn.getresponse()
                assert reply.status == 200
                scraped[pid] = parse_metrics(reply.read().decode())
        finally:
            conn.close()
        if len(scraped) == len(pids):
            return scraped
    raise AssertionError(f"{PICK_TRIES} connections reached only {sorted(scraped)} of {pids}")


def infer(session: OpenpiSession, obs: dict[str, Any], timeout: float = 60.0) -> np.ndarray:
    """``session.infer(obs)["actions"]`` with a bound on the wait for the reply."""
    session.connection.send(wire.packb(obs))
    reply = wire.unpackb(session.connection.recv(timeout=timeout))
    assert "actions" in reply, reply
    return np.asarray(reply["actions"])


def sample(metrics: dict[Any, float], name: str, **labels: str) -> float | None:
    return metrics.get((name, tuple(sorted(labels.items()))))


def test_two_frontend_processes_are_children_of_rank_0_on_one_port(two_fronts: PolicyServerProcess) -> None:
    pids = frontend_pids(two_fronts)
    assert len(pids) == 2, pids
    for pid in pids:
        stat = proc_stat(pid)
        assert stat is not None and stat[0] == two_fronts.pid  # children of rank 0 (one rank: serve itself)
    # each front-end its own listening socket on the one port
    listening = tcp_sockets(two_fronts.port, TCP_LISTEN)
    held = [socket_inodes(pid) & listening.keys() for pid in pids]
    assert all(len(inodes) == 1 for inodes in held) and held[0] != held[1], (listening, held)
    assert len({metrics_dir(pid) for pid in pids}) == 1  # one metrics folder for both
    log = two_fronts.log_text()
    assert f"listening on ws://127.0.0.1:{two_fronts.port} (" in log and "2 front-end processes)" in log, log[-3000:]
    assert " frontend 0 " in log and " frontend 1 " in log  # each front-end's log lines say which it is


def test_concurrent_robots_spread_over_both_and_metrics_sum_them(
    two_fronts: PolicyServerProcess, process: PolicyServerProcess
) -> None:
    """16 robots on their own connections, held open together: both front-ends serve some, every robot gets its
    own actions (the reply went back through the link its request came on), and /metrics read from either
    front-end counts them all."""
    server = two_fronts
    pids = frontend_pids(server)
    requests_before = server.metric("policy_requests_total", replica="0") or 0.0
    got: dict[tuple[int, int], np.ndarray] = {}
    errors: list[BaseException] = []
    all_open = threading.Barrier(ROBOTS + 1, timeout=120)
    release = threading.Event()

    def robot(i: int) -> None:
        try:
            with client(server) as c:
                for k in range(REQUESTS):
                    got[i, k] = infer(c, observation(i, seed=100 * i + k))
                all_open.wait()
                release.wait(60)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            all_open.abort()

    def all_established() -> list[int]:  # []: not yet
        spread = sessions_per_frontend(server, pids)
        return spread if sum(spread) == ROBOTS else []

    threads = [threading.Thread(target=robot, args=(i,), daemon=True) for i in range(ROBOTS)]
    for t in threads:
        t.start()
    try:
        try:
            all_open.wait()
        except threading.BrokenBarrierError:
            pytest.fail(f"a robot failed before all {ROBOTS} were connected: {errors}")
        # every connection open: how the kernel spread them (each front-end some, but for a 2**-15 chance)
        spread = wait_for(all_established, timeout=10, interval=0.05, what=f"{ROBOTS} established connections")
        assert all(n >= 1 for n in spread), f"every connection went to one front-end: {spread}"
        while_open = metrics_of_each(server, pids)
    finally:
        release.set()
        deadline = time.monotonic() + 120
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
    assert not errors, errors
    assert not any(t.is_alive() for t in threads), "robots still waiting for a reply"
    assert len(got) == ROBOTS * REQUESTS
    for pid, metrics in while_open.items():  # either front-end answers for both
        assert sample(metrics, "policy_connections") == ROBOTS, (pid, spread)
        assert sample(metrics, "policy_max_connections") == MAX_CONNECTIONS, pid  # the pod's, once
    wait_for(
        lambda: all(sample(m, "policy_connections") == 0 for m in metrics_of_each(server, pids).values()),
        timeout=10,
        interval=0.1,
        what="policy_connections 0 from both front-ends",
    )
    for pid, metrics in metrics_of_each(server, pids).items():
        assert sample(metrics, "policy_requests_total", replica="0") == requests_before + ROBOTS * REQUESTS, pid
    # every robot got the actions of its own observation and seed (a row of a batch: within fp32 noise of alone)
    with client(process) as alone:
        for (i, k), actions_ in got.items():
            want = infer(alone, observation(i, seed=100 * i + k))
            assert actions_.shape == want.shape and float(np.abs(actions_ - want).max()) <= 1e-5, (i, k)


def test_two_frontends_answer_bitwise_what_one_does(
    two_fronts: PolicyServerProcess, process: PolicyServerProcess
) -> None:
    """Through either front-end: the metadata and, for the same observation and seed, the very bits of one
    front-end's actions (requests one at a time: batches of one)."""
    with a_session_on_each(two_fronts, frontend_pids(two_fronts)) as sessions, client(process) as one:
        meta = one.get_server_metadata()
        for session in sessions.values():
            assert {k: v for k, v in session.get_server_metadata().items() if k != "rtc"} == {
                k: v for k, v in meta.items() if k != "rtc"
            }
            for variant, seed in ((0, 7), (3, 123), (5, 2**40)):
                obs = observation(variant, seed=seed)
                assert infer(session, obs).tobytes() == infer(one, obs).tobytes()


@pytest.mark.slow  # a server of its own, drained
def test_sigterm_drains_both_frontends_and_removes_the_metrics_folder(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """A request held in flight on each front-end: SIGTERM answers both, closes both sessions with 1001, exits 0,
    and rank 0 removes the front-ends' metrics folder under /dev/shm."""
    gate = tmp_path / "gate"
    args = [*TWO, "--policy", "held_policy:HeldPolicy", "--heartbeat-s", "0.5", "--drain-grace-s", "30"]
    with serve_policy(tiny_checkpoint, *args) as server:
        pids = frontend_pids(server)
        assert len(pids) == 2, pids
        folder = metrics_dir(pids[0])
        assert metrics_dir(pids[1]) == folder and folder.is_dir()
        assert folder.name.startswith("policy-frontend-metrics-")
        if os.access("/dev/shm", os.W_OK):
            assert folder.parent == Path("/dev/shm")
        try:
            with a_session_on_each(server, pids) as sessions:
                for n, session in enumerate(sessions.values()):
                    session.connection.send(wire.packb(observation(n, seed=n, prompt=hold_prompt(gate))))
                server.wait_until(
                    lambda: server.metric("policy_requests_in_flight") == 2, timeout=60, what="2 requests in flight"
                )
                # /readyz's in_flight is the pod's through either front-end (the model process's count), not the
                # answering front-end's own 1: each scrape is hashed anew, all 8 to one front-end is 2 * 2**-8
                wait_for(lambda: server.readyz().json()["in_flight"] == 2, timeout=10, interval=0.05, what="2")
                # each front-end's copy is the model process's latest push (every quarter heartbeat): within a
                # push period both have one from after the requests were routed, and every scrape says 2
                wait_for(
                    lambda: [server.readyz().json()["in_flight"] for _ in range(8)] == [2] * 8,
                    timeout=10,
                    interval=0.05,
                    what="both front-ends' in_flight 2",
                )
                server.send_signal(signal.SIGTERM)
                wait_for(lambda: server.readyz().status == 503, timeout=10, interval=0.02, what="/readyz 503")
                assert server.alive  # the held requests keep it up
                gate.touch()
                for session in sessions.values():
                    reply = wire.unpackb(session.connection.recv(timeout=60))
                    assert np.asarray(reply["actions"]).shape == (CFG.horizon, CFG.action_dim), reply
                    with pytest.raises(ConnectionClosed) as closed:
                        session.connection.recv(timeout=30)
                    assert closed.value.rcvd is not None and closed.value.rcvd.code == GOING_AWAY
            assert server.wait_exit(timeout=60) == 0, server.log_tail()
            assert "rank 0 exiting 0 (drained)" in server.log_text()
            assert not folder.exists()
        finally:
            gate.touch()
            shutil.rmtree(folder, ignore_errors=True)  # left behind by a failure above: not in /dev/shm for good


@pytest.mark.slow  # fault injection on a server of its own
def test_a_killed_frontend_of_two_takes_rank_0_and_the_other_down(tiny_checkpoint: Path) -> None:
    with serve_policy(tiny_checkpoint, *TWO) as server:
        first, second = frontend_pids(server)
        folder = metrics_dir(first)
        try:
            os.kill(second, signal.SIGKILL)  # not the first: the one that gets no engine metrics
            assert server.wait_exit(timeout=20) == ServeExit.FRONTEND, server.log_tail()
            assert "the front-end process exited" in server.log_text()
            wait_for(lambda: gone(first), timeout=10, interval=0.05, what="the other front-end to exit")
            assert not folder.exists()
        finally:
            shutil.rmtree(folder, ignore_errors=True)


POD_LIMIT = 3  # --max-connections of the test below: shares of 2 + 1 where each front-end had its own


def upgrade(server: PolicyServerProcess, pids: list[int]) -> tuple[int, ClientConnection]:
    """A WebSocket session (its metadata frame read: the front-end counted it) and the front-end that holds it."""
    ws = connect(server.url, compression=None, open_timeout=30)
    try:
        pid = accepted_by(server, pids, ws.socket.getsockname()[1])
        wire.unpackb(ws.recv(timeout=30))
    except BaseException:
        ws.close()
        raise
    return pid, ws


@pytest.mark.slow  # a server of its own
def test_max_connections_bounds_the_sessions_of_both_frontends_together(tiny_checkpoint: Path) -> None:
    """``--max-connections 3`` over two front-ends: 3 sessions are accepted however the kernel spreads them --
    2 on the first and 1 on the second, and 1 and 2 -- and a 4th upgrade gets 503, whichever front-end it
    reaches; after one closes, a new one is accepted.  (With a share per front-end, 2 + 1, the front-end holding
    a share of one refused its second session while the pod had room: the spread 1 + 2 never came about.)"""
    args = [*TWO, "--max-connections", str(POD_LIMIT), "--error-format", "dict", *NO_DRAIN]
    with serve_policy(tiny_checkpoint, *args) as server:
        pids = frontend_pids(server)
        assert len(pids) == 2, pids
        held: dict[int, list[ClientConnection]] = {pid: [] for pid in pids}
        # each front-end holding 2 of the 3 sessions in turn: every spread of 3 over 2 has a front-end at 2
        wanted = [{pids[0]: 2, pids[1]: 1}, {pids[0]: 1, pids[1]: 2}]
        seen: list[dict[int, int]] = []
        refused = server.metric("policy_connections_closed_total", reason="max_connections") or 0.0

        def spread() -> dict[int, int]:
            return {pid: len(sessions) for pid, sessions in held.items()}

        def counted(n: int) -> None:  # the pod's open sessions as /metrics shows them (either front-end's scrape)
            wait_for(lambda: server.metric("policy_connections") == n, timeout=10, interval=0.02, what=f"{n} open")

        try:
            for _ in range(POD_LIMIT):
                pid, ws = upgrade(server, pids)
                held[pid].append(ws)
            for _ in range(PICK_TRIES):
                counted(POD_LIMIT)
                if spread() in wanted and spread() not in seen:
                    seen.append(spread())
                    for pid, metrics in metrics_of_each(server, pids).items():
                        assert sample(metrics, "policy_connections") == POD_LIMIT, (pid, spread())
                        assert sample(metrics, "policy_max_connections") == POD_LIMIT, pid  # the pod's, once
                with pytest.raises(InvalidStatus) as full:
                    connect(server.url, compression=None, open_timeout=30).close()
                assert full.value.response.status_code == 503, full.value.response
                body = json.loads(full.value.response.body)
                assert body["error"].startswith(f"server has {POD_LIMIT} connections open (--max-connections)"), body
                refused += 1
                assert server.metric("policy_connections_closed_total", reason="max_connections") == refused
                if len(seen) == len(wanted):
                    break
                # toward a spread not seen yet: close a session where there are more than it has, open another
                target = next(w for w in wanted if w not in seen)
                closing = next(pid for pid in pids if len(held[pid]) > target[pid])
                held[closing].pop().close()
                counted(POD_LIMIT - 1)
                pid, ws = upgrade(server, pids)  # room again: accepted, whichever front-end it reaches
                held[pid].append(ws)
            assert len(seen) == len(wanted), f"{PICK_TRIES} tries reached the spreads {seen} only"
        finally:
            for sessions in held.values():
                for ws in sessions:
                    ws.close()
        counted(0)
        pid, ws = upgrade(server, pids)
        with ws:
            ws.send(wire.packb(observation(1, seed=3)))
            assert "actions" in wire.unpackb(ws.recv(timeout=60))


# --- the shared-memory ring, in this process ---------------------------------------------------------------
def test_the_ring_round_trips_every_dtype_and_refuses_what_does_not_fit() -> None:
    import os

    import torch

    from policy_operator.runtime import ipc
    from policy_operator.runtime.engine_api import PreparedRequest
    from policy_operator.runtime.errors import ErrorKind, WireError
    from policy_operator.runtime.policy.interface import Sample

    slots, slot_bytes = ipc.ring_geometry(max_message_bytes=1000, max_buffered_bytes=10_000)
    assert (slots, slot_bytes) == (8, 1024)  # a slot holds any admitted frame; at most MAX_SLOTS
    assert ipc.ring_geometry(1000, 1500)[0] == 1  # --max-buffered-bytes bounds the ring
    fd = ipc.create_ring_fd(slots, slot_bytes)
    try:
        writer, reader = ipc.SlotRing(fd, slots, slot_bytes), ipc.SlotRing(fd, slots, slot_bytes)
    finally:
        os.close(fd)
    tensors = {
        "image": torch.arange(3 * 4 * 3, dtype=torch.uint8).reshape(1, 3, 4, 3),
        "state": torch.randn(1, 7),
        "tokens": torch.arange(5, dtype=torch.int64)[None],
        "present": torch.tensor([[True, False]]),
        "half": torch.randn(1, 3).to(torch.bfloat16),
        "strided": torch.randn(4, 2).t()[None],  # not contiguous
        "empty": torch.zeros(1, 0),
    }
    request = writer.write_request(
        9, 5, PreparedRequest(Sample(tensors, {"cameras": 1}), None, 3, "s", None, 1.0, 2.0, 10), 4
    )
    assert (request.id, request.slot, request.recent_sessions, request.meta) == (9, 5, 4, {"cameras": 1})
    prepared = reader.read_request(request)
    assert prepared.observation is None and prepared.sample is not None and prepared.sample.meta == {"cameras": 1}
    assert (prepared.seed, prepared.session, prepared.decode_ms, prepared.prepare_ms, prepared.frame_bytes) == (
        3,
        "s",
        1.0,
        2.0,
        10,
    )
    back = prepared.sample.tensors
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name
    writer.write_request(
        10, 5, PreparedRequest(Sample({"state": torch.zeros(1, 7)}, {}), None, None, None), 0
    )  # reused
    assert torch.equal(back["state"], tensors["state"])
    # a policy without a Preprocessor: the decoded observation, its arrays out of band in the slot
    obs: dict[str, Any] = {
        "image": np.arange(24, dtype=np.uint8).reshape(2, 4, 3),
        "prompt": "pick",
        "state": np.ones(3),
    }
    data, buffers = writer.write_object(0, obs)
    assert len(data) < 400 and sum(b.nbytes for b in buffers) == 24 + 24  # the bytes are in the slot
    copied = reader.read_object(0, data, buffers)
    writer.write_object(0, {"image": np.zeros((2, 4, 3), np.uint8)})  # the slot reused: the copy stays
    assert copied["prompt"] == "pick" and np.array_equal(copied["image"], obs["image"])
    assert np.array_equal(copied["state"], obs["state"]) and copied["image"].flags.writeable
    with pytest.raises(WireError) as too_big:
        writer.write_request(
            11, 1, PreparedRequest(Sample({"image": torch.zeros(1, 2000, dtype=torch.uint8)}, {}), None, None, None), 0
        )
    assert too_big.value.kind is ErrorKind.BAD_FRAME and "--max-message-bytes" in str(too_big.value)
    with pytest.raises(WireError):
        writer.write_object(1, {"image": np.zeros(2000, np.uint8)})


def test_session_counts_add_every_frontends_slot_handed_over_the_channel() -> None:
    """Rank 0 makes the counts' memfd and hands it over each front-end's socket after the configuration; each
    mapping writes its own slot and reads the sum of all (what ``--max-connections`` compares against)."""
    import socket

    from policy_operator.runtime import ipc

    processes = 3
    fd = ipc.create_counts_fd(processes)
    mappings = []
    try:
        for index in range(processes):
            ours, theirs = socket.socketpair()
            with ours, theirs:
                rank0, front = ipc.Channel(ours), ipc.Channel(theirs)
                rank0.send({"config": index})  # the configuration goes first, the descriptor after it
                rank0.send_fd(fd)
                assert front.recv() == {"config": index}
                received = front.recv_fd()
            assert received != fd
            try:
                mappings.append(ipc.SessionCounts(received, processes, index))
            finally:
                os.close(received)  # mapped: the descriptor is no longer needed
    finally:
        os.close(fd)
    assert [m.total() for m in mappings] == [0, 0, 0]
    for index, m in enumerate(mappings):
        m.set(10**index)  # 1, 10, 100: a slot written over another's would show
    assert [m.total() for m in mappings] == [111] * processes
    mappings[1].set(0)  # a front-end whose sessions closed
    mappings[2].set(2**40)  # any int64
    assert [m.total() for m in mappings] == [1 + 2**40] * processes
