"""``--policy lerobot`` in its fast serving forms against LeRobot's own float32 answer, on tiny configs.

The batched, device-staged path: each request's cameras travel uint8 as the
robot sent them and are converted and normalized for the whole batch where
the model runs (staging.py), the tokenizer's answers cached per text; a batch
of robots, padded to a bucket, answers each robot what LeRobot's own
per-request pipeline answers (within ``ATOL``, as tests/test_lerobot_policies.py).

``--dtype bfloat16`` for every family: the actions differ from LeRobot's
float32 ones by rounding only, bounded relative to the action scale (the
largest |action| of LeRobot's answer).  The bounds are measured on these
configs (largest relative difference over the seeds below, recorded beside
each), with headroom; a dtype bug (a float32 activation into a bfloat16
layer, a projection cast that LeRobot keeps in float32) fails at warm-up or
lands far outside.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.utils._pytree as pytree

pytest.importorskip("lerobot")

from policy_operator.runtime.policy.interface import Branch, Sample, collate, context_map  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.policy.sampler import sample_actions  # noqa: E402
from policy_operator.runtime.result import Result  # noqa: E402
from tests.support.lerobot_equality import lerobots_own  # noqa: E402
from tests.support.lerobot_tiny import reduced_paligemma, write_small_pi  # noqa: E402

CPU = torch.device("cpu")
ATOL = 1e-5
SEEDS = (0, 1, 2)
# max |bf16 - LeRobot fp32| / max |LeRobot fp32| over SEEDS, measured on this CPU: smolvla 0.0016, pi0 0.0022
# (0.0025 with LeRobot's float32 SigLIP tower), pi05 0.0014 (the same), diffusion 0.0096 (its DDIM steps through
# a ResNet-18 encoder under autocast; 0.08 at the published size on an H100, bench/results/lerobot-h100-round2.md)
BF16_BOUND = {"smolvla": 0.01, "pi0": 0.01, "pi05": 0.01, "diffusion": 0.04}
BATCH_VS_ALONE = 5e-4  # of the action scale: a bfloat16 row batched against the same robot served alone


@pytest.fixture(scope="module", params=["smolvla", "pi0", "pi05", "diffusion"])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    family = request.param
    directory = tmp_path_factory.mktemp(family)
    if family in ("pi0", "pi05"):
        root = write_small_pi(family, directory, seed=3)
        with reduced_paligemma():
            yield family, root
    else:
        yield family, write_tiny_checkpoint(family, directory, seed=1)


def first_requests(policy: LeRobotPolicy, observations: list[dict[str, Any]]) -> list[Sample]:
    """Each observation prepared as its session's first request."""
    return [policy.stack_history([policy.prepare(obs)] * policy.history) for obs in observations]


def answer(policy: LeRobotPolicy, obs: dict[str, Any], seed: int) -> np.ndarray:
    (sample,) = first_requests(policy, [obs])
    return policy.postprocess(sample_actions(policy, sample, [seed], guidance=1.0))


def batch_answers(policy: LeRobotPolicy, samples: list[Sample], seeds: list[int]) -> list[np.ndarray]:
    """Each robot's actions from one batch of them, padded to a bucket one larger (the copy's row dropped)."""
    padded = collate([*samples, samples[-1]])
    actions = sample_actions(policy, padded, [*seeds, seeds[-1]], guidance=1.0)
    return policy.postprocess_batch(actions, padded)[: len(samples)]


def test_bfloat16_stays_within_its_bound_of_lerobots_float32_actions(checkpoint: tuple[str, Path]) -> None:
    family, root = checkpoint
    fp32 = LeRobotPolicy.load(str(root), device=CPU)
    bf16 = LeRobotPolicy.load(str(root), device=CPU, dtype=torch.bfloat16)
    assert bf16.dtype == torch.bfloat16
    assert any(p.dtype == torch.bfloat16 for p in bf16.loaded.policy.parameters()) or family == "diffusion"
    worst = 0.0
    for seed in SEEDS:
        obs = fp32.example_observation(seed)
        reference = answer(fp32, obs, seed)
        ours = answer(bf16, obs, seed)
        assert ours.dtype == np.float32 and ours.shape == reference.shape and np.isfinite(ours).all()
        worst = max(worst, float(np.abs(ours - reference).max() / np.abs(reference).max()))
    print(f"{family}: bf16 vs fp32 max relative difference {worst:.2g}")
    assert 0 < worst <= BF16_BOUND[family], f"{family}: {worst:.3g} of the action scale"


