"""Batching across sessions: the sampler on B rows, the lane that forms batches, and real servers that batch.

The sampler and lane tests run in-process; the server tests start real
``policyserver serve`` processes on 127.0.0.1 and make batches happen on
purpose: a ``hold:`` request keeps the replica busy while the test queues
requests behind it, so the next batch's members are known, not hoped for.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from websockets.sync.client import connect

from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest, Lane, Outcome, Ran
from policy_operator.runtime.policy import Sample, collate
from policy_operator.runtime.policy.reference import PolicyConfig, ReferencePolicy, example_observation
from policy_operator.runtime.policy.sampler import batch_buckets, bucket_of, sample_actions
from policy_operator.runtime.serving import wire
from tests.support.plugins.batch_probe_policy import FAIL_PROMPT, NAN_PROMPT
from tests.support.plugins.held_policy import hold_prompt
from tests.support.servers import NO_DRAIN, PolicyServerProcess, serve_policy

CFG = PolicyConfig()
STEPS = 3
TOLERANCE = 1e-5  # fp32 on the CPU: a row of a batch vs the same request alone (docs/runtime.md)
RECV_TIMEOUT_S = 120.0


def observation(variant: int, **changes: Any) -> dict[str, Any]:
    obs = example_observation(CFG, variant, image_hw=(48, 40))  # resized on the device, for the whole batch
    obs.update(changes)
    return obs


# --- the sampler on a batch ------------------------------------------------------------------------
@pytest.fixture(scope="module")
def policy(tiny_checkpoint: Path) -> ReferencePolicy:
    torch.set_num_threads(1)
    return ReferencePolicy.load(str(tiny_checkpoint), device=torch.device("cpu"), dtype=torch.float32)


def alone(policy: ReferencePolicy, obs: dict[str, Any], seed: int, mode: str) -> np.ndarray:
    x = sample_actions(policy, policy.prepare(obs), [seed], steps=STEPS, guidance=3.0, mode=mode)  # type: ignore[arg-type]
    return policy.postprocess(x)


@pytest.mark.parametrize("mode", ["sequential", "batched"])
@pytest.mark.parametrize("pad_to", [None, 8])
def test_each_row_of_a_batch_is_the_request_served_alone(
    policy: ReferencePolicy, mode: str, pad_to: int | None
) -> None:
    """Five requests (own observation, own seed) as one batch, optionally padded to a bucket of 8 rows."""
    seeds = [11, 7, 2**40, 0, 11]
    observations = [observation(i) for i in range(len(seeds))]
    samples = [policy.prepare(o) for o in observations]
    rows = list(seeds)
    if pad_to:
        samples += [samples[-1]] * (pad_to - len(samples))
        rows += [rows[-1]] * (pad_to - len(rows))
    x = sample_actions(policy, collate(samples), rows, steps=STEPS, guidance=3.0, mode=mode)  # type: ignore[arg-type]
    batched = policy.postprocess_batch(x[: len(seeds)])
    assert len(batched) == len(seeds)
    for obs, seed, got in zip(observations, seeds, batched, strict=True):
        want = alone(policy, obs, seed, mode)
        assert got.shape == want.shape == (CFG.horizon, CFG.action_dim)
        assert float(np.abs(got - want).max()) <= TOLERANCE
    assert not np.allclose(batched[0], batched[1]), "different requests in one batch keep different actions"


def test_a_batch_of_one_is_bitwise_the_request(policy: ReferencePolicy) -> None:
    """--max-batch 1 keeps bitwise reproducibility: collating one sample changes no bit."""
    obs = observation(3)
    x = sample_actions(policy, collate([policy.prepare(obs)]), [5], steps=STEPS, guidance=3.0)
    assert np.array_equal(policy.postprocess_batch(x)[0], alone(policy, obs, 5, "sequential"))


def test_samples_of_different_shapes_never_share_a_batch(policy: ReferencePolicy) -> None:
    one = policy.prepare(observation(0))
    other = Sample({**one.tensors, "state": torch.zeros(1, CFG.joint_dim + CFG.gripper_dim + 1)})
    assert one.group_key() == policy.prepare(observation(5)).group_key(), "other content, one shape"
    # frames are resized on the device, after the batch forms: a camera of another size is another batch
    larger = policy.prepare(dict(observation(5), **{"observation/image": np.zeros((56, 40, 3), np.uint8)}))
    assert one.group_key() != larger.group_key()
    assert one.group_key() != other.group_key()
    with pytest.raises(ValueError, match="different shapes"):
        collate([one, other])
    with pytest.raises(ValueError, match="seeds for a sample of 2 rows"):
        sample_actions(policy, collate([one, one]), [1], steps=1, guidance=3.0)


def test_buckets_cover_every_batch_size() -> None:
    assert batch_buckets(1) == (1,)
    assert batch_buckets(8) == (1, 2, 4, 8)
    assert batch_buckets(12) == (1, 2, 4, 8, 12)
    assert [bucket_of(n, batch_buckets(12)) for n in range(1, 13)] == [1, 2, 4, 4, 8, 8, 8, 8, 12, 12, 12, 12]
    assert bucket_of(5, ()) == 5, "no buckets (eager): a batch runs at its own size"
    with pytest.raises(ValueError):
        bucket_of(13, batch_buckets(12))


# --- the lane: which requests form a batch ----------------------------------------------------------
class FakeReplica:
    """Records the batches it is called with; ``gate`` holds the first call so requests queue behind it."""

    def __init__(self, fail_when: str | None = None) -> None:
        self.batches: list[list[str]] = []
        self.started: list[float] = []  # time.monotonic() of each call
        self.gate = threading.Event()
        self.fail_when = fail_when

    def call(self, batch: Batch) -> list[Outcome]:
        ids = [r.request_id for r in batch.requests]
        self.started.append(time.monotonic())
        self.batches.append(ids)
        if len(self.batches) == 1:
            assert self.gate.wait(30), "test never released the first batch"
        if self.fail_when in ids:
            raise RuntimeError("the batched call failed")
        return [Outcome(i, 1.0, np.full((2, 2), k, np.float32)) for k, i in enumerate(ids)]


def request(request_id: str, width: int = 4) -> InferenceRequest:
    return InferenceRequest(request_id, Sample({"x": torch.zeros(1, width)}), 0)


async def _settle(condition: Any, what: str) -> None:
    for _ in range(500):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"timed out waiting for {what}")


def run_lane(scenario: Any, replica: FakeReplica, pool_type: Any = None, **batching: Any) -> Any:
    async def main() -> Any:
        from concurrent.futures import ThreadPoolExecutor

        with (pool_type or ThreadPoolExecutor)(1) as pool:
            lane = Lane(0, pool, replica.call, lambda: None, **batching)
            try:
                return await asyncio.wait_for(scenario(lane), 60)
            finally:
                replica.gate.set()

    return asyncio.run(main())


def test_requests_that_queue_while_the_replica_is_busy_run_as_one_batch() -> None:
    replica = FakeReplica()

    async def scenario(lane: Lane) -> list[Any]:
        first = lane.submit(request("a"))
        await _settle(lambda: replica.batches, "the first batch")
        rest = [lane.submit(request(name)) for name in "bcdef"]
        replica.gate.set()
        return await asyncio.gather(first, *rest)

    served = run_lane(scenario, replica, max_batch=3)
    assert replica.batches == [["a"], ["b", "c", "d"], ["e", "f"]], "oldest first, at most max_batch"
    assert [s.batch_size for s in served] == [1, 3, 3, 3, 2, 2]
    assert [s.outcome.request_id for s in served] == list("abcdef"), "each request gets its own reply"
    assert served[1].queue_ms > 0


def test_max_batch_one_runs_one_request_at_a_time() -> None:
    replica = FakeReplica()

    async def scenario(lane: Lane) -> None:
        first = lane.submit(request("a"))
        await _settle(lambda: replica.batches, "the first batch")
        rest = [lane.submit(request(name)) for name in "bc"]
        replica.gate.set()
        await asyncio.gather(first, *rest)

    run_lane(scenario, replica, max_batch=1)
    assert replica.batches == [["a"], ["b"], ["c"]]


def test_a_full_batch_goes_to_the_replica_before_the_previous_replies_are_sent() -> None:
    """The device must not idle while the event loop resumes the sessions of the batch that just finished."""
    from concurrent.futures import ThreadPoolExecutor

    replica = FakeReplica()
    order: list[str] = []  # both appended on the event loop thread: the order is deterministic

    class RecordingPool(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            order.append("batch handed to the replica")
            return super().submit(fn, *args, **kwargs)

    async def scenario(lane: Lane) -> None:
        async def first_session() -> None:
            await lane.submit(request("a"))
            order.append("a's session resumed")

        first = asyncio.ensure_future(first_session())
        await _settle(lambda: replica.batches, "the first batch")
        rest = [lane.submit(request(name)) for name in "bc"]  # a full batch queued behind the first
        replica.gate.set()
        await asyncio.gather(first, *rest)

    run_lane(scenario, replica, RecordingPool, max_batch=2)
    assert replica.batches == [["a"], ["b", "c"]]
    assert order == ["batch handed to the replica", "batch handed to the replica", "a's session resumed"]


def test_a_full_batch_waits_at_the_replica_while_the_running_one_computes() -> None:
    """The next full batch is handed to the replica's thread before the running batch ends, so the replica starts
    it without a round trip through the event loop; a batch with room is not (it may still grow)."""
    from concurrent.futures import ThreadPoolExecutor

    replica = FakeReplica()
    handed: list[int] = []

    class RecordingPool(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            handed.append(len(replica.batches))  # how many batches the replica had started by then
            return super().submit(fn, *args, **kwargs)

    async def scenario(lane: Lane) -> None:
        first = lane.submit(request("a"))
        await _settle(lambda: replica.batches, "the first batch")
        rest = [lane.submit(request(name)) for name in "bcd"]  # [b, c] is full; d has room
        assert handed == [0, 1], "the full batch went to the replica while [a] still computed; d waits"
        replica.gate.set()
        await asyncio.gather(first, *rest)

    run_lane(scenario, replica, RecordingPool, max_batch=2)
    assert replica.batches == [["a"], ["b", "c"], ["d"]]


def test_a_batch_holds_one_shape_and_the_others_keep_their_order() -> None:
    replica = FakeReplica()

    async def scenario(lane: Lane) -> None:
        first = lane.submit(request("a"))
        await _settle(lambda: replica.batches, "the first batch")
        rest = [
            lane.submit(request("b", 4)),
            lane.submit(request("c", 5)),
            lane.submit(request("d", 4)),
            lane.submit(request("e", 5)),
        ]
        replica.gate.set()
        await asyncio.gather(first, *rest)

    run_lane(scenario, replica, max_batch=8)
    assert replica.batches == [["a"], ["b", "d"], ["c", "e"]]


class Clock:
    """A lane's window clock that moves only when the test says: its own timer (real seconds) finds the same
    state a ``kick`` does, so the outcome never depends on how fast the machine is."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_window_waits_only_for_requests_still_expected() -> None:
    """With nothing expected a request starts at once (its window is an hour); with one on the way the lane waits
    for it, however long, and the two run together."""
    replica = FakeReplica()
    replica.gate.set()
    expected, clock = [0], Clock()

    async def scenario(lane: Lane) -> None:
        await lane.submit(request("alone"))  # done: it never waited for the hour-long window
        expected[0] = 1  # a request is still in prepare ...
        first = lane.submit(request("a"))
        assert lane._running == 0, "a waits for the request on its way"
        clock.now += 1800.0  # ... and lands well inside the window
        expected[0] = 0
        second = lane.submit(request("b"))
        await asyncio.gather(first, second)

    run_lane(scenario, replica, max_batch=8, window_s=3600.0, expected=lambda: expected[0], clock=clock)
    assert replica.batches == [["alone"], ["a", "b"]]


