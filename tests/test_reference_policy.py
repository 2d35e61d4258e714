"""The reference flow-matching policy and the cfgp=1 sampler, in process.

Bounds: sequential and batched CFG run different GEMM shapes (two batch-1
forwards vs one batch-2 forward), so their actions agree to float32 rounding,
not bitwise; ``CFG_MODES_ATOL`` is the documented bound (the sampler's
docstring measures ~1e-6).  Everything that runs the same kernels on the same
inputs is compared bitwise.
"""

from __future__ import annotations

import itertools
import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from policy_operator.constants import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE
from policy_operator.runtime.checkpoint.format import CheckpointError, sha256_file, verify_checkpoint
from policy_operator.runtime.policy.interface import Branch, load_policy_class
from policy_operator.runtime.policy.reference import (
    PolicyConfig,
    ReferencePolicy,
    camera_key,
    example_observation,
    init_checkpoint,
)
from policy_operator.runtime.policy.rtc import warmup_constraint
from policy_operator.runtime.policy.sampler import sample_actions
from tests.support.servers import session_checkpoint

CFG_MODES_ATOL = 1e-5
STEPS = 4
CPU = torch.device("cpu")


def load(path: Path | str) -> ReferencePolicy:
    return ReferencePolicy.load(str(path), device=CPU)


def actions(
    policy: ReferencePolicy,
    obs: dict[str, Any],
    seed: int = 0,
    *,
    guidance: float = 3.0,
    mode: str = "sequential",
    steps: int = STEPS,
) -> np.ndarray:
    x = sample_actions(policy, policy.prepare(obs), [seed], steps=steps, guidance=guidance, mode=mode)  # type: ignore[arg-type]
    return policy.postprocess(x)


@pytest.fixture(scope="module")
def policy(tiny_checkpoint: Path) -> ReferencePolicy:
    return load(tiny_checkpoint)


@pytest.fixture(scope="module")
def obs(policy: ReferencePolicy) -> dict[str, Any]:
    return policy.example_observation(0)


