"""LingBot-VA through ``--policy lerobot``: its video guidance runs through the server's own CFG path.

The reference answer is LeRobot's own, on a tiny random-weight checkpoint
written offline (runtime/policy/lerobot/family_lingbot_va.py bundles a tiny
Wan2.2-shaped VAE, UMT5 encoder and T5 tokenizer): ``reset()``, the global
generator seeded with the request's seed, ``predict_action_chunk`` with the
guidance under test, its postprocessor.  LeRobot runs both branches as one
batch of two; the server's sequential and cfgp=2 layouts run batch-1 forwards,
so they match LeRobot within ``ATOL`` (measured: 1e-6) and each other
bitwise.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

from policy_operator.builtin_policies import LEROBOT_FAMILIES, launch_has_unconditional  # noqa: E402
from policy_operator.cli import main as policyserver  # noqa: E402
from policy_operator.exit_codes import CheckpointExit  # noqa: E402
from policy_operator.layout import LayoutError  # noqa: E402
from policy_operator.runtime.engine.history import SessionHistory  # noqa: E402
from policy_operator.runtime.errors import InvalidObservation, NoSessionState  # noqa: E402
from policy_operator.runtime.policy.interface import Branch, Sample, collate  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.families import family_class  # noqa: E402
from policy_operator.runtime.policy.lerobot.family_lingbot_va import LingBotVA  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import SamplerSettings, sample_actions  # noqa: E402
from policy_operator.runtime.policy.session_state import KEYFRAMES, SESSION_ACTIONS, SESSION_TAG  # noqa: E402
from tests.support.servers import serve_policy  # noqa: E402

ATOL = 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def lingbot_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("lingbot_va", tmp_path_factory.mktemp("lingbot_va") / "ckpt", seed=4)


@pytest.fixture(scope="module")
def lingbot(lingbot_dir: Path) -> LeRobotPolicy:
    return LeRobotPolicy.load(str(lingbot_dir), device=CPU)


def ours(policy: LeRobotPolicy, observations: list[dict[str, Any]], seeds: list[int], **kwargs: Any) -> np.ndarray:
    """The server's sampler on a batch of requests."""
    sample = collate([policy.prepare(obs) for obs in observations])
    x = sample_actions(policy, sample, seeds, **kwargs)
    return np.stack(policy.postprocess_batch(x, sample))


def lerobots_own(policy: LeRobotPolicy, obs: dict[str, Any], seed: int, guidance: float) -> np.ndarray:
    """LeRobot's first chunk: its preprocessor, predict_action_chunk after reset() with the seeded global generator
    (what ``_infer`` draws its latents and actions from), its postprocessor."""
    loaded = policy.loaded
    config = loaded.policy.config
    saved, config.guidance_scale = config.guidance_scale, guidance
    try:
        loaded.policy.reset()
        batch = loaded.preprocessor(policy.spec.parse(obs))
        torch.manual_seed(seed)
        with torch.inference_mode():
            return loaded.postprocessor(loaded.policy.predict_action_chunk(batch))[0].numpy()
    finally:
        config.guidance_scale = saved
        loaded.policy.reset()


# --- the same actions as LeRobot, in every CFG layout of one rank --------------------------------------------
@pytest.mark.parametrize("guidance", [5.0, 1.0, 2.5])
def test_lingbot_va_answers_as_lerobot_sequential_and_batched(lingbot: LeRobotPolicy, guidance: float) -> None:
    obs = lingbot.example_observation(3)
    theirs = lerobots_own(lingbot, obs, 11, guidance)
    sequential = ours(lingbot, [obs], [11], guidance=guidance, mode="sequential")[0]
    batched = ours(lingbot, [obs], [11], guidance=guidance, mode="batched")[0]
    assert sequential.shape == lingbot.action_shape == (4, 6) and sequential.dtype == np.float32
    np.testing.assert_allclose(sequential, theirs, rtol=0, atol=ATOL)
    np.testing.assert_allclose(batched, theirs, rtol=0, atol=ATOL)