def test_the_window_runs_from_the_latest_arrival_and_ends_when_none_comes() -> None:
    """Robots answered together come back spread out (one event loop decodes and prepares each): every one that
    comes within a window of the previous joins, though all three take longer than one window; the one that
    never comes holds the batch for one window after the last arrival, not longer."""
    replica = FakeReplica()
    replica.gate.set()
    expected, clock = [3], Clock()

    async def scenario(lane: Lane) -> list[Ran]:
        futures: list[asyncio.Future[Ran]] = []
        for name in "abc":
            if futures:
                clock.now += 0.25  # 0.5 s from a to c: longer than one 0.375 s window
            expected[0] -= 1  # expected until it arrives; one session never does
            futures.append(lane.submit(request(name)))
        last = clock.now
        clock.now = last + 0.375 - 0.0625  # within one window of the last arrival: still waiting
        lane.kick()
        assert lane._running == 0 and not replica.batches, "the window runs from c's arrival"
        clock.now = last + 0.375  # one window after it: the batch goes
        lane.kick()
        return await asyncio.gather(*futures)

    served = run_lane(scenario, replica, max_batch=8, window_s=0.375, expected=lambda: expected[0] + 1, clock=clock)
    assert replica.batches == [["a", "b", "c"]]
    assert [s.batch_size for s in served] == [3, 3, 3]


