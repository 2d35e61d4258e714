"""``--policy lerobot`` against LeRobot itself: the real lerobot package, tiny random-weight checkpoints built offline.

For each family the reference answer is LeRobot's own: its saved
preprocessor, ``predict_action_chunk(batch, noise=...)`` with the noise a
request of that seed starts from, and its saved postprocessor.  The server's
split (prefix KV cache once, then the action expert per step; Diffusion
Policy's conditioning once, then its scheduler) must give the same actions
within ``ATOL`` (measured: bitwise equal on this CPU).
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("lerobot")

from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

from policy_operator.layout import LayoutError, ParallelLayout  # noqa: E402
from policy_operator.runtime.engine.history import SessionHistory  # noqa: E402
from policy_operator.runtime.errors import InvalidObservation  # noqa: E402
from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest, Replica  # noqa: E402
from policy_operator.runtime.parallel.groups import Groups  # noqa: E402
from policy_operator.runtime.parallel.heartbeat import Heartbeat, MemoryKV  # noqa: E402
from policy_operator.runtime.policy.interface import collate, load_policy_class  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.relative_actions import STATE_KEY  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import SamplerSettings, sample_actions  # noqa: E402
from tests.support.lerobot_equality import lerobots_own  # noqa: E402
from tests.support.lerobot_tiny import configure_small_pi, reduced_paligemma, write_small_pi  # noqa: E402
from tests.support.servers import VENV_BIN, serve_policy, subprocess_env  # noqa: E402

ATOL = 1e-5
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def smolvla_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """What ``policyserver checkpoint init --lerobot smolvla --seed 1`` writes (the deploy tests and demos run it),
    written in this process: the CLI's two subprocesses would import torch and lerobot again.
    ``test_checkpoint_init_lerobot_writes_these_bytes_and_they_verify`` holds the CLI to the same bytes."""
    return write_tiny_checkpoint("smolvla", tmp_path_factory.mktemp("smolvla") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def diffusion_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("diffusion", tmp_path_factory.mktemp("diffusion"), seed=2)


@pytest.fixture(scope="module")
def smolvla(smolvla_dir: Path) -> LeRobotPolicy:
    return LeRobotPolicy.load(str(smolvla_dir), device=CPU)


@pytest.fixture(scope="module")
def diffusion(diffusion_dir: Path) -> LeRobotPolicy:
    return LeRobotPolicy.load(str(diffusion_dir), device=CPU)


@pytest.fixture(scope="module", params=["pi0", "pi05"])
def small_pi(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeRobotPolicy]:
    """pi0 / pi0.5 on a reduced PaliGemma (tests/support/lerobot_tiny.py): LeRobot 0.6 has no small variant."""
    root = write_small_pi(request.param, tmp_path_factory.mktemp(request.param), seed=3)
    with reduced_paligemma():
        yield LeRobotPolicy.load(str(root), device=CPU)


@pytest.fixture(scope="module")
def relative_pi0(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LeRobotPolicy]:
    """pi0 trained on actions relative to the state (``use_relative_actions``): its postprocessor adds it back."""

    def configure(config: Any) -> None:
        configure_small_pi(config)
        config.use_relative_actions = True

    with reduced_paligemma():
        root = write_tiny_checkpoint(
            "pi0", tmp_path_factory.mktemp("relative"), size="base", seed=3, configure=configure
        )
        yield LeRobotPolicy.load(str(root), device=CPU)


def served(policy: LeRobotPolicy, observations: list[dict[str, Any]], seed: int) -> np.ndarray:
    """The server's answer to the last of a session's observations."""
    history = SessionHistory(policy)
    for obs in observations:
        sample = history.extend("robot", policy.prepare(obs))
    return policy.postprocess(sample_actions(policy, sample, [seed], guidance=1.0))


# --- the same actions as LeRobot ---------------------------------------------------------------
@pytest.mark.parametrize("seed", [7])
def test_smolvla_answers_as_lerobot(smolvla: LeRobotPolicy, seed: int) -> None:
    obs = smolvla.example_observation(seed)
    ours = served(smolvla, [obs], seed)
    assert ours.shape == smolvla.action_shape == (8, 6) and ours.dtype == np.float32
    np.testing.assert_allclose(ours, lerobots_own(smolvla, [obs], seed), rtol=0, atol=ATOL)
    # a float CHW frame in [0, 1] is the same observation as its uint8 HWC bytes
    floats = {
        k: (v.transpose(2, 0, 1).astype(np.float32) / 255 if isinstance(v, np.ndarray) and v.ndim == 3 else v)
        for k, v in obs.items()
    }
    np.testing.assert_allclose(served(smolvla, [floats], seed), ours, rtol=0, atol=ATOL)
    assert not np.allclose(served(smolvla, [obs], seed + 1), ours)  # the seed is the noise


def test_pi0_and_pi05_answer_as_lerobot(small_pi: LeRobotPolicy) -> None:
    """The prefix KV cache (with pi0's state in the suffix; pi0.5's discretized into the prompt) and the expert."""
    observations = [small_pi.example_observation(k) for k in range(2)]
    for k, obs in enumerate(observations):
        ours = served(small_pi, [obs], seed=k)
        assert ours.shape == small_pi.action_shape == (8, 6)
        np.testing.assert_allclose(ours, lerobots_own(small_pi, [obs], seed=k), rtol=0, atol=ATOL)
    samples = [small_pi.prepare(obs) for obs in observations]
    together = small_pi.postprocess_batch(sample_actions(small_pi, collate(samples), [0, 1], guidance=1.0))
    for k, row in enumerate(together):
        np.testing.assert_allclose(row, served(small_pi, [observations[k]], seed=k), rtol=0, atol=ATOL)


def test_diffusion_answers_as_lerobot_from_the_sessions_history(diffusion: LeRobotPolicy) -> None:
    assert diffusion.history == 2 and diffusion.integrator().steps == 4  # n_obs_steps, DDIM's num_inference_steps
    frames = [diffusion.example_observation(k) for k in range(3)]
    for n in (1, 2, 3):  # the first request repeats its frame, later ones see the frame before
        ours = served(diffusion, frames[:n], seed=n)
        assert ours.shape == (4, 2)
        np.testing.assert_allclose(ours, lerobots_own(diffusion, frames[:n], seed=n), rtol=0, atol=ATOL)
    assert not np.allclose(served(diffusion, frames[1:3], seed=3), served(diffusion, frames[2:3], seed=3))


@pytest.mark.parametrize("name", ["smolvla", "diffusion"])
def test_batched_rows_equal_rows_alone(request: pytest.FixtureRequest, name: str) -> None:
    policy: LeRobotPolicy = request.getfixturevalue(name)
    history = SessionHistory(policy)
    samples = [history.extend(f"robot-{k}", policy.prepare(policy.example_observation(k))) for k in range(3)]
    seeds = [11, 12, 13]
    together = policy.postprocess_batch(sample_actions(policy, collate(samples), seeds, guidance=1.0))
    for sample, seed, row in zip(samples, seeds, together, strict=True):
        alone = policy.postprocess(sample_actions(policy, sample, [seed], guidance=1.0))
        np.testing.assert_allclose(row, alone, rtol=0, atol=ATOL)
    padded = sample_actions(policy, collate([*samples, samples[-1]]), [*seeds, seeds[-1]], guidance=1.0)[:3]
    for row, got in zip(together, policy.postprocess_batch(padded), strict=True):  # bucket padding: copies, dropped
        np.testing.assert_allclose(got, row, rtol=0, atol=ATOL)


def test_relative_actions_get_each_requests_own_state_in_a_batch(relative_pi0: LeRobotPolicy) -> None:
    """LeRobot adds back the last state its preprocessor saw; a replica's batch adds each row its own request's."""
    policy = relative_pi0
    observations = [policy.example_observation(k) for k in range(2)]
    observations[1]["observation.state"] = observations[1]["observation.state"] + 10.0  # far apart: a mix-up shows
    seeds = [4, 5]
    alone = []
    for obs, seed in zip(observations, seeds, strict=True):
        sample = policy.prepare(obs)
        ours = policy.postprocess_batch(sample_actions(policy, sample, [seed], guidance=1.0), sample)[0]
        np.testing.assert_allclose(ours, lerobots_own(policy, [obs], seed), rtol=0, atol=ATOL)
        alone.append(ours)
    assert np.abs(alone[1] - alone[0]).min() > 1.0, "each request's state shows in its actions"
    # both prepared before their batch runs, as the ingress does; the batch padded to a bucket of 4 rows
    requests = tuple(
        InferenceRequest(f"robot-{k}", policy.prepare(obs), seed)
        for k, (obs, seed) in enumerate(zip(observations, seeds, strict=True))
    )
    relative_step = policy._relative.relative  # type: ignore[union-attr]  # noqa: SLF001
    relative_step._last_state = torch.full_like(requests[0].sample.tensors[STATE_KEY], 1e3)  # noqa: SLF001
    replica = Replica(
        policy,
        Groups(ParallelLayout(1, 1), 0),
        SamplerSettings(steps=None, guidance=None, cfg_mode="sequential", buckets=(4,)),
        Heartbeat(MemoryKV, 0, 1.0),  # never started: nothing is published
    )
    for order in (requests, requests[::-1]):
        together, _ = replica.execute(Batch(order))
        for request, row in zip(order, together, strict=True):
            np.testing.assert_allclose(row, alone[int(request.request_id[-1])], rtol=0, atol=ATOL)
    with pytest.raises(ValueError, match="relative to each request's state"):
        policy.postprocess(sample_actions(policy, requests[0].sample, [4], guidance=1.0))


# --- refusals ---------------------------------------------------------------------------------------
def test_lerobot_policies_refuse_guidance(smolvla: LeRobotPolicy) -> None:
    assert load_policy_class("lerobot") is LeRobotPolicy and not LeRobotPolicy.has_unconditional
    assert SamplerSettings(None, None, "sequential").for_policy(smolvla).guidance == 1.0
    with pytest.raises(LayoutError, match="no unconditional branch"):
        SamplerSettings(None, 3.0, "sequential").for_policy(smolvla)
    with pytest.raises(LayoutError, match="cfgp=2"):
        SamplerSettings(None, None, "sequential").for_policy(smolvla, cfgp=2)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"observation.images.wrist": None}, "missing ['observation.images.wrist']"),
        ({"observation.images.front": np.zeros((48, 64, 3), np.uint8)}, "unexpected ['observation.images.front']"),
        ({"task": None}, "missing ['task']"),
        ({"observation.state": np.zeros(7, np.float32)}, "must have shape [6], got [7]"),
        ({"observation.state": np.array([0, 0, 0, 0, 0, np.nan], np.float32)}, "NaN or inf"),
        (
            {"observation.state": np.array([0, 0, 0, 0, 0, -1e30], np.float32)},
            "magnitude 1e+30; this policy takes at most 1e+06",
        ),
        ({"observation.images.top": np.zeros((64, 48, 3), np.uint8)}, "must have shape [48, 64, 3] (HWC)"),
        ({"observation.images.top": np.full((3, 48, 64), 2.0, np.float32)}, "values in [0, 1]"),
        ({"observation.images.top": np.zeros((48, 64, 3), np.int16)}, "uint8 HWC or float CHW"),
        ({"task": 5}, "'task' must be a string"),
    ],
    ids=[
        "missing-camera",
        "unknown-camera",
        "missing-task",
        "state-shape",
        "state-nan",
        "state-absurd",
        "image-shape",
        "image-range",
        "image-dtype",
        "task-type",
    ],
)
def test_a_bad_observation_names_what_is_expected(smolvla: LeRobotPolicy, change: dict[str, Any], words: str) -> None:
    obs = {**smolvla.example_observation(0), **change}
    obs = {k: v for k, v in obs.items() if v is not None}
    with pytest.raises(InvalidObservation) as info:
        smolvla.prepare(obs)
    assert words in str(info.value)
    if "missing" in words or "unexpected" in words:
        assert (
            "this policy takes exactly ['observation.images.top', 'observation.images.wrist', "
            "'observation.state', 'task']" in str(info.value)
        )


# --- the CLI and a real server --------------------------------------------------------------------
@pytest.mark.slow  # two subprocesses that each import torch and lerobot
def test_checkpoint_init_lerobot_writes_these_bytes_and_they_verify(smolvla_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ckpt"
    for argv in (["init", "--lerobot", "smolvla", "--seed", "1", str(root)], ["verify", "--hashes", str(root)]):
        done = subprocess.run(
            [str(VENV_BIN / "policyserver"), "checkpoint", *argv],
            capture_output=True,
            text=True,
            timeout=300,
            env=subprocess_env(),
            cwd=tmp_path,
        )
        assert done.returncode == 0, done.stderr
    written = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert written == sorted(p.relative_to(smolvla_dir) for p in smolvla_dir.rglob("*") if p.is_file())
    for rel in written:
        assert (root / rel).read_bytes() == (smolvla_dir / rel).read_bytes(), rel


@pytest.mark.slow
def test_serve_answers_an_openpi_client_in_lerobot_keys(smolvla_dir: Path, smolvla: LeRobotPolicy) -> None:
    with serve_policy(smolvla_dir, "--policy", "lerobot", "--error-format", "dict", "--threads", "1") as server:
        client = WebsocketClientPolicy(server.url)  # the robots' own client: its session ends with this server
        meta = client.get_server_metadata()
        assert meta["lerobot_type"] == "smolvla" and meta["chunk_shape"] == [8, 6]
        assert (meta["steps"], meta["guidance"]) == (4, 1.0)  # the config's num_steps; no guidance
        assert set(meta["observation_keys"]) == {
            "observation.images.top",
            "observation.images.wrist",
            "observation.state",
            "task",
        }
        obs = {**smolvla.example_observation(3), "seed": 21}
        actions = client.infer(obs)["actions"]
        np.testing.assert_allclose(actions, lerobots_own(smolvla, [obs], 21), rtol=0, atol=ATOL)
        bad = {k: v for k, v in obs.items() if k != "observation.images.wrist"}
        error = client.infer(bad)
        assert error["error"]["kind"] == "invalid_observation", error
        assert "observation.images.wrist" in error["error"]["message"]
        np.testing.assert_array_equal(client.infer(obs)["actions"], actions)  # only that request failed


@pytest.mark.slow  # a subprocess that imports torch and lerobot (docs/testing.md, tiers)
def test_lerobot_is_imported_before_the_load_is_timed_and_offline() -> None:
    """serve's start line tells LeRobot's imports (11-15 s on the H100 host, from sources) from the weights (2.1-2.5
    s for pi0.5): the worker calls ``import_dependencies`` first, which turns the hub off before any of them."""
    probe = (
        "import sys\n"
        "from policy_operator.runtime.policy.interface import load_policy_class\n"
        "cls = load_policy_class('lerobot')\n"
        "assert 'lerobot.policies.factory' not in sys.modules, 'imported with the policy class: nothing to time'\n"
        "cls.import_dependencies()\n"
        "import huggingface_hub.constants\n"
        "print('lerobot.policies.factory' in sys.modules, huggingface_hub.constants.HF_HUB_OFFLINE)\n"
    )
    env = {k: v for k, v in subprocess_env().items() if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run([str(VENV_BIN / "python"), "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "True"]