def test_guidance_and_seed_change_the_actions(lingbot: LeRobotPolicy) -> None:
    obs = lingbot.example_observation(5)
    guided = ours(lingbot, [obs], [2], guidance=5.0)[0]
    assert not np.allclose(guided, ours(lingbot, [obs], [2], guidance=1.0)[0], atol=1e-3)  # the branch matters
    assert not np.allclose(guided, ours(lingbot, [obs], [3], guidance=5.0)[0], atol=1e-3)  # the seed is the noise
    other = {**obs, "task": "open the drawer"}
    assert not np.allclose(guided, ours(lingbot, [other], [2], guidance=5.0)[0], atol=1e-3)  # the prompt conditions


def test_batched_requests_equal_each_alone(lingbot: LeRobotPolicy) -> None:
    observations = [lingbot.example_observation(k) for k in (1, 2, 3)]
    observations[1]["task"] = "stack the blocks"
    together = ours(lingbot, observations, [5, 6, 7], guidance=5.0, mode="batched")
    for k, obs in enumerate(observations):
        np.testing.assert_allclose(together[k], ours(lingbot, [obs], [5 + k], guidance=5.0)[0], rtol=0, atol=ATOL)


def test_guidance_one_never_computes_the_unconditional_branch(lingbot: LeRobotPolicy) -> None:
    branches: list[Branch] = []
    condition = lingbot.condition

    def spy(sample: Any, branch: Branch) -> Any:
        branches.append(branch)
        return condition(sample, branch)

    lingbot.condition = spy  # type: ignore[method-assign]
    try:
        ours(lingbot, [lingbot.example_observation(0)], [1], guidance=1.0, mode="batched")
    finally:
        del lingbot.condition
    assert branches == [Branch.COND]


# --- the checkpoint's guidance, what a launch accepts, the metadata ------------------------------------------
def test_guidance_is_the_checkpoints_unless_the_flag_says_otherwise(lingbot: LeRobotPolicy, lingbot_dir: Path) -> None:
    assert lingbot.has_unconditional and lingbot.default_guidance == 5.0
    assert SamplerSettings(None, None, "sequential").for_policy(lingbot).guidance == 5.0
    assert SamplerSettings(None, 2.0, "sequential").for_policy(lingbot, cfgp=2).guidance == 2.0
    with pytest.raises(LayoutError, match="cfgp=2 needs classifier-free guidance"):
        SamplerSettings(None, 1.0, "sequential").for_policy(lingbot, cfgp=2)
    with pytest.raises(ValueError, match="leave --steps unset"):
        SamplerSettings(3, None, "sequential").for_policy(lingbot)
    assert launch_has_unconditional("lerobot", str(lingbot_dir)) is True  # before torch, from config.json
    assert launch_has_unconditional("lerobot", "hf://org/not-fetched-yet") is None  # the pod decides on load