def test_a_failed_batch_fails_exactly_its_requests() -> None:
    replica = FakeReplica(fail_when="c")

    async def scenario(lane: Lane) -> list[Any]:
        first = lane.submit(request("a"))
        await _settle(lambda: replica.batches, "the first batch")
        batch = [lane.submit(request(name)) for name in "bc"]
        replica.gate.set()
        results = await asyncio.gather(first, *batch, return_exceptions=True)
        after = await lane.submit(request("d"))
        return [*results, after]

    results = run_lane(scenario, replica, max_batch=8)
    assert replica.batches == [["a"], ["b", "c"], ["d"]]
    assert results[0].outcome.actions is not None and results[3].outcome.actions is not None
    assert all(isinstance(r, RuntimeError) for r in results[1:3])


# --- real servers --------------------------------------------------------------------------------------
class Client(threading.Thread):
    """One robot on its own connection, one request; the reply (or the error text) lands in ``result``."""

    def __init__(self, server: PolicyServerProcess, obs: dict[str, Any]) -> None:
        super().__init__(daemon=True)
        self.server, self.obs = server, obs
        self.result: Any = None  # the reply, decoded

    def run(self) -> None:
        with connect(self.server.url, compression=None, max_size=None, open_timeout=30) as ws:
            wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
            ws.send(wire.packb(self.obs))
            reply = ws.recv(timeout=RECV_TIMEOUT_S)
        self.result = reply if isinstance(reply, str) else wire.unpackb(reply)


