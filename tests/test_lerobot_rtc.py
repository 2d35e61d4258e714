"""Real-time chunking on the LeRobot flow families, with the real lerobot code on tiny random-weight checkpoints.

SmolVLA, pi0 and pi0.5 (on a reduced PaliGemma, tests/support/lerobot_tiny.py) run the server's sampler with a
constraint mapped back from returned actions (``actions_to_model``): the frozen prefix, the lower switch
discontinuity, mixed batches and the refusals, then one SmolVLA server end to end.  Diffusion Policy refuses.
Everything is built offline; nothing reaches a hub.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from websockets.sync.client import connect  # noqa: E402

from policy_operator.runtime.chunk_executor import boundary_jump  # noqa: E402
from policy_operator.runtime.errors import ErrorKind, RequestError  # noqa: E402
from policy_operator.runtime.policy.interface import Branch, collate  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.loading import Loaded  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.rtc import (  # noqa: E402
    RtcBatch,
    RtcConstraint,
    RtcMode,
    Step,
    guided_velocity,
    rtc_unsupported,
)
from policy_operator.runtime.policy.sampler import sample_actions  # noqa: E402
from policy_operator.runtime.rtc_session import RTC_KEY, RtcIngress, RtcSession  # noqa: E402
from policy_operator.runtime.serving import wire  # noqa: E402
from tests.support.lerobot_tiny import reduced_paligemma, write_small_pi  # noqa: E402
from tests.support.servers import serve_policy  # noqa: E402

CPU = torch.device("cpu")
DELAY = 2
EXECUTED = 3  # actions of the previous 8-action chunk executed before the request: its tail is 5 actions
STEPS = 10


@pytest.fixture(scope="module")
def smolvla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("smolvla", tmp_path_factory.mktemp("smolvla") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def smolvla(smolvla_dir: Path) -> LeRobotPolicy:
    torch.set_num_threads(1)
    return LeRobotPolicy.load(str(smolvla_dir), device=CPU)


def small_pi(family: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeRobotPolicy]:
    """pi0 / pi0.5 on a reduced PaliGemma (tests/support/lerobot_tiny.py): LeRobot 0.6 has no small variant."""
    root = write_small_pi(family, tmp_path_factory.mktemp(family), seed=3)
    with reduced_paligemma():
        yield LeRobotPolicy.load(str(root), device=CPU)


@pytest.fixture(scope="module")
def pi0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeRobotPolicy]:
    yield from small_pi("pi0", tmp_path_factory)


@pytest.fixture(scope="module")
def pi05(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeRobotPolicy]:
    yield from small_pi("pi05", tmp_path_factory)


@pytest.fixture(params=["smolvla", "pi0", "pi05"])
def flow(request: pytest.FixtureRequest) -> LeRobotPolicy:
    """Every flow family."""
    policy: LeRobotPolicy = request.getfixturevalue(request.param)
    return policy


def run(
    policy: LeRobotPolicy,
    seeds: list[int],
    rtc: Sequence[RtcConstraint | None] | None = None,
    mode: RtcMode = "off",
    variants: list[int] | None = None,
) -> torch.Tensor:
    samples = [policy.prepare(policy.example_observation(v)) for v in (variants or [0] * len(seeds))]
    return sample_actions(
        policy,
        collate(samples),
        seeds,
        steps=STEPS,
        guidance=1.0,
        rtc_mode=mode,
        rtc=rtc,
    )


def tails(policy: LeRobotPolicy, seeds: list[int], variants: list[int] | None = None) -> list[np.ndarray]:
    """What robots would be executing: chunks from other seeds, less their first EXECUTED actions."""
    return [a[EXECUTED:] for a in policy.postprocess_batch(run(policy, [s + 7919 for s in seeds], variants=variants))]


def constraint(
    policy: LeRobotPolicy, tail: np.ndarray, delay: int = DELAY, horizon: int | None = None
) -> RtcConstraint:
    return RtcConstraint(policy.actions_to_model(tail), delay, len(tail) if horizon is None else horizon)


# --- the map back ------------------------------------------------------------------------------------------
def test_returned_actions_map_back_to_the_models_padded_space(flow: LeRobotPolicy) -> None:
    assert rtc_unsupported(flow) is None and flow.rtc_unsupported_reason is None
    x = run(flow, [4])
    back = flow.actions_to_model(flow.postprocess(x))
    horizon, action_dim = flow.action_shape
    assert back.shape == x.shape[1:] == (horizon, flow.loaded.config.max_action_dim) and back.dtype == torch.float32
    torch.testing.assert_close(back[:, :action_dim], x[0, :, :action_dim], rtol=0, atol=1e-5)
    assert back[:, action_dim:].abs().sum() == 0  # the padded dimensions: zeros, as in training


def test_the_soft_part_is_lerobots_own_rtc_processor(smolvla: LeRobotPolicy) -> None:
    """Our ``inpaint`` correction (J = I) of one step is what LeRobot's RTCProcessor computes with the paper's
    schedule and clip (EXP, beta = 5): the same guidance, which the server applies per row and with the prefix
    frozen exactly on top."""
    from lerobot.configs import RTCAttentionSchedule
    from lerobot.policies.rtc.configuration_rtc import RTCConfig
    from lerobot.policies.rtc.modeling_rtc import RTCProcessor

    sample = smolvla.prepare(smolvla.example_observation(1))
    tail = tails(smolvla, [1])[0]
    c = constraint(smolvla, tail, delay=2, horizon=4)
    x = smolvla.init_noise(5)
    ctx = smolvla.condition(sample, Branch.COND)
    processor = RTCProcessor(RTCConfig(prefix_attention_schedule=RTCAttentionSchedule.EXP, max_guidance_weight=5.0))
    for time in (1.0, 0.6, 0.3):
        t = torch.full((1,), time)
        theirs = processor.denoise_step(
            x, c.target[None], 2, time, lambda z, t=t: smolvla.denoise_step(ctx, z, t), execution_horizon=4
        )
        batch = RtcBatch.build([c], tuple(x.shape[1:]), "inpaint", CPU, torch.float32)  # type: ignore[arg-type]
        assert batch is not None

        def forward(z: torch.Tensor, t: torch.Tensor = t) -> Step:
            v = smolvla.denoise_step(ctx, z, t)
            return v, [(v, 1.0)]

        ours = guided_velocity(batch, forward, x, time)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


# --- the sampler -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["inpaint", "guided"])
def test_the_frozen_prefix_is_the_previous_actions(flow: LeRobotPolicy, mode: RtcMode) -> None:
    seeds = [1, 2]
    old = tails(flow, seeds)
    constraints = [constraint(flow, t) for t in old]
    x = run(flow, seeds, constraints, mode)
    for row, c, tail in zip(x, constraints, old, strict=True):
        assert torch.equal(row[:DELAY], c.target[:DELAY])  # exact in the model's space
        assert not torch.equal(row[DELAY], c.target[DELAY])
        actions = flow.postprocess(row[None])
        np.testing.assert_allclose(actions[:DELAY], tail[:DELAY], rtol=0, atol=1e-5)  # the server sets them bitwise


@pytest.mark.parametrize("mode", ["guided", "inpaint"])
def test_rtc_lowers_the_discontinuity_at_the_switch(flow: LeRobotPolicy, mode: RtcMode) -> None:
    """Over 12 seeds and observations: the first new action (index d) is far closer to the old chunk's action for
    that tick with RTC than without, and the guided part of the chunk stays nearer the old plan."""
    seeds = list(range(12))
    variants = [s % 4 for s in seeds]
    old = tails(flow, seeds, variants)
    constraints = [constraint(flow, t) for t in old]
    stats = {}
    modes: tuple[RtcMode, RtcMode] = ("off", mode)
    for m in modes:
        new = flow.postprocess_batch(run(flow, seeds, constraints if m != "off" else None, m, variants))
        stats[m] = (
            np.mean([boundary_jump(o[DELAY], n[DELAY]) for o, n in zip(old, new, strict=True)]),
            np.mean([np.abs(n[DELAY : len(o)] - o[DELAY:]).mean() for o, n in zip(old, new, strict=True)]),
        )
    (switch_off, gap_off), (switch_rtc, gap_rtc) = stats["off"], stats[mode]
    assert switch_rtc < 0.3 * switch_off, stats
    assert gap_rtc < 0.7 * gap_off, stats


@pytest.mark.parametrize("mode", ["inpaint", "guided"])
def test_a_batch_mixing_rtc_and_plain_rows_gives_each_row_its_own(flow: LeRobotPolicy, mode: RtcMode) -> None:
    seeds, variants = [5, 6, 7], [0, 1, 2]
    old = tails(flow, seeds, variants)
    mixed = [constraint(flow, old[0]), None, constraint(flow, old[2][:4], delay=1, horizon=3)]
    x = run(flow, seeds, mixed, mode, variants)
    plain = run(flow, seeds, None, "off", variants)
    assert torch.equal(x[1], plain[1])  # a row without rtc: bitwise what the batch computes without RTC
    for i in (0, 2):
        alone = run(flow, [seeds[i]], [mixed[i]], mode, [variants[i]])
        torch.testing.assert_close(x[i], alone[0], rtol=0, atol=1e-5)
        assert not torch.allclose(x[i], plain[i], atol=1e-3)


# --- refusals --------------------------------------------------------------------------------------------------
def ingress_parse(ingress: RtcIngress, policy: LeRobotPolicy, entry: Any, session: RtcSession | None = None) -> Any:
    return ingress.parse({**policy.example_observation(0), RTC_KEY: entry}, session, policy.action_shape)


@pytest.mark.parametrize(
    ("entry", "kind", "words"),
    [
        ({"prev_actions": np.zeros((5, 8), np.float32), "inference_delay": 1}, "invalid_rtc", "shape (h, 6)"),
        ({"prev_actions": np.zeros((5, 6), np.float32), "inference_delay": 8}, "invalid_rtc", "below the action"),
        ({"prev_actions": np.full((5, 6), np.nan, np.float32), "inference_delay": 1}, "invalid_rtc", "NaN"),
        ({"prev_actions": np.zeros((2, 6), np.float32), "inference_delay": 3}, "invalid_rtc", "exceeds the 2"),
        ({"executed": 2, "inference_delay": 1}, "rtc_no_previous_chunk", "received none"),
    ],
    ids=["action-dim", "delay-horizon", "nan", "delay-beyond-tail", "no-previous-chunk"],
)
def test_bad_entries_fail_with_their_own_kind(smolvla: LeRobotPolicy, entry: Any, kind: str, words: str) -> None:
    ingress = RtcIngress.of(smolvla, "guided", None)
    assert ingress.support.metadata() == {
        "mode": "guided",
        "max_inference_delay": 7,
        "forms": ["prev_actions", "executed"],
    }
    with pytest.raises(RequestError) as info:
        ingress_parse(ingress, smolvla, entry, RtcSession())
    assert info.value.kind is ErrorKind(kind) and words in str(info.value)
    good = ingress_parse(ingress, smolvla, {"prev_actions": np.zeros((5, 6), np.float32), "inference_delay": 1})
    assert good.constraint.target.shape == (5, 8)  # the padded model space


def test_diffusion_and_relative_actions_refuse_with_a_reason(tmp_path: Path, pi0: LeRobotPolicy) -> None:
    diffusion = LeRobotPolicy.load(str(write_tiny_checkpoint("diffusion", tmp_path / "dp", seed=2)), device=CPU)
    reason = rtc_unsupported(diffusion)
    assert reason is not None and "DDIM noise scheduler, not a flow" in reason
    ingress = RtcIngress.of(diffusion, "inpaint", None)
    assert ingress.support.metadata()["mode"] == "off" and ingress.support.metadata()["reason"] == reason
    with pytest.raises(RequestError) as info:
        ingress_parse(ingress, diffusion, {"prev_actions": np.zeros((4, 2), np.float32), "inference_delay": 1})
    assert info.value.kind is ErrorKind.RTC_UNSUPPORTED and "DDIM" in str(info.value)
    # pi0 trained on actions relative to the state: the way back needs the request's state
    post = copy.deepcopy(pi0.loaded.postprocessor)
    for step in post.steps:
        if type(step).__name__ == "AbsoluteActionsProcessorStep":
            step.enabled = True
    relative = LeRobotPolicy(
        Loaded(pi0.loaded.root, pi0.loaded.config, pi0.loaded.policy, pi0.loaded.preprocessor, post),
        CPU,
        torch.float32,
    )
    assert "AbsoluteActionsProcessorStep cannot be inverted" in str(rtc_unsupported(relative))


# --- a real server ------------------------------------------------------------------------------------------------
def ask(ws: Any, obs: dict[str, Any], seed: int, rtc: dict[str, Any] | None = None) -> dict[str, Any]:
    ws.send(wire.packb({**obs, "seed": seed, **({RTC_KEY: rtc} if rtc is not None else {})}))
    reply: dict[str, Any] = wire.unpackb(ws.recv(timeout=120))
    return reply


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["guided"])
def test_a_smolvla_server_answers_rtc_requests(smolvla_dir: Path, smolvla: LeRobotPolicy, mode: str) -> None:
    serve = ["--policy", "lerobot", "--rtc", mode, "--error-format", "dict", "--threads", "1", "--max-batch", "1"]
    with serve_policy(smolvla_dir, *serve) as server:
        with connect(server.url, compression=None, open_timeout=30, max_size=None) as ws:
            meta = wire.unpackb(ws.recv(timeout=30))
            assert meta["lerobot_type"] == "smolvla"
            assert meta["rtc"] == {"mode": mode, "max_inference_delay": 7, "forms": ["prev_actions", "executed"]}
            obs = smolvla.example_observation(2)
            first = np.asarray(ask(ws, obs, 1)["actions"])
            tail = first[EXECUTED:] + np.float32(0.25)
            full = np.asarray(ask(ws, obs, 2, {"prev_actions": tail, "inference_delay": DELAY})["actions"])
            assert full.shape == (8, 6) and np.array_equal(full[:DELAY], tail[:DELAY])
            assert not np.array_equal(full[DELAY], tail[DELAY])
            short = np.asarray(ask(ws, obs, 3, {"executed": 4, "inference_delay": 3})["actions"])
            assert np.array_equal(short[:3], full[4:7])  # the chunk this connection received last
            bad = ask(ws, obs, 4, {"prev_actions": tail[:, :3], "inference_delay": 1})
            assert bad.get("type") == "error" and bad["error"]["kind"] == "invalid_rtc", bad
            again = np.asarray(ask(ws, obs, 3, {"executed": 4, "inference_delay": 3})["actions"])
            assert np.array_equal(again[:3], short[4:7])  # the failed request left the chunk referred to as it was
        assert server.alive