def test_a_launch_accepts_cfgp2_for_a_cfg_family_only(lingbot_dir: Path, tmp_path: Path) -> None:
    """``serve``'s checks before torch (runtime/worker.py validate_layout): the local checkpoint's family decides."""
    from policy_operator.runtime.worker import validate_layout
    from tests.support.serve_options import parse_serve

    def launch(checkpoint: Path, *flags: str) -> None:
        validate_layout(parse_serve(["--checkpoint", str(checkpoint), "--policy", "lerobot", *flags]))

    launch(lingbot_dir, "--cfgp", "2")  # its own guidance, 5.0
    launch(lingbot_dir, "--cfgp", "2", "--guidance", "2.0")
    with pytest.raises(LayoutError, match="cfgp=2 needs classifier-free guidance"):
        launch(lingbot_dir, "--cfgp", "2", "--guidance", "1.0")
    unguided = tmp_path / "smolvla"
    unguided.mkdir()
    (unguided / "config.json").write_text('{"type": "smolvla"}')
    with pytest.raises(LayoutError, match="no unconditional branch"):
        launch(unguided, "--cfgp", "2")
    # the family a PolicyServer declared (spec.policy.family -> --lerobot-family) is the checkpoint's, or no start
    launch(lingbot_dir, "--cfgp", "2", "--lerobot-family", "lingbot_va")
    with pytest.raises(LayoutError, match="--lerobot-family lingbot_va .* names type smolvla"):
        launch(unguided, "--lerobot-family", "lingbot_va")
    with pytest.raises(LayoutError, match="--lerobot-family smolvla .* names type lingbot_va"):
        launch(lingbot_dir, "--lerobot-family", "smolvla")
    # a source still to fetch: the declared family decides before torch (and the fetched type is checked on load)
    launch(tmp_path / "not-fetched", "--cfgp", "2", "--lerobot-family", "lingbot_va")
    with pytest.raises(LayoutError, match="no unconditional branch"):
        launch(tmp_path / "not-fetched", "--cfgp", "2", "--lerobot-family", "xvla")


def test_metadata_names_keys_chunk_guidance_and_rtc(lingbot: LeRobotPolicy) -> None:
    meta = lingbot.metadata()
    assert meta["lerobot_type"] == "lingbot_va" and meta["chunk_shape"] == [4, 6]
    assert set(meta["observation_keys"]) == {
        "observation.images.top",
        "observation.images.wrist",
        "observation.state",
        "task",
    }
    assert lingbot.rtc_unsupported_reason is not None and "LingBot-VA" in lingbot.rtc_unsupported_reason


def test_registry_rows_match_the_family_classes() -> None:
    """The torch-free registry (what a launch reads before torch) says what each family's class says."""
    for kind, row in LEROBOT_FAMILIES.items():
        assert family_class(kind).has_unconditional == row.has_unconditional, kind


# --- cfgp=2 on two gloo ranks: bitwise the sequential layout ---------------------------------------------------
@pytest.mark.slow
def test_cfgp2_serves_the_same_actions_as_cfgp1(lingbot_dir: Path, lingbot: LeRobotPolicy) -> None:
    obs = {**lingbot.example_observation(4), "seed": 9}
    answers = {}
    for name, args in {
        "cfgp1": ("--cfg-mode", "sequential"),
        "cfgp2": ("--cfgp", "2", "--backend", "gloo"),
    }.items():
        with serve_policy(lingbot_dir, "--policy", "lerobot", "--threads", "1", "--max-batch", "1", *args) as server:
            client = WebsocketClientPolicy(server.url)
            meta = client.get_server_metadata()
            assert meta["guidance"] == 5.0 and meta["chunk_shape"] == [4, 6]
            assert meta["rtc"]["mode"] == "off"
            answers[name] = np.asarray(client.infer(dict(obs))["actions"])
    assert np.array_equal(answers["cfgp2"], answers["cfgp1"]), np.abs(answers["cfgp2"] - answers["cfgp1"]).max()
    np.testing.assert_allclose(answers["cfgp1"], lerobots_own(lingbot, obs, 9, 5.0), rtol=0, atol=ATOL)


def test_checkpoint_init_writes_the_family_and_it_verifies(lingbot_dir: Path, tmp_path: Path) -> None:
    """``policyserver checkpoint init --lerobot lingbot_va`` writes the fixture's bytes, and ``checkpoint verify`` (the
    pods' init container: manifest, hashes, the trusted-steps checks) accepts it."""
    written = tmp_path / "ckpt"
    assert policyserver(["checkpoint", "init", "--lerobot", "lingbot_va", "--seed", "4", str(written)]) == 0
    for name in (
        "model.safetensors",
        "wan/vae/diffusion_pytorch_model.safetensors",
        "wan/text_encoder/model.safetensors",
    ):
        assert (written / name).read_bytes() == (lingbot_dir / name).read_bytes(), name
    assert policyserver(["checkpoint", "verify", str(written), "--hashes"]) == CheckpointExit.OK