def one_request(server: PolicyServerProcess, obs: dict[str, Any]) -> Any:
    client = Client(server, obs)
    client.run()
    return client.result


def in_flight_is(server: PolicyServerProcess, n: int) -> bool:
    return server.readyz().json()["in_flight"] == n


def queue_behind_a_held_request(
    server: PolicyServerProcess,
    gate: Path,
    queued: list[dict[str, Any]],
    session: str | None = None,
    replicas: int = 1,
) -> tuple[Client, list[Client]]:
    """A held request on each of ``replicas`` replicas (least in flight first: one each), then ``queued`` requests
    waiting behind them, spread evenly over the held lanes by the router (each connection's session is its own);
    the gate opens once all are in flight.  The first held request's client, and the queued ones'."""
    extra = {"session_id": session} if session else {}
    held = [Client(server, observation(0, prompt=hold_prompt(gate), seed=1 + k, **extra)) for k in range(replicas)]
    for k, h in enumerate(held, 1):
        h.start()
        server.wait_until(partial(in_flight_is, server, k), timeout=60, what="the held request(s)")
    clients = [Client(server, {**obs, **extra}) for obs in queued]
    for c in clients:
        c.start()
    try:
        # /readyz counts routed requests, i.e. queued at a lane (the metric also counts those still in prepare)
        server.wait_until(
            lambda: server.readyz().json()["in_flight"] == replicas + len(queued),
            timeout=60,
            what="the queued requests",
        )
    finally:
        gate.touch()
    for c in [*held, *clients]:
        c.join(RECV_TIMEOUT_S)
        assert not c.is_alive(), "a request was never answered"
    return held[0], clients