# --- shape and determinism ----------------------------------------------------------------
def test_actions_shape_dtype_and_metadata(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    out = actions(policy, obs)
    assert out.shape == policy.action_shape == (policy.cfg.horizon, policy.cfg.action_dim)
    assert out.dtype == np.float32 and np.isfinite(out).all()
    meta = policy.metadata()
    assert meta["policy_name"] == policy.cfg.name and (meta["action_horizon"], meta["action_dim"]) == out.shape
    assert meta["context_tokens"] == policy.cfg.context_tokens


def test_sequential_cfg_is_deterministic(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    first = actions(policy, obs, seed=11)
    assert np.array_equal(first, actions(policy, obs, seed=11))
    assert not np.allclose(first, actions(policy, obs, seed=12)), "a different seed must give different actions"


@pytest.mark.parametrize("seed", [0, 1, 2**63 - 1])
def test_sequential_and_batched_cfg_agree(policy: ReferencePolicy, obs: dict[str, Any], seed: int) -> None:
    sequential = actions(policy, obs, seed, mode="sequential")
    batched = actions(policy, obs, seed, mode="batched")
    np.testing.assert_allclose(batched, sequential, rtol=0, atol=CFG_MODES_ATOL)
    assert np.abs(sequential).max() > 100 * CFG_MODES_ATOL  # the bound is tight relative to the values


def test_sampler_refuses_bad_settings(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="steps must be >= 1"):
        actions(policy, obs, steps=0)
    with pytest.raises(ValueError, match="unknown cfg mode"):
        actions(policy, obs, mode="sideways")
    with pytest.raises(ValueError, match="parallel CFG needs a cfg group"):
        actions(policy, obs, mode="parallel")


# --- classifier-free guidance ------------------------------------------------------------------
def test_branches_have_the_same_cost(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    """The unconditional context has the conditional one's shape, so cfg ranks never wait on each other."""
    sample = policy.prepare(obs)
    cond, uncond = policy.condition(sample, Branch.COND), policy.condition(sample, Branch.UNCOND)
    assert cond.shape == uncond.shape == (1, policy.cfg.context_tokens, policy.cfg.width)


def test_guidance_one_is_plain_euler_on_the_conditional_branch(tiny_checkpoint: Path, obs: dict[str, Any]) -> None:
    policy = load(tiny_checkpoint)
    guided = actions(policy, obs, 5, guidance=3.0)
    plain = actions(policy, obs, 5, guidance=1.0)
    assert not np.allclose(guided, plain)

    # the same Euler loop written out: x_{t+dt} = x_t + dt * v_cond(x_t, t)
    with torch.inference_mode():
        ctx = policy.condition(policy.prepare(obs), Branch.COND)
        x = policy.init_noise(5)
        for i in range(STEPS):
            t = torch.full((1,), 1.0 - i / STEPS)
            x = x + (-1.0 / STEPS) * policy.denoise_step(ctx, x, t)
    assert np.array_equal(plain, policy.postprocess(x))

    # guidance 1.0 never looks at the unconditional branch: replacing its null tokens changes nothing
    with torch.no_grad():
        policy.model.null_context.normal_(generator=torch.Generator().manual_seed(99))
    assert np.array_equal(plain, actions(policy, obs, 5, guidance=1.0))
    assert np.array_equal(plain, actions(policy, obs, 5, guidance=1.0, mode="batched"))
    assert not np.allclose(guided, actions(policy, obs, 5, guidance=3.0)), "guidance 3 must use the null tokens"


# --- inputs --------------------------------------------------------------------------------------
def test_multi_camera_dict_input(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    rng = np.random.default_rng(3)
    front, wrist = (rng.integers(0, 256, size=(64, 48, 3), dtype=np.uint8) for _ in range(2))
    as_dict = dict(obs, **{"observation/image": {"a_front": front, "b_wrist": wrist}})
    as_keys = dict(obs, **{"observation/image": front, "observation/wrist_image": wrist})
    swapped = dict(obs, **{"observation/image": {"a_front": wrist, "b_wrist": front}})
    one_camera = dict(obs, **{"observation/image": front})

    sample = policy.prepare(as_dict)
    assert sample.tensors["present"].tolist() == [[True, True]] and sample.meta["cameras"] == 2
    reference = actions(policy, as_dict)
    assert np.array_equal(reference, actions(policy, as_keys)), "a camera dict and camera keys are one input"
    assert not np.allclose(reference, actions(policy, swapped)), "each camera slot has its own embedding"
    assert not np.allclose(reference, actions(policy, one_camera)), "the second camera is used"


def test_every_input_changes_the_actions(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    """Unit-variance init: image, state and prompt all reach the actions (a dropped input would not)."""
    base = actions(policy, obs)
    image = obs["observation/image"].copy()
    image[:56, :56] = 255 - image[:56, :56]
    variants = {
        "image": dict(obs, **{"observation/image": image}),
        "joints": dict(obs, **{"observation/joint_position": obs["observation/joint_position"] + 0.5}),
        "gripper": dict(obs, **{"observation/gripper_position": 1.0 - obs["observation/gripper_position"]}),
        "prompt": dict(obs, prompt="stack the red block"),
    }
    for name, variant in variants.items():
        assert not np.allclose(base, actions(policy, variant)), name
    assert np.array_equal(base, actions(policy, dict(obs, unknown_key="ignored", session_id="s")))


def test_prepared_tensors_shared_between_requests_are_never_written(
    policy: ReferencePolicy, obs: dict[str, Any]
) -> None:
    """``present`` and the prompt's tokens are cached and shared by every request with that camera count and
    prompt: a batch, the sampler or a second prompt must leave the first request's copies as they were."""
    first = policy.prepare(obs)
    kept = {k: first.tensors[k].clone() for k in ("present", "tokens", "state", camera_key(0))}
    batch = policy.collate([first, first])
    sample_actions(policy, batch, [0, 1], steps=2, guidance=3.0, mode="batched")
    policy.prepare(dict(obs, prompt="stack the red block"))
    again = policy.prepare(obs)
    assert again.tensors["tokens"] is first.tensors["tokens"], "one prompt is tokenized once"
    for key, value in kept.items():
        assert torch.equal(first.tensors[key], value) and torch.equal(again.tensors[key], value), key
    text = obs["prompt"].encode()[: policy.cfg.prompt_tokens]
    assert first.tensors["tokens"][0, : len(text)].tolist() == [b + 1 for b in text]


def test_native_and_resized_images_both_work(policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    s = policy.cfg.image_size
    native = dict(obs, **{"observation/image": np.full((s, s, 3), 200, np.uint8)})
    camera = policy.prepare(native).tensors[camera_key(0)]
    assert camera.dtype == torch.uint8 and camera.shape == (1, s, s, 3)  # bytes as sent until the device
    assert torch.equal(policy.pixels({camera_key(0): camera}, 1)[0, 0], torch.full((3, s, s), 200 / 127.5 - 1.0))
    assert actions(policy, native).shape == policy.action_shape

    # a larger frame is resized on the device: bilinear, rounded to bytes, as if the robot had sent it resized
    rng = np.random.default_rng(5)
    large = rng.integers(0, 256, size=(3 * s, 2 * s, 3), dtype=np.uint8)
    resized = (
        F.interpolate(
            torch.from_numpy(large).permute(2, 0, 1)[None].float(), size=(s, s), mode="bilinear", align_corners=False
        )
        .round()
        .clamp(0, 255)
        .to(torch.uint8)[0]
        .permute(1, 2, 0)
    )
    as_large, as_resized = (dict(obs, **{"observation/image": img}) for img in (large, resized.numpy()))
    assert policy.prepare(as_large).tensors[camera_key(0)].shape == (1, 3 * s, 2 * s, 3)
    assert np.array_equal(actions(policy, as_large), actions(policy, as_resized))


# --- checkpoints ------------------------------------------------------------------------------
def test_checkpoint_round_trip(
    tmp_path: Path, tiny_checkpoint: Path, policy: ReferencePolicy, obs: dict[str, Any]
) -> None:
    again = init_checkpoint(tmp_path / "again", "tiny", seed=0)
    assert sorted(p.name for p in again.iterdir()) == sorted([CONFIG_FILE, WEIGHTS_FILE, MANIFEST_FILE])
    assert len(verify_checkpoint(again, hashes=True)) == 2
    assert sha256_file(again / WEIGHTS_FILE) == sha256_file(tiny_checkpoint / WEIGHTS_FILE), "init is seeded"
    expected = actions(policy, obs, 21)
    assert np.array_equal(expected, actions(load(again), obs, 21))

    saved = init_checkpoint(tmp_path / "seed1", "tiny", seed=1)
    assert not np.allclose(expected, actions(load(saved), obs, 21)), "another init seed is another model"


def test_action_normalisation_from_the_config(tmp_path: Path, policy: ReferencePolicy, obs: dict[str, Any]) -> None:
    mean, std = [float(i) for i in range(8)], [2.0] * 8
    scaled = load(init_checkpoint(tmp_path / "norm", "tiny", seed=0, action_mean=mean, action_std=std))
    raw = actions(policy, obs, 4)
    np.testing.assert_allclose(
        actions(scaled, obs, 4), raw * np.float32(2) + np.asarray(mean, np.float32), rtol=0, atol=1e-6
    )


def test_load_policy_class_resolves_the_default_and_refuses_others() -> None:
    from policy_operator.serve_flags import DEFAULT_POLICY

    assert load_policy_class(DEFAULT_POLICY) is ReferencePolicy
    for path, words in [
        ("no-colon", "pkg.module:Class"),
        ("nosuch.module:X", "cannot import"),
        ("policy_operator.runtime.policy.reference:Nope", "cannot import"),
        ("policy_operator.runtime.policy.reference:PolicyConfig", "not a subclass"),
    ]:
        with pytest.raises(ValueError, match=words):
            load_policy_class(path)


@pytest.fixture
def broken(tmp_path: Path, tiny_checkpoint: Path) -> Path:
    path = tmp_path / "broken"
    shutil.copytree(tiny_checkpoint, path)
    return path


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / CONFIG_FILE).read_text())
    cfg.update(changes)
    (path / CONFIG_FILE).write_text(json.dumps(cfg))


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"width": 32, "heads": 4}, "does not match"),
        ({"depth": 3}, "does not match"),
        ({"horizon": 8}, "does not match"),
        ({"max_cameras": 1}, "does not match"),
        ({"flavour": "vanilla"}, "unknown fields"),
        ({"width": 65}, "not divisible by heads"),
        ({"heads": 0}, "config.json"),
        ({"patch_size": 0}, "config.json"),
        ({"action_mean": [0.0, 1.0]}, "action_mean has 2 entries"),
    ],
    ids=[
        "width",
        "depth",
        "horizon",
        "cameras",
        "unknown-field",
        "heads-divisor",
        "zero-heads",
        "zero-patch",
        "action-mean",
    ],
)
def test_config_and_weights_mismatch_is_a_checkpoint_error(broken: Path, changes: dict[str, Any], words: str) -> None:
    _edit_config(broken, **changes)
    with pytest.raises(CheckpointError, match=words):
        load(broken)