# --- a session's memory: the world model's KV cache across chunks, owned by the session ------------------------
def lerobots_stream(policy: LeRobotPolicy, observations: list[dict[str, Any]], seeds: list[int]) -> list[np.ndarray]:
    """LeRobot's own stream: ``select_action`` on every observation after ``reset()``, the global generator seeded
    with chunk k's seed before the call that predicts it; each chunk ``predict_action_chunk`` answered, postprocessed.
    Its ``select_action`` buffers every observation after the first as a keyframe (action_per_frame 4: a stride of
    one) and feeds them back with the chunk's actions before the next chunk."""
    loaded = policy.loaded
    lerobot_policy = loaded.policy
    chunks: list[torch.Tensor] = []
    predict = lerobot_policy.predict_action_chunk

    def recorded(batch: Any, **kwargs: Any) -> torch.Tensor:
        chunks.append(predict(batch, **kwargs))
        return chunks[-1]

    lerobot_policy.reset()
    lerobot_policy.predict_action_chunk = recorded
    try:
        for k, obs in enumerate(observations):
            batch = loaded.preprocessor(policy.spec.parse(obs))
            if k == 0 or not lerobot_policy._action_queue:  # noqa: SLF001 - this call predicts the next chunk
                torch.manual_seed(seeds[len(chunks)])
            with torch.inference_mode():
                lerobot_policy.select_action(batch)
    finally:
        del lerobot_policy.predict_action_chunk
        lerobot_policy.reset()
    return [loaded.postprocessor(chunk)[0].numpy() for chunk in chunks]


def session_requests(policy: LeRobotPolicy, observations: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The same stream as a robot sends it to the server: the first observation alone (a first chunk), then each
    chunk's latest observation with the ones recorded before it since the last chunk as ``keyframes``."""
    family = lingbot_family(policy)
    requests, at = [dict(observations[0])], 1
    for chunk in range(1, len(STREAM_SEEDS)):
        n = family.keyframes(chunk)
        *earlier, latest = observations[at : at + n]
        requests.append({**latest, KEYFRAMES: earlier})
        at += n
    return requests


STREAM_SEEDS = [11, 12, 13]  # three chunks: the pool (attn_window 4: two chunks) evicts in the third


def lingbot_family(policy: LeRobotPolicy) -> LingBotVA:
    assert isinstance(policy.family, LingBotVA)
    return policy.family


def stream_observations(policy: LeRobotPolicy, base: int) -> list[dict[str, Any]]:
    family = lingbot_family(policy)
    count = 1 + sum(family.keyframes(k) for k in range(1, len(STREAM_SEEDS)))
    return [policy.example_observation(base + k) for k in range(count)]


def served(
    policy: LeRobotPolicy,
    history: SessionHistory,
    session: str,
    requests: list[dict[str, Any]],
    seeds: list[int],
    **kwargs: Any,
) -> list[np.ndarray]:
    """Each request through the ingress's session ledger (engine/history.py), then the sampler, one batch each."""
    answers = []
    for request, seed in zip(requests, seeds, strict=True):
        sample = history.extend(session, policy.prepare(request), request)
        answers.append(policy.postprocess_batch(sample_actions(policy, sample, [seed], **kwargs), sample)[0])
        history.answered(session, answers[-1])  # what the engine tells it of each answer
    return answers


@pytest.fixture(scope="module")
def stream_a(lingbot: LeRobotPolicy) -> tuple[list[dict[str, Any]], list[np.ndarray]]:
    observations = stream_observations(lingbot, 100)
    return session_requests(lingbot, observations), lerobots_stream(lingbot, observations, STREAM_SEEDS)


@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_a_session_continues_as_lerobots_own_stream(
    lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]], mode: str
) -> None:
    requests, theirs = stream_a
    ours_ = served(lingbot, SessionHistory(lingbot), "a", requests, STREAM_SEEDS, guidance=5.0, mode=mode)
    assert [a.shape for a in ours_] == [(4, 6), (8, 6), (8, 6)]  # a first chunk drops frame 0, later ones keep it
    for k, (mine, lerobot) in enumerate(zip(ours_, theirs, strict=True)):
        np.testing.assert_allclose(mine, lerobot, rtol=0, atol=ATOL, err_msg=f"chunk {k}")