@pytest.fixture(scope="module")
def batching_server(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        str(STEPS),
        "--policy",
        "batch_probe_policy:BatchProbePolicy",
        "--max-batch",
        "8",
        "--error-format",
        "dict",
        "--threads",
        "1",
        *NO_DRAIN,
    ) as s:
        yield s


def test_a_server_batches_queued_sessions_and_each_gets_its_own_actions(
    batching_server: PolicyServerProcess, tmp_path: Path
) -> None:
    s = batching_server
    before = s.metrics()
    queued = [observation(i, seed=100 + i) for i in range(1, 4)]
    held, clients = queue_behind_a_held_request(s, tmp_path / "go", queued)
    assert held.result["server_timing"]["batch_size"] == 1
    for client in clients:
        timing = client.result["server_timing"]
        assert timing["batch_size"] == 3 and timing["queue_ms"] > 0
    for obs, client in zip(queued, clients, strict=True):  # the same request again, now alone
        again = one_request(s, obs)
        assert again["server_timing"]["batch_size"] == 1
        assert float(np.abs(client.result["actions"] - again["actions"]).max()) <= TOLERANCE
    after = s.metrics()
    batches = after[("policy_batch_size_count", (("replica", "0"),))] - before.get(
        ("policy_batch_size_count", (("replica", "0"),)), 0
    )
    rows = after[("policy_batch_size_sum", (("replica", "0"),))] - before.get(
        ("policy_batch_size_sum", (("replica", "0"),)), 0
    )
    assert (batches, rows) == (1 + 1 + 3, 1 + 3 + 3), "held, the batch of 3, then the 3 alone"


def test_bad_rows_and_bad_requests_fail_only_themselves(batching_server: PolicyServerProcess, tmp_path: Path) -> None:
    s = batching_server
    queued = [
        observation(1, seed=5),
        observation(2, prompt=NAN_PROMPT),
        observation(3, seed=6),
        observation(4, **{"observation/joint_position": [1.0, 2.0]}),
    ]  # refused in prepare
    held, clients = queue_behind_a_held_request(s, tmp_path / "go", queued[:3])
    good, nan_row, good2 = (c.result for c in clients)
    assert good["server_timing"]["batch_size"] == good2["server_timing"]["batch_size"] == 3
    assert nan_row["type"] == "error" and nan_row["error"]["kind"] == "non_finite_actions", nan_row
    assert np.isfinite(good["actions"]).all() and np.isfinite(good2["actions"]).all()
    assert float(np.abs(good["actions"] - one_request(s, queued[0])["actions"]).max()) <= TOLERANCE
    invalid = one_request(s, queued[3])
    assert invalid["type"] == "error" and invalid["error"]["kind"] == "invalid_observation"
    assert "actions" in one_request(s, observation(7)), "the server still serves"


def test_a_failed_batch_call_fails_its_requests_and_the_server_carries_on(
    batching_server: PolicyServerProcess, tmp_path: Path
) -> None:
    s = batching_server
    held, clients = queue_behind_a_held_request(
        s, tmp_path / "go", [observation(1), observation(2, prompt=FAIL_PROMPT)]
    )
    assert "actions" in held.result, "the held request ran in a batch of its own"
    for client in clients:
        assert client.result["type"] == "error" and client.result["error"]["kind"] == "inference_failed", client.result
        assert "planted failure" in client.result["error"]["message"]
    assert s.readyz().status == 200
    assert "actions" in one_request(s, observation(1)), "the request that shared the failed batch works alone"