def test_a_bfloat16_batch_stays_within_the_bound_for_each_robot(checkpoint: tuple[str, Path]) -> None:
    """Served as a batch (a bucket of 4, each robot with a task of its own length, so the rows' prompt masks
    differ), bfloat16 answers each robot within the same bound of LeRobot's float32: the grouped attention a
    bfloat16 pi0/pi0.5 runs (attention.py) applies each row's own mask."""
    family, root = checkpoint
    fp32 = LeRobotPolicy.load(str(root), device=CPU)
    bf16 = LeRobotPolicy.load(str(root), device=CPU, dtype=torch.bfloat16)
    tasks = ("pick", "pick up the cube", "pick up the red cube and put it in the bowl on the left")
    observations = [fp32.spec.example(k, task=task) for k, task in enumerate(tasks)]
    seeds = [31, 32, 33]
    rows = batch_answers(bf16, first_requests(bf16, observations), seeds)
    for obs, seed, row in zip(observations, seeds, rows, strict=True):
        reference = lerobots_own(fp32, [obs], seed)
        scale = np.abs(reference).max()
        assert np.abs(row - reference).max() / scale <= BF16_BOUND[family]
        # and as that robot alone in bfloat16: equal on this CPU; every row given row 0's prompt mask was 1.3e-3
        # and 7.1e-3 of the scale off for pi0.5 (1.0e-3 and 6.7e-3 from LeRobot: inside the bound above)
        assert np.abs(row - answer(bf16, obs, seed)).max() / scale <= BATCH_VS_ALONE


def test_a_device_staged_batch_answers_each_robot_as_lerobot(checkpoint: tuple[str, Path]) -> None:
    family, root = checkpoint
    policy = LeRobotPolicy.load(str(root), device=CPU)
    assert policy._staging is not None  # noqa: SLF001 - every family's saved preprocessor is reproduced
    observations = [policy.example_observation(k) for k in range(3)]
    seeds = [21, 22, 23]
    samples = first_requests(policy, observations)
    cameras = [f.key for f in policy.spec.features if f.kind == "VISUAL"]
    for key in cameras:  # the frames travel as the robot sent them: uint8, a quarter of float32's bytes
        assert all(s.tensors[key].dtype == torch.uint8 for s in samples)
    for obs, seed, row in zip(observations, seeds, batch_answers(policy, samples, seeds), strict=True):
        np.testing.assert_allclose(row, lerobots_own(policy, [obs], seed), rtol=0, atol=ATOL)
    if policy.spec.needs_task:  # the same task string tokenized once, for every robot
        assert policy._tokens and all(t._cached.cache_info().hits >= 2 for t in policy._tokens)  # noqa: SLF001


def test_the_prefix_traces_as_one_graph_with_no_host_sync(checkpoint: tuple[str, Path]) -> None:
    """What ``--compile`` captures per bucket: the staged cameras through the vision tower and the VLM prefix in
    one graph, nothing in it that waits for the device (a data-dependent shape would break it)."""
    family, root = checkpoint
    policy = LeRobotPolicy.load(str(root), device=CPU)
    sample = policy.stack_history([policy.prepare(policy.example_observation(0))] * policy.history)
    batch = policy._staging.finish(dict(sample.tensors)) if policy._staging is not None else dict(sample.tensors)  # noqa: SLF001
    with torch.inference_mode():
        explained = torch._dynamo.explain(policy.family.condition)(batch)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