def test_interleaved_sessions_answer_as_each_alone(
    lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]]
) -> None:
    """Two robots' sessions, their second chunks in one batch and their third ones in turn, answer what each
    answers alone (LeRobot's stream): neither sees the other's memory."""
    a_requests, a_theirs = stream_a
    b_observations = stream_observations(lingbot, 300)
    b_requests, b_theirs = (
        session_requests(lingbot, b_observations),
        lerobots_stream(lingbot, b_observations, [21, 22, 23]),
    )
    history = SessionHistory(lingbot)
    kwargs: dict[str, Any] = {"guidance": 5.0, "mode": "batched"}
    got: dict[str, list[np.ndarray]] = {"a": [], "b": []}
    got["b"] += served(lingbot, history, "b", b_requests[:1], [21], **kwargs)
    got["a"] += served(lingbot, history, "a", a_requests[:1], [11], **kwargs)
    both = collate([history.extend(s, lingbot.prepare(r), r) for s, r in (("a", a_requests[1]), ("b", b_requests[1]))])
    together = lingbot.postprocess_batch(sample_actions(lingbot, both, [12, 22], **kwargs), both)
    history.answered("a", together[0])
    history.answered("b", together[1])
    got["a"].append(together[0])
    got["b"].append(together[1])
    got["a"] += served(lingbot, history, "a", a_requests[2:], [13], **kwargs)
    got["b"] += served(lingbot, history, "b", b_requests[2:], [23], **kwargs)
    for name, theirs in (("a", a_theirs), ("b", b_theirs)):
        for k, (mine, lerobot) in enumerate(zip(got[name], theirs, strict=True)):
            np.testing.assert_allclose(mine, lerobot, rtol=0, atol=ATOL, err_msg=f"session {name}, chunk {k}")
    assert not np.allclose(got["a"][2], got["b"][2], atol=1e-3)


def test_a_continuation_that_cannot_continue_says_so(
    lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]]
) -> None:
    requests = stream_a[0]
    first, second = requests[0], requests[1]
    history = SessionHistory(lingbot, max_sessions=1)

    def extend(session: str | None, request: dict[str, Any], answer: bool = True) -> Sample:
        sample = history.extend(session, lingbot.prepare(request), request)
        if answer:  # the engine tells the ledger of each answer (an answer's shape does not matter to it)
            history.answered(session, np.zeros((4, 6), np.float32))
        return sample

    with pytest.raises(NoSessionState, match="session_id"):
        extend(None, second)  # no session id
    with pytest.raises(NoSessionState, match="no state to continue"):
        extend("never-started", second)
    assert SESSION_TAG not in extend(None, first).tensors  # a request alone is a first chunk, no state kept
    extend("a", first, answer=False)
    with pytest.raises(NoSessionState, match="still running"):
        extend("a", second)  # the first chunk's answer did not come yet (or it failed)
    tag = extend("a", first).tensors[SESSION_TAG]
    assert tag[0, 1] == 0  # a first chunk starts the session
    with pytest.raises(InvalidObservation, match="list of the 3 observations"):
        extend("a", {**second, KEYFRAMES: second[KEYFRAMES][:2]})  # one keyframe short
    continued = extend("a", second)
    assert continued.tensors[SESSION_TAG].tolist() == [[tag[0, 0].item(), 1]]
    assert continued.tensors[SESSION_ACTIONS].shape == (1, 4, 6)  # the answer it continues from
    assert continued.tensors["observation.images.top"].shape[:2] == (1, 4)  # the keyframes, the latest last
    with pytest.raises(InvalidObservation, match="list of the 7 observations"):
        extend("a", second)  # chunk 2 follows chunk 1: F frames of keyframes now
    extend("b", first)  # at most max_sessions keep state: a goes
    with pytest.raises(NoSessionState, match="evicted"):
        extend("a", requests[2])
    extend("a", first)  # a first chunk starts it again
    assert extend("a", second).tensors[SESSION_TAG][0, 1] == 1
    with pytest.raises(InvalidObservation, match="keeps no session state"):
        SessionHistory(None).extend("a", lingbot.prepare(first), second)
    assert SessionHistory(lingbot, cfgp=2).state_unsupported is None  # cfgp=2 continues too