@pytest.mark.parametrize(
    "cfgp,dp",
    [(1, 1), pytest.param(2, 1, marks=pytest.mark.slow), pytest.param(1, 2, marks=pytest.mark.slow)],
)
def test_a_latency_budget_caps_batches_at_the_largest_measured_size_that_fits(
    tiny_checkpoint: Path, tmp_path: Path, cfgp: int, dp: int
) -> None:
    """Warm-up measures a batch of every bucket size and /metrics shows the times; a budget no batch fits (1 us)
    leaves batches of one: three requests queued behind a held one each run alone instead of as a batch of 3.
    Under cfgp=2 the driver measures with its peer; under dp=2 replica 0's times cap every replica's lane (one
    model, one kind of GPU), and /metrics shows them for each."""
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        str(STEPS),
        "--policy",
        "batch_probe_policy:BatchProbePolicy",
        "--cfgp",
        str(cfgp),
        "--dp",
        str(dp),
        "--max-batch",
        "8",
        "--latency-budget-ms",
        "0.001",
        "--error-format",
        "dict",
        "--threads",
        "1",
    ) as s:
        times = {
            bucket: s.metric("policy_batch_bucket_seconds", replica="0", bucket=str(bucket))
            for bucket in batch_buckets(8)
        }
        assert all(t is not None and t > 0 for t in times.values()), times
        for replica in range(1, dp):
            assert {
                bucket: s.metric("policy_batch_bucket_seconds", replica=str(replica), bucket=str(bucket))
                for bucket in batch_buckets(8)
            } == times
        doc = s.readyz().json()  # what the operator copies into status.batching
        assert doc["max_batch"] == 1, doc
        assert {int(k): v for k, v in doc["batch_buckets_ms"].items()} == pytest.approx(
            {bucket: t * 1e3 for bucket, t in times.items() if t is not None},
            abs=1e-3,  # all are (asserted above)
        )
        held, clients = queue_behind_a_held_request(
            s, tmp_path / "go", [observation(i) for i in range(1, 4)], replicas=dp
        )  # every replica held: the queued requests wait in its lanes, where they would otherwise batch
        assert [c.result["server_timing"]["batch_size"] for c in clients] == [1, 1, 1]
        assert s.readyz().json()["ranks_ready"] == cfgp * dp, "every rank still serves"


@pytest.mark.slow
@pytest.mark.parametrize("cfgp,dp", [(2, 1), (1, 2)])
def test_batches_cross_the_ranks_of_every_layout(tiny_checkpoint: Path, tmp_path: Path, cfgp: int, dp: int) -> None:
    """cfgp=2: both ranks run their branch for B rows and the per-step all_gather carries B rows; dp=2: the batch
    goes to replica k's driver over the dispatch group and B Outcomes come back.  Every replica holds a request
    while three more per replica queue behind it (the router spreads them evenly: each connection's session is its
    own), so each lane's three meet in one batch."""
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        str(STEPS),
        "--policy",
        "batch_probe_policy:BatchProbePolicy",
        "--cfgp",
        str(cfgp),
        "--dp",
        str(dp),
        "--max-batch",
        "8",
        "--error-format",
        "dict",
        "--threads",
        "1",
    ) as s:
        queued = [observation(1, seed=21), observation(2, prompt=NAN_PROMPT), observation(3, seed=22)]
        queued += [observation(3 + k, seed=22 + k) for k in range(1, 3 * dp - 2)]  # three per replica
        held, clients = queue_behind_a_held_request(s, tmp_path / "go", queued, session="robot-1", replicas=dp)
        replies = [c.result for c in clients]
        assert replies[1]["error"]["kind"] == "non_finite_actions", replies[1]
        assert {r["server_timing"]["replica"] for r in replies if "server_timing" in r} == set(range(dp))
        for obs, reply in zip(queued, replies, strict=True):
            if obs is queued[1]:
                continue
            assert reply["server_timing"]["batch_size"] == 3, reply["server_timing"]
            again = one_request(s, {**obs, "session_id": "robot-1"})
            assert again["server_timing"]["batch_size"] == 1
            assert float(np.abs(reply["actions"] - again["actions"]).max()) <= TOLERANCE
        assert s.readyz().json()["ranks_ready"] == cfgp * dp, "every rank still serves"


