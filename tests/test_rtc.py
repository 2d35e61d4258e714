"""Real-time chunking: the wire entry's checks, the sampler's constraint, batching, cfgp=2, and the client executor.

The sampler tests run the tiny reference policy in-process on the CPU; the
server tests start real ``policyserver serve`` processes on 127.0.0.1 (slow).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from websockets.sync.client import ClientConnection, connect

from policy_operator.runtime.chunk_executor import ChunkExecutor, boundary_jump, simulate
from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.errors import ErrorKind, InvalidRtc, RequestError
from policy_operator.runtime.policy import collate
from policy_operator.runtime.policy.reference import PolicyConfig, ReferencePolicy, example_observation
from policy_operator.runtime.policy.rtc import RtcConstraint, RtcMode, prefix_weights, rtc_unsupported
from policy_operator.runtime.policy.sampler import CfgMode, sample_actions
from policy_operator.runtime.rtc_session import RtcSession, RtcSupport, parse_rtc
from policy_operator.runtime.serving import wire
from tests.support.servers import PolicyServerProcess, serve_policy

SHAPE = (16, 8)  # the tiny reference policy's (horizon, action_dim)


def chunk(rows: int = 10, fill: float | None = None) -> np.ndarray:
    values = np.arange(rows * SHAPE[1], dtype=np.float32).reshape(rows, SHAPE[1]) / 10
    return values if fill is None else np.full((rows, SHAPE[1]), fill, np.float32)


def parse(entry: Any, session: RtcSession | None = None, max_delay: int = 8) -> Any:
    return parse_rtc(entry, session, action_shape=SHAPE, max_delay=max_delay)


# --- the wire entry ------------------------------------------------------------------------------------
def test_both_forms_give_the_unexecuted_tail_in_the_returned_action_space() -> None:
    full = parse({"prev_actions": chunk(10), "inference_delay": 3, "execution_horizon": 7})
    assert (full.delay, full.horizon) == (3, 7) and full.prev_actions.dtype == np.float32
    np.testing.assert_array_equal(full.prev_actions, chunk(10))
    assert parse({"prev_actions": chunk(10).astype(np.float64).tolist(), "inference_delay": 0}).horizon == 10
    session = RtcSession()
    session.last = chunk(16)
    short = parse({"executed": 6, "inference_delay": np.int64(2)}, session)
    np.testing.assert_array_equal(short.prev_actions, chunk(16)[6:])
    assert (short.delay, short.horizon) == (2, 10)


BAD_ENTRIES = [
    ("not a map", [1, 2], "must be a map"),
    ("an unknown field", {"prev_actions": chunk(), "inference_delay": 1, "delay": 2}, "unknown rtc field"),
    ("no delay", {"prev_actions": chunk()}, "inference_delay is required"),
    ("a float delay", {"prev_actions": chunk(), "inference_delay": 1.5}, "must be an integer"),
    ("a negative delay", {"prev_actions": chunk(), "inference_delay": -1}, "must be in 0..15"),
    ("delay >= horizon", {"prev_actions": chunk(16), "inference_delay": 16}, "below the action horizon"),
    ("delay over the server's maximum", {"prev_actions": chunk(), "inference_delay": 9}, "--rtc-max-delay"),
    ("delay beyond the actions given", {"prev_actions": chunk(2), "inference_delay": 3}, "exceeds the 2 previous"),
    ("both forms", {"prev_actions": chunk(), "executed": 2, "inference_delay": 1}, "exactly one of"),
    ("neither form", {"inference_delay": 1}, "exactly one of"),
    ("a wrong action dim", {"prev_actions": np.zeros((10, 7), np.float32), "inference_delay": 1}, "shape (h, 8)"),
    (
        "more rows than the horizon",
        {"prev_actions": np.zeros((17, 8), np.float32), "inference_delay": 1},
        "1 <= h <= 16",
    ),
    ("one dimension", {"prev_actions": np.zeros(8, np.float32), "inference_delay": 0}, "shape (h, 8)"),
    ("no rows", {"prev_actions": np.zeros((0, 8), np.float32), "inference_delay": 0}, "1 <= h <= 16"),
    ("a string array", {"prev_actions": np.array([["a"] * 8]), "inference_delay": 0}, "float array"),
    ("NaN", {"prev_actions": np.where(chunk() > 1, np.nan, chunk()), "inference_delay": 1}, "NaN or inf"),
    ("inf", {"prev_actions": np.where(chunk() > 1, np.inf, chunk()), "inference_delay": 1}, "NaN or inf"),
    ("beyond float32", {"prev_actions": np.full((4, 8), 1e300), "inference_delay": 1}, "NaN or inf"),
    (
        "a horizon below the delay",
        {"prev_actions": chunk(), "inference_delay": 3, "execution_horizon": 2},
        "execution_horizon must be in 3..10",
    ),
    (
        "a horizon beyond the actions",
        {"prev_actions": chunk(), "inference_delay": 3, "execution_horizon": 11},
        "execution_horizon must be in 3..10",
    ),
]


@pytest.mark.parametrize(("entry", "words"), [pytest.param(e, w, id=i) for i, e, w in BAD_ENTRIES])
def test_every_bad_entry_is_invalid_rtc_naming_the_problem(entry: Any, words: str) -> None:
    with pytest.raises(InvalidRtc) as info:
        parse(entry)
    assert info.value.kind is ErrorKind.INVALID_RTC and words in str(info.value)


def test_the_short_form_needs_a_chunk_received_on_this_connection() -> None:
    for session in (None, RtcSession()):
        with pytest.raises(RequestError) as info:
            parse({"executed": 2, "inference_delay": 1}, session)
        assert info.value.kind is ErrorKind.RTC_NO_PREVIOUS_CHUNK and "received none" in str(info.value)
    session = RtcSession()
    session.last = chunk(16)
    with pytest.raises(InvalidRtc, match="executed must be in 0..15") as bad:
        parse({"executed": 16, "inference_delay": 0}, session)
    assert bad.value.kind is ErrorKind.INVALID_RTC
    with pytest.raises(InvalidRtc, match="exceeds the 2 previous"):
        parse({"executed": 14, "inference_delay": 3}, session)


def test_support_follows_the_flag_and_the_policy() -> None:
    on = RtcSupport.of("guided", None, action_horizon=16, unsupported=None)
    on.check()
    assert on.metadata() == {"mode": "guided", "max_inference_delay": 15, "forms": ["prev_actions", "executed"]}
    assert RtcSupport.of("inpaint", 40, 16, None).max_delay == 15
    assert RtcSupport.of("inpaint", 4, 16, None).max_delay == 4
    for support, words in (
        (RtcSupport.of("off", None, 16, None), "--rtc off"),
        (RtcSupport.of("guided", None, 16, "policy x cannot map"), "policy x cannot map"),
    ):
        assert support.metadata()["mode"] == "off"
        with pytest.raises(RequestError, match=words) as info:
            support.check()
        assert info.value.kind is ErrorKind.RTC_UNSUPPORTED


# --- the sampler ---------------------------------------------------------------------------------------------
STEPS = 4
DELAY = 3
EXECUTED = 6  # the previous chunk's actions the robot executed before it asked: the tail is 10 actions


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint: Path) -> Path:
    return tiny_checkpoint


@pytest.fixture(scope="module")
def policy(checkpoint: Path) -> ReferencePolicy:
    torch.set_num_threads(1)
    return ReferencePolicy.load(str(checkpoint), device=torch.device("cpu"), dtype=torch.float32)


def run(
    policy: ReferencePolicy,
    seeds: list[int],
    rtc: Sequence[RtcConstraint | None] | None = None,
    rtc_mode: RtcMode = "off",
    cfg_mode: CfgMode = "sequential",
    variants: list[int] | None = None,
    steps: int = STEPS,
) -> torch.Tensor:
    """Final x of a batch: one request per seed, observation ``variants[i]`` (default: all the same)."""
    obs = [example_observation(PolicyConfig(), v, image_hw=(32, 32)) for v in (variants or [0] * len(seeds))]
    sample = collate([policy.prepare(o) for o in obs])
    return sample_actions(
        policy,
        sample,
        seeds,
        steps=steps,
        guidance=3.0,
        mode=cfg_mode,
        rtc_mode=rtc_mode,
        rtc=rtc,
    )


def tails(policy: ReferencePolicy, seeds: list[int]) -> list[np.ndarray]:
    """What robots would be executing: chunks sampled from other seeds, less their first EXECUTED actions."""
    return [policy.postprocess(x[None])[EXECUTED:] for x in run(policy, [s + 7919 for s in seeds])]


def test_the_reference_policy_maps_its_actions_back() -> None:
    assert rtc_unsupported.__doc__  # the check each server makes at start
    cfg = PolicyConfig(action_mean=[0.5] * 8, action_std=[2.0] * 8)
    from policy_operator.runtime.policy.reference import FlowTransformer

    p = ReferencePolicy(cfg, FlowTransformer(cfg), torch.device("cpu"), torch.float32)
    assert rtc_unsupported(p) is None
    x = torch.randn(1, 16, 8)
    np.testing.assert_allclose(p.actions_to_model(p.postprocess(x)).numpy(), x[0].numpy(), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rtc_mode", ["inpaint", "guided"])
def test_the_frozen_prefix_is_the_previous_actions_exactly(policy: ReferencePolicy, rtc_mode: RtcMode) -> None:
    seeds = [1, 2]
    constraints = [RtcConstraint(policy.actions_to_model(t), DELAY, len(t)) for t in tails(policy, seeds)]
    x = run(policy, seeds, constraints, rtc_mode)
    for row, c in zip(x, constraints, strict=True):
        assert torch.equal(row[:DELAY], c.target[:DELAY])
        assert not torch.equal(row[DELAY], c.target[DELAY])  # the rest is the policy's, guided


@pytest.mark.parametrize("rtc_mode", ["guided", "inpaint"])
def test_rtc_lowers_the_discontinuity_at_the_switch_over_50_seeds(policy: ReferencePolicy, rtc_mode: RtcMode) -> None:
    """At the switch (index d) the robot goes from the old chunk to the new one: over 50 seeds the first new action
    is far closer to the action the old chunk had for that tick with RTC, and the new chunk stays near the old
    plan where guided.  (The raw jump from the last old action also holds the policy's own step between
    consecutive actions, which for random weights is as large as a switch: chunk_executor.py.)"""
    seeds = list(range(50))
    old = tails(policy, seeds)
    constraints = [RtcConstraint(policy.actions_to_model(t), DELAY, len(t)) for t in old]
    stats = {}
    modes: tuple[RtcMode, RtcMode] = ("off", rtc_mode)
    for mode in modes:
        x = run(policy, seeds, constraints if mode != "off" else None, mode, steps=10)
        new = [policy.postprocess(row[None]) for row in x]
        stats[mode] = (
            np.mean([boundary_jump(o[DELAY], n[DELAY]) for o, n in zip(old, new, strict=True)]),
            np.mean([np.abs(n[DELAY : len(o)] - o[DELAY:]).mean() for o, n in zip(old, new, strict=True)]),
        )
    (switch_off, gap_off), (switch_rtc, gap_rtc) = stats["off"], stats[rtc_mode]
    assert switch_rtc < 0.2 * switch_off, stats
    assert gap_rtc < 0.6 * gap_off, stats


@pytest.mark.parametrize("cfg_mode", ["sequential", "batched"])
@pytest.mark.parametrize("rtc_mode", ["inpaint", "guided"])
def test_a_batch_mixing_rtc_and_plain_rows_gives_each_row_its_own(
    policy: ReferencePolicy, cfg_mode: CfgMode, rtc_mode: RtcMode
) -> None:
    seeds, variants = [5, 6, 7], [0, 1, 2]
    old = tails(policy, seeds)
    mixed = [
        RtcConstraint(policy.actions_to_model(old[0]), DELAY, len(old[0])),
        None,
        RtcConstraint(policy.actions_to_model(old[2][:5]), 2, 4),
    ]
    x = run(policy, seeds, mixed, rtc_mode, cfg_mode, variants)
    plain = run(policy, seeds, None, "off", cfg_mode, variants)
    assert torch.equal(x[1], plain[1])  # a row without rtc: bitwise what the same batch computes without RTC
    for i in (0, 2):  # a row with rtc: what it gets alone, up to the batch's floating-point reassociation
        alone = run(policy, [seeds[i]], [mixed[i]], rtc_mode, cfg_mode, [variants[i]])
        torch.testing.assert_close(x[i], alone[0], rtol=0, atol=1e-5)
        assert not torch.allclose(x[i], plain[i], atol=1e-3)


def test_weights_follow_the_paper() -> None:
    w = prefix_weights(3, 10, 16)
    assert w[:3].tolist() == [1.0] * 3 and w[10:].abs().sum() == 0
    assert all(1 > a > b > 0 for a, b in zip(w[3:10].tolist(), w[4:10].tolist(), strict=False))


# --- the client's executor ---------------------------------------------------------------------------------
class GatedServer:
    """An ``infer`` whose replies the test releases: the delay in ticks is the test's choice, not the clock's."""

    def __init__(self, horizon: int = 16) -> None:
        self.horizon = horizon
        self.requests: list[dict[str, Any]] = []
        self.gate = threading.Semaphore(0)

    def __call__(self, obs: dict[str, Any]) -> np.ndarray:
        self.requests.append(obs)
        n = len(self.requests)
        if n > 1:
            self.gate.acquire(timeout=10)
        return np.full((self.horizon, 2), float(n), np.float32) + np.arange(self.horizon, dtype=np.float32)[:, None]


def tick_until_reply(executor: ChunkExecutor, server: GatedServer, ticks: int) -> list[np.ndarray]:
    """``ticks`` actions; the pending reply is released, and awaited, only before the last."""
    actions = [executor.act({}) for _ in range(ticks - 1)]
    pending = executor.in_flight
    assert pending is not None, "a request is in flight"
    server.gate.release()
    pending.result(timeout=10)
    actions.append(executor.act({}))
    return actions


def test_the_executor_switches_to_the_new_chunk_at_its_delay_and_sends_the_tail() -> None:
    server = GatedServer()
    executor = ChunkExecutor(server, execution_horizon=6, rtc=True, short_form=False)
    try:
        first = [executor.act({}) for _ in range(5)]  # ticks 0..4 of chunk 1; the request goes at tick 5
        np.testing.assert_array_equal(np.array(first)[:, 0], 1 + np.arange(5))
        actions = tick_until_reply(executor, server, 4)  # sent at tick 5, used at tick 8: delay 3
        sent = server.requests[1]["rtc"]
        assert sent["inference_delay"] == 1  # the first estimate; later ones follow the measured delays
        np.testing.assert_array_equal(sent["prev_actions"][:, 0], 1 + np.arange(5, 16))
        assert [a[0] for a in actions] == [1 + 5, 1 + 6, 1 + 7, 2 + 3]  # chunk 2 from its action 3
        assert executor.stats.delays == [3]
        assert executor.stats.boundary_jumps == [boundary_jump(actions[-2], actions[-1])]
        assert executor.expected_delay(remaining=10) == 3
    finally:
        server.gate.release(10)
        executor.close()


def test_the_executor_short_form_and_without_rtc() -> None:
    server = GatedServer()
    executor = ChunkExecutor(server, execution_horizon=2, rtc=True)
    plain_server = GatedServer()
    plain = ChunkExecutor(plain_server, execution_horizon=2, rtc=False)
    try:
        executor.act({})
        tick_until_reply(executor, server, 3)
        assert server.requests[1]["rtc"] == {"executed": 1, "inference_delay": 1}
        plain.act({})
        tick_until_reply(plain, plain_server, 3)
        assert "rtc" not in plain_server.requests[1]
    finally:
        for s in (server, plain_server):
            s.gate.release(10)
        executor.close()
        plain.close()


# --- real servers (slow) --------------------------------------------------------------------------------------
SERVE = ["--threads", "1", "--steps", "4", "--error-format", "dict", "--max-batch", "1"]


@pytest.fixture(scope="module")
def guided_server(checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(checkpoint, "--rtc", "guided", "--rtc-max-delay", "5", *SERVE) as server:
        yield server


def ask(ws: ClientConnection, meta: dict[str, Any], seed: int, rtc: dict[str, Any] | None = None) -> dict[str, Any]:
    obs = robolab_observation(meta, 3, fixed_seed=seed)
    if rtc is not None:
        obs["rtc"] = rtc
    ws.send(wire.packb(obs))
    return wire.unpackb(ws.recv(timeout=120))


@contextmanager
def session(server: PolicyServerProcess) -> Iterator[tuple[ClientConnection, dict[str, Any]]]:
    """One connection and the metadata frame it opened with."""
    with connect(server.url, compression=None, open_timeout=30, max_size=None) as ws:
        yield ws, wire.unpackb(ws.recv(timeout=30))


@pytest.mark.slow
def test_a_server_answers_both_forms_and_fails_only_bad_entries(guided_server: PolicyServerProcess) -> None:
    with session(guided_server) as (ws, meta):
        assert meta["rtc"] == {"mode": "guided", "max_inference_delay": 5, "forms": ["prev_actions", "executed"]}
        fresh = ask(ws, meta, 1, {"executed": 0, "inference_delay": 1})  # nothing received yet on this connection
        assert fresh["error"]["kind"] == "rtc_no_previous_chunk"
        first = np.asarray(ask(ws, meta, 1)["actions"])
        tail = first[6:] + np.float32(0.25)  # any tail: the first d come back bit for bit
        full = np.asarray(ask(ws, meta, 2, {"prev_actions": tail, "inference_delay": 4})["actions"])
        assert np.array_equal(full[:4], tail[:4]) and not np.array_equal(full[4], tail[4])
        short = np.asarray(ask(ws, meta, 3, {"executed": 5, "inference_delay": 3, "execution_horizon": 6})["actions"])
        assert np.array_equal(short[:3], full[5:8])  # the short form refers to the chunk received last
        for entry, kind in (
            ({"prev_actions": tail[:, :3], "inference_delay": 1}, "invalid_rtc"),
            ({"prev_actions": tail, "inference_delay": 16}, "invalid_rtc"),
            ({"prev_actions": tail, "inference_delay": 6}, "invalid_rtc"),  # over --rtc-max-delay
            ({"prev_actions": np.full_like(tail, np.nan), "inference_delay": 1}, "invalid_rtc"),
            ({"executed": 99, "inference_delay": 1}, "invalid_rtc"),
        ):
            reply = ask(ws, meta, 4, entry)
            assert reply.get("type") == "error" and reply["error"]["kind"] == kind, reply
        again = np.asarray(ask(ws, meta, 3, {"executed": 5, "inference_delay": 3})["actions"])
        assert np.array_equal(again[:3], short[5:8])  # failed requests leave the chunk referred to as it was
    assert guided_server.alive
    assert guided_server.metric("policy_request_errors_total", kind="invalid_rtc") == 5


@pytest.mark.slow
def test_cfgp2_computes_what_cfgp1_computes_under_rtc(checkpoint: Path, guided_server: PolicyServerProcess) -> None:
    def chunks(server: PolicyServerProcess) -> list[np.ndarray]:
        with session(server) as (ws, meta):
            first = np.asarray(ask(ws, meta, 7)["actions"])
            return [
                first,
                np.asarray(ask(ws, meta, 8, {"prev_actions": first[5:], "inference_delay": 2})["actions"]),
                np.asarray(ask(ws, meta, 9, {"executed": 4, "inference_delay": 3})["actions"]),
            ]

    with serve_policy(checkpoint, "--cfgp", "2", "--rtc", "guided", "--rtc-max-delay", "5", *SERVE) as parallel:
        two = chunks(parallel)
    one = chunks(guided_server)
    for a, b in zip(one, two, strict=True):
        assert np.array_equal(a, b), np.abs(a - b).max()  # the same batch-1 kernels: bitwise, as without RTC


@pytest.mark.slow
def test_a_server_without_rtc_refuses_it_and_the_client_says_so(checkpoint: Path) -> None:
    with serve_policy(checkpoint, *SERVE) as server:
        with session(server) as (ws, meta):
            assert meta["rtc"]["mode"] == "off"
            reply = ask(ws, meta, 1, {"executed": 0, "inference_delay": 1})
            assert reply["error"]["kind"] == "rtc_unsupported" and "--rtc off" in reply["error"]["message"]
            assert np.asarray(ask(ws, meta, 1)["actions"]).shape == SHAPE  # and serves plain requests
        with pytest.raises(RuntimeError, match="does not do real-time chunking"):
            simulate(server.url, control_hz=15, seconds=1, rtc=True)


@pytest.mark.slow
def test_the_simulated_robot_switches_near_the_old_plan_with_rtc(guided_server: PolicyServerProcess) -> None:
    """A robot at 4 Hz against the server.  A switch whose reply came within the delay its request announced
    starts on (delay < d: exactly on) the old chunk's action for that tick, or next to it (delay = d: the first
    guided action); without RTC it jumps.  Real time: which switches are on time depends on the machine's load,
    so their number is bounded loosely."""
    plain = simulate(guided_server.url, control_hz=4, seconds=6, rtc=False, execution_horizon=6)
    rtc = simulate(guided_server.url, control_hz=4, seconds=6, rtc=True, execution_horizon=6)
    assert plain["switches"] >= 2 and rtc["switches"] >= 2, (plain, rtc)
    assert rtc["on_time_offsets"], rtc
    assert np.mean(rtc["on_time_offsets"]) < 0.5 * plain["switch_offset_mean"], (plain, rtc)