def test_the_ranks_refuse_a_state_the_ingress_did_not_give_them(lingbot: LeRobotPolicy) -> None:
    """A tag whose session this rank holds no state of (a replica restarted, a failed batch) fails before any
    session's state changes, and the session must start again."""
    observations = stream_observations(lingbot, 500)
    requests = session_requests(lingbot, observations)
    history = SessionHistory(lingbot)
    history.extend("z", lingbot.prepare(requests[0]), requests[0])
    history.answered("z", np.zeros((4, 6), np.float32))  # the ingress thinks chunk 0 was answered
    sample = history.extend("z", lingbot.prepare(requests[1]), requests[1])
    with pytest.raises(ValueError, match="no state of chunk 1"):
        sample_actions(lingbot, sample, [1], guidance=5.0)


@pytest.mark.slow
def test_a_robot_continues_its_session_over_the_wire(
    lingbot_dir: Path, lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]]
) -> None:
    """The served path, on one rank and with cfgp=2 over gloo: ``keyframes`` decoded from the frame, the session's
    chunks as LeRobot's stream (a first chunk of 4 actions, then 8) and as each other, and a continuation of a
    session this server holds no state of refused alone."""
    requests, theirs = stream_a
    answers: dict[str, list[np.ndarray]] = {}
    for name, args in {"cfgp1": ("--cfg-mode", "sequential"), "cfgp2": ("--cfgp", "2", "--backend", "gloo")}.items():
        with serve_policy(lingbot_dir, "--policy", "lerobot", "--threads", "1", "--max-batch", "1", *args) as server:
            robot = WebsocketClientPolicy(server.url)
            assert robot.get_server_metadata()["session_state"] == {
                "keyframes": {"after_first_chunk": 3, "after_later": 7},
                "max_sessions": 8,
                "continues": True,
                "reason": None,
            }
            answers[name] = [
                np.asarray(robot.infer({**request, "session_id": "r1", "seed": seed})["actions"])
                for request, seed in zip(requests, STREAM_SEEDS, strict=True)
            ]
            stranger = WebsocketClientPolicy(server.url)  # another connection: r1 is not its session
            with pytest.raises(RuntimeError, match="no_session_state: this session has no state to continue"):
                stranger.infer({**requests[2], "session_id": "r1", "seed": 1})
        for k, lerobot in enumerate(theirs):
            np.testing.assert_allclose(answers[name][k], lerobot, rtol=0, atol=ATOL, err_msg=f"{name}, chunk {k}")
    for k in range(len(theirs)):
        assert np.abs(answers["cfgp2"][k] - answers["cfgp1"][k]).max() < 1e-6, f"chunk {k}"


def test_a_buckets_padded_copy_of_a_session_row_changes_nothing(
    lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]]
) -> None:
    """A compiled denoiser's bucket pads a batch with copies of its last request (parallel/dispatch.py): the
    copy of a session's row runs on a copy of its stream, so the session's answers stay LeRobot's."""
    requests, theirs = stream_a
    history = SessionHistory(lingbot)
    kwargs: dict[str, Any] = {"guidance": 5.0, "mode": "batched"}
    for k, request in enumerate(requests):
        sample = history.extend("a", lingbot.prepare(request), request)
        padded = collate([sample, sample])
        x = sample_actions(lingbot, padded, [STREAM_SEEDS[k]] * 2, **kwargs)[:1]
        answer = lingbot.postprocess_batch(x, padded)[0]
        history.answered("a", answer)
        np.testing.assert_allclose(answer, theirs[k], rtol=0, atol=ATOL)