@pytest.mark.slow  # its own server, robots in closed loop for several rounds
def test_closed_loop_robots_come_back_as_one_batch(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Four robots that each send their next request when their reply arrives.  Robot 0's first request is held
    while the other three queue behind it.  A lane that still counted robot 0 as in flight when its batch ended
    would start [1, 2, 3] at once, and the robots would alternate in batches of 1 and 3 forever (seen before the
    fix).  The window waits for the session that was just answered instead: from then on every batch holds
    all four."""
    gate = tmp_path / "go"
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        "1",
        "--max-batch",
        "4",
        "--batch-window-ms",
        "500",
        "--threads",
        "1",
        "--policy",
        "held_policy:HeldPolicy",
    ) as s:
        sizes: dict[int, list[int]] = {}
        waits: dict[int, list[float]] = {}

        def robot(k: int) -> None:
            with connect(s.url, compression=None, max_size=None, open_timeout=30) as ws:
                wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
                for i in range(9 if k == 0 else 8):  # robot 0's held request is one more round
                    held = {"prompt": hold_prompt(gate)} if (k, i) == (0, 0) else {}
                    ws.send(wire.packb(observation(k, seed=i, **held)))
                    timing = wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))["server_timing"]
                    sizes.setdefault(k, []).append(timing["batch_size"])
                    waits.setdefault(k, []).append(timing["queue_ms"])

        robots = [threading.Thread(target=robot, args=(k,), daemon=True) for k in range(4)]
        robots[0].start()
        s.wait_until(lambda: s.readyz().json()["in_flight"] == 1, timeout=60, what="robot 0's held request")
        for r in robots[1:]:
            r.start()
        try:
            s.wait_until(lambda: s.readyz().json()["in_flight"] == 4, timeout=60, what="the other robots")
        finally:
            gate.touch()
        for r in robots:
            r.join(RECV_TIMEOUT_S)
        assert sorted(sizes) == [0, 1, 2, 3], "every robot got all its replies"
        assert sizes[0][0] == 1, "the held request ran alone"
        for k in range(4):
            assert sizes[k][-4:] == [4, 4, 4, 4], sizes
            assert max(waits[k][-4:]) < 400, "a full batch starts without waiting out the window"


@pytest.mark.slow  # its own server, a deliberately long batch
def test_robots_answered_after_a_long_batch_still_count_as_coming_back(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Robot A's request is held for 1.5 s, longer than ``RECENT_SESSION_S``, while robot B's queues behind it.
    When A's batch ends, A is about to come back: counted by the age of its last frame it would look gone and B's
    request would run alone at once (seen before the fix).  A was in flight until just now, so the window waits
    for A's next request and the two run together."""
    gate = tmp_path / "go"
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        "1",
        "--max-batch",
        "4",
        "--batch-window-ms",
        "1000",
        "--threads",
        "1",
        "--policy",
        "held_policy:HeldPolicy",
    ) as s:
        with (
            connect(s.url, compression=None, max_size=None, open_timeout=30) as a,
            connect(s.url, compression=None, max_size=None, open_timeout=30) as b,
        ):
            for ws in (a, b):
                wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
            a.send(wire.packb(observation(0, prompt=hold_prompt(gate))))
            s.wait_until(lambda: s.readyz().json()["in_flight"] == 1, timeout=60, what="A's held request")
            b.send(wire.packb(observation(1)))
            s.wait_until(lambda: s.readyz().json()["in_flight"] == 2, timeout=60, what="B queued behind it")
            time.sleep(1.5)  # both frames are now older than RECENT_SESSION_S (1 s)
            gate.touch()
            assert wire.unpackb(a.recv(timeout=RECV_TIMEOUT_S))["server_timing"]["batch_size"] == 1
            a.send(wire.packb(observation(2)))  # A comes straight back
            sizes = [wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))["server_timing"]["batch_size"] for ws in (b, a)]
        assert sizes == [2, 2], "B's request waited for A's next one"