@pytest.mark.parametrize(
    ("damage", "words"),
    [
        (lambda p: (p / CONFIG_FILE).unlink(), "config.json is missing"),
        (lambda p: (p / WEIGHTS_FILE).unlink(), "model.safetensors is missing"),
        (lambda p: (p / CONFIG_FILE).write_text("{not json"), "config.json"),
        (lambda p: (p / CONFIG_FILE).write_text("[1, 2]"), "unknown fields"),
        (
            lambda p: (p / WEIGHTS_FILE).write_bytes((p / WEIGHTS_FILE).read_bytes()[:5000]),
            "not a readable safetensors",
        ),
        (lambda p: (p / WEIGHTS_FILE).write_bytes(b""), "not a readable safetensors"),
    ],
    ids=["no-config", "no-weights", "config-not-json", "config-not-a-map", "weights-truncated", "weights-empty"],
)
def test_broken_checkpoint_is_a_checkpoint_error(broken: Path, damage: Any, words: str) -> None:
    damage(broken)
    with pytest.raises(CheckpointError, match=words):
        load(broken)


def test_sizes_are_valid_configs(tmp_path_factory: pytest.TempPathFactory) -> None:
    from policy_operator.runtime.policy.reference import SIZES

    assert {"tiny", "small", "base"} <= set(SIZES)
    small = load(session_checkpoint(tmp_path_factory, "small"))
    assert small.action_shape == (SIZES["small"].horizon, SIZES["small"].action_dim)
    out = actions(small, example_observation(small.cfg, 1), steps=1)
    assert out.shape == small.action_shape and np.isfinite(out).all()
    with pytest.raises(ValueError, match="unknown size"):
        init_checkpoint(tmp_path_factory.mktemp("nope"), "huge")
    with pytest.raises(ValueError, match="not divisible"):
        PolicyConfig(width=30, heads=4)