def test_cfgp2s_two_ranks_continue_a_session_as_one_rank(
    lingbot_dir: Path, lingbot: LeRobotPolicy, stream_a: tuple[list[dict[str, Any]], list[np.ndarray]]
) -> None:
    """cfgp=2's split in one process: the conditional rank's policy runs every step, a second instance (the
    unconditional rank, its own streams) the guided ones only, as sampler._parallel does (without the gather).
    The unconditional rank feeds back the actions the robot received (mapped back through the checkpoint's
    statistics: exact within 1e-7) and replays the layout of the steps it skipped: three chunks equal one rank's
    sequential CFG within 1e-6, and LeRobot's stream."""
    requests, theirs = stream_a
    uncond_rank = LeRobotPolicy.load(str(lingbot_dir), device=CPU)
    history = SessionHistory(lingbot, cfgp=2)
    one_rank = served(lingbot, SessionHistory(lingbot), "a", requests, STREAM_SEEDS, guidance=5.0)
    for k, (request, seed) in enumerate(zip(requests, STREAM_SEEDS, strict=True)):
        sample = history.extend("a", lingbot.prepare(request), request)
        integ = lingbot.integrator()
        plan = lingbot.guided_steps(integ.steps)
        with torch.inference_mode():
            x = lingbot.init_noise(seed)
            ctx_c, ctx_u = lingbot.condition(sample, Branch.COND), uncond_rank.condition(sample, Branch.UNCOND)
            for i in range(integ.steps):
                t = integ.time(i, 1, x.device)
                c = lingbot.denoise_step(ctx_c, x, t)
                if plan[i]:
                    u = uncond_rank.denoise_step(ctx_u, x, t)
                    c = u + 5.0 * (c - u)  # sampler.py's guided output
                x = integ.step(x, c, i)
        answer = lingbot.postprocess_batch(x, sample)[0]
        history.answered("a", answer)
        np.testing.assert_allclose(answer, theirs[k], rtol=0, atol=ATOL, err_msg=f"chunk {k}")
        assert np.abs(answer - one_rank[k]).max() < 1e-6, f"chunk {k}"


def test_a_postprocessor_it_cannot_invert_keeps_cfgp2_to_first_chunks(
    lingbot: LeRobotPolicy, lingbot_dir: Path, tmp_path: Path
) -> None:
    """cfgp=2's unconditional rank maps the answered actions back with the saved unnormalizer; a checkpoint whose
    postprocessor has none it can read (here: a state file outside the checkpoint) continues with cfgp=1 only,
    and the ingress says so under cfgp=2."""
    assert lingbot_family(lingbot).cfgp2_unsupported is None
    saved = json.loads((lingbot_dir / "policy_postprocessor.json").read_text())
    saved["steps"][0]["state_file"] = "../elsewhere.safetensors"
    (tmp_path / "policy_postprocessor.json").write_text(json.dumps(saved))
    family = LingBotVA(lingbot.loaded.policy)
    family.attach(tmp_path)
    assert family.cfgp2_unsupported is not None and "cfgp=1 only" in family.cfgp2_unsupported
    policy = cast(LeRobotPolicy, SimpleNamespace(name="lerobot/lingbot_va", history=1, family=family))
    first, second = session_requests(lingbot, stream_observations(lingbot, 700))[:2]
    assert SessionHistory(policy, cfgp=1).state_unsupported is None
    cfgp2 = SessionHistory(policy, cfgp=2)
    cfgp2.extend("a", lingbot.prepare(first), first)
    with pytest.raises(NoSessionState, match="cfgp=1 only"):
        cfgp2.extend("a", lingbot.prepare(second), second)
