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

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

from policy_operator.builtin_policies import LEROBOT_FAMILIES, launch_has_unconditional  # noqa: E402
from policy_operator.cli import main as policyserver  # noqa: E402
from policy_operator.exit_codes import CheckpointExit  # noqa: E402
from policy_operator.layout import LayoutError  # noqa: E402
from policy_operator.runtime.policy.interface import Branch, collate  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.families import family_class  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import SamplerSettings, sample_actions  # noqa: E402
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