# --- the GPU speed-up paths, on the CPU where they can run ----------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_compiled_denoiser_matches_eager(tiny_checkpoint: Path, obs: dict[str, Any], mode: str) -> None:
    """--compile reduce-overhead (CUDA graphs on a GPU) wraps the compiled step so sequential CFG
    keeps the conditional velocity while computing the unconditional one; on the CPU the same
    wrapper and compiled graph run, without the graphs."""
    eager = load(tiny_checkpoint)
    compiled = load(tiny_checkpoint)
    compiled.compile("reduce-overhead")
    want = actions(eager, obs, 5, mode=mode)
    got = actions(compiled, obs, 5, mode=mode)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)  # inductor fuses differently: not bitwise
    assert not np.array_equal(actions(compiled, obs, 6, mode=mode), got)  # a different seed still differs


@pytest.mark.slow
def test_compiled_step_traces_no_graph_per_extra_bucket(
    tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pod started from the compile cache still pays dynamo's trace, AOT-autograd and the kernel load once per
    graph: the larger buckets must reuse one graph over a symbolic batch, not add one each (with and without a
    guided RTC row, whose backward is compiled too), and compute what the eager step does."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path))  # this test's kernels, not the machine's cache
    torch._dynamo.reset()
    counters.clear()
    policy = load(tiny_checkpoint)
    policy.compile("default")
    eager = load(tiny_checkpoint)
    constraint = warmup_constraint(policy, "guided")  # a guided RTC row: the step's backward is compiled too
    graphs: dict[int, int] = {}
    for size in (1, 2, 4, 8, 16):  # warm-up's order: smallest bucket first
        sample = policy.collate([policy.prepare(policy.example_observation(i)) for i in range(size)])
        for mode, rtc in itertools.product(("sequential", "batched"), (None, [constraint] * size)):
            kw: dict[str, Any] = {"steps": 2, "guidance": 3.0, "mode": mode, "rtc_mode": "guided", "rtc": rtc}
            x = sample_actions(policy, sample, list(range(size)), **kw)
            torch.testing.assert_close(x, sample_actions(eager, sample, list(range(size)), **kw), rtol=1e-4, atol=1e-4)
        graphs[size] = counters["stats"]["unique_graphs"]
    torch._dynamo.reset()
    assert graphs[4] > 0, graphs
    assert graphs[16] == graphs[4], f"buckets 8 and 16 compiled graphs of their own: {graphs}"
