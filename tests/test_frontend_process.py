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
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from policy_operator.exit_codes import ServeExit
from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from policy_operator.runtime.policy.sampler import batch_buckets
from policy_operator.runtime.serving import wire
from tests.support.net import wait_for
from tests.support.openpi import OpenpiSession
from tests.support.servers import NO_DRAIN, PolicyServerProcess, descendants, serve_policy

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


def frontend_pid(server: PolicyServerProcess) -> int:
    """The front-end child (a descendant whose command line runs serving.frontend)."""
    for pid in descendants(server.pid):
        with contextlib.suppress(OSError):
            if b"policy_operator.runtime.serving.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                return pid
    raise AssertionError("no front-end process")


def gone(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


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
        server.send_signal(signal.SIGKILL)  # rank 0 (one rank: serve itself)
        wait_for(lambda: gone(front), timeout=10, interval=0.05, what="the front-end to exit")
        with pytest.raises(OSError):
            connect(server.url, open_timeout=3)


@pytest.mark.slow  # fault injection on a server of its own
def test_a_killed_frontend_takes_rank_0_down(tiny_checkpoint: Path) -> None:
    with serve_policy(tiny_checkpoint, *STEPS, *PROCESS) as server:
        import os

        os.kill(frontend_pid(server), signal.SIGKILL)
        assert server.wait_exit(timeout=20) == ServeExit.FRONTEND, server.log_tail()
        assert "the front-end process exited" in server.log_text()


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


# --- the shared-memory ring, in this process ---------------------------------------------------------------
def test_the_ring_round_trips_every_dtype_and_refuses_what_does_not_fit() -> None:
    import os

    import torch

    from policy_operator.runtime.errors import ErrorKind, WireError
    from policy_operator.runtime.policy.interface import Sample
    from policy_operator.runtime.serving import ipc

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
    specs = writer.write_sample(5, Sample(tensors, {"cameras": 1}))
    back = reader.read_tensors(5, specs)
    assert set(back) == set(tensors)
    for name, t in tensors.items():
        assert back[name].dtype == t.dtype and back[name].shape == t.shape
        assert torch.equal(back[name], t), name
    writer.write_sample(5, Sample({"state": torch.zeros(1, 7)}, {}))  # the slot reused: the copy stays
    assert torch.equal(back["state"], tensors["state"])
    writer.write_raw(0, b"frame")
    assert reader.read_raw(0, 5) == b"frame"
    with pytest.raises(WireError) as too_big:
        writer.write_sample(1, Sample({"image": torch.zeros(1, 2000, dtype=torch.uint8)}, {}))
    assert too_big.value.kind is ErrorKind.BAD_FRAME and "--max-message-bytes" in str(too_big.value)
    with pytest.raises(WireError):
        writer.write_raw(1, b"x" * 2000)