def test_a_step_traces_as_one_graph_and_leaves_its_context_as_it_was(checkpoint: tuple[str, Path]) -> None:
    """What ``--compile`` captures per bucket for the step loop: one graph; and a step reads the prefix cache
    without writing it (pi0/pi0.5 skip LeRobot's clone of the cache), so the next step sees the same context,
    and answers exactly what LeRobot's own ``denoise_step`` answers."""
    family, root = checkpoint
    policy = LeRobotPolicy.load(str(root), device=CPU)
    sample = policy.stack_history([policy.prepare(policy.example_observation(0))] * policy.history)
    with torch.inference_mode():
        context = policy.condition(sample, Branch.COND)
        before = context_map(torch.clone, context)
        x = policy.init_noise(0)
        t = policy.integrator().time(0, 1, x.device)
        step = policy.family.denoise(context, x, t)
        for was, now in zip(pytree.tree_leaves(before), pytree.tree_leaves(context), strict=True):
            assert torch.equal(was, now)
        if family in ("pi0", "pi05"):
            from policy_operator.runtime.policy.lerobot.families import kv_cache

            kwargs = {"state": context["state"]} if family == "pi0" else {}
            lerobot = policy.loaded.policy.model.denoise_step(
                prefix_pad_masks=context["pad"], past_key_values=kv_cache(context["kv"]), x_t=x, timestep=t, **kwargs
            )
            assert torch.equal(step, lerobot)
            pi: Any = policy.family
            pi.lerobot_step = True  # the benchmark's baseline variant runs LeRobot's own step
            assert torch.equal(pi.denoise(context, x, t), lerobot)
            pi.lerobot_step = False
        explained = torch._dynamo.explain(policy.family.denoise)(context, x, t)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), [b.reason for b in explained.break_reasons]


def test_smolvlm_positions_without_the_mask_assignment_are_transformers_own() -> None:
    """smolvlm_positions.py: the same embeddings as transformers' forward, for full and partial patch masks."""
    from transformers.models.smolvlm.configuration_smolvlm import SmolVLMVisionConfig
    from transformers.models.smolvlm.modeling_smolvlm import SmolVLMVisionEmbeddings

    from policy_operator.runtime.policy.lerobot.smolvlm_positions import mask_free_positions

    torch.manual_seed(0)
    config: Any = SmolVLMVisionConfig()  # its fields are keyword arguments of PreTrainedConfig's own
    config.hidden_size, config.image_size, config.patch_size, config.num_channels = 32, 64, 16, 3
    ours, theirs = SmolVLMVisionEmbeddings(config), SmolVLMVisionEmbeddings(config)
    theirs.load_state_dict(ours.state_dict())
    mask_free_positions(ours)
    pixels = torch.rand(3, 3, 64, 64)
    full = torch.ones(3, 4, 4, dtype=torch.bool)
    partial = full.clone()
    partial[1, 3:, :] = False  # a shorter image in the batch
    partial[2, :, 2:] = False  # a narrower one
    for mask in (full, partial):
        assert torch.equal(ours(pixels, mask), theirs(pixel_values=pixels, patch_attention_mask=mask))


def test_a_batch_reports_its_stages_to_the_replicas_outcome_and_metrics(checkpoint: tuple[str, Path]) -> None:
    """/metrics' policy_stage_seconds: each request's Outcome carries its batch's prefix, denoise and postprocess
    time from the policy, and the server's histogram takes them (with decode, prepare and reply)."""
    from policy_operator.layout import ParallelLayout
    from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest, Replica
    from policy_operator.runtime.parallel.groups import Groups
    from policy_operator.runtime.parallel.heartbeat import Heartbeat, MemoryKV
    from policy_operator.runtime.policy.sampler import SamplerSettings
    from policy_operator.runtime.serving.metrics import ServerMetrics

    family, root = checkpoint
    policy = LeRobotPolicy.load(str(root), device=CPU)
    assert policy.stage_seconds() == {}  # no batch ran yet
    replica = Replica(
        policy,
        Groups(ParallelLayout(1, 1), 0),
        SamplerSettings(steps=None, guidance=None, cfg_mode="sequential", buckets=(2,)),
        Heartbeat(MemoryKV, 0, 1.0),  # never started: nothing is published
    )
    requests = tuple(
        InferenceRequest(f"robot-{k}", policy.stack_history([policy.prepare(policy.example_observation(k))] * n), k)
        for k, n in enumerate([policy.history] * 2)
    )
    outcomes = replica.answer(Batch(requests))
    stages = dict(outcomes[0].stages)
    assert list(stages) == ["prefix", "denoise", "postprocess"] and all(v > 0 for v in stages.values())
    assert outcomes[1].stages == outcomes[0].stages  # the batch's, for each of its requests
    assert sum(stages.values()) <= outcomes[0].infer_ms / 1e3
    metrics = ServerMetrics(ParallelLayout(1, 1))
    metrics.observe_answer(Result(decode_ms=0.1, stages=tuple(stages.items())), (0.01, 0.001), 0.0)
    text = metrics.render().decode()
    for stage in ("decode", "prefix", "denoise", "postprocess"):
        assert f'policy_stage_seconds_count{{stage="{stage}"}} 1.0' in text
