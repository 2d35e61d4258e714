"""What the ``Policy`` contract offers real models: tree contexts, own integrators, guidance intervals, no
unconditional branch, session history -- each checked against the plain reference policy on the same weights.

Whatever runs the same kernels on the same inputs is compared bitwise; batched
CFG and batched rows run other GEMM shapes (``ATOL``, as in test_batching).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from policy_operator.builtin_policies import BUILTIN_POLICIES, LEROBOT, REFERENCE
from policy_operator.layout import LayoutError
from policy_operator.runtime.engine.history import SessionHistory
from policy_operator.runtime.policy.interface import (
    Branch,
    EulerFlow,
    GuidanceInterval,
    Policy,
    Sample,
    collate,
    context_cat,
    context_rows,
    load_policy_class,
)
from policy_operator.runtime.policy.reference import ReferencePolicy
from policy_operator.runtime.policy.sampler import SamplerSettings, sample_actions
from tests.support.net import free_port
from tests.support.plugins.contract_policies import (
    EarlyGuidance,
    HistoryPolicy,
    LateGuidance,
    OwnScheduleFlow,
    ShiftedEuler,
    TreeContextPolicy,
    UnguidedPolicy,
)
from tests.support.servers import PLUGIN_DIR, VENV_BIN, subprocess_env

ATOL = 1e-5
STEPS = 4
CPU = torch.device("cpu")


def load(cls: type[Policy], checkpoint: Path) -> Any:
    return cls.load(str(checkpoint), device=CPU, dtype=torch.float32)


@pytest.fixture(scope="module")
def reference(tiny_checkpoint: Path) -> ReferencePolicy:
    return load(ReferencePolicy, tiny_checkpoint)


def x_of(
    policy: Policy,
    seed: int = 3,
    *,
    obs_seed: int = 0,
    guidance: float = 3.0,
    mode: str = "sequential",
    steps: int | None = STEPS,
) -> torch.Tensor:
    sample = policy.prepare(policy.example_observation(obs_seed))
    return sample_actions(policy, sample, [seed], steps=steps, guidance=guidance, mode=mode)  # type: ignore[arg-type]


def manual(policy: Policy, plan: list[bool], *, guidance: float = 3.0, seed: int = 3) -> torch.Tensor:
    """The sampler written out for one request: Euler from t=1, guided on the steps ``plan`` marks."""
    with torch.inference_mode():
        sample = policy.prepare(policy.example_observation(0))
        ctx_c, ctx_u = policy.condition(sample, Branch.COND), policy.condition(sample, Branch.UNCOND)
        x, n = policy.init_noise(seed), len(plan)
        for i in range(n):
            t = torch.full((1,), 1.0 - i / n)
            v = c = policy.denoise_step(ctx_c, x, t)
            if plan[i]:
                u = policy.denoise_step(ctx_u, x, t)
                v = u + guidance * (c - u)
            x = x + (-1.0 / n) * v
        return x


# --- contexts are trees ------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["sequential", "batched"])
def test_a_tree_context_samples_as_the_tensor_it_holds(
    reference: ReferencePolicy, tiny_checkpoint: Path, mode: str
) -> None:
    tree = load(TreeContextPolicy, tiny_checkpoint)
    assert torch.equal(x_of(tree, mode=mode), x_of(reference, mode=mode))


def test_tree_contexts_batch_by_row(tiny_checkpoint: Path) -> None:
    tree = load(TreeContextPolicy, tiny_checkpoint)
    samples = [tree.prepare(tree.example_observation(k)) for k in range(3)]
    together = sample_actions(tree, collate(samples), [10, 11, 12], steps=STEPS, guidance=3.0, mode="batched")
    for k in range(3):
        alone = sample_actions(tree, samples[k], [10 + k], steps=STEPS, guidance=3.0, mode="batched")
        torch.testing.assert_close(together[k : k + 1], alone, rtol=0, atol=ATOL)
    ctx = tree.condition(collate(samples), Branch.COND)
    rows = [context_rows(ctx, slice(k, k + 1)) for k in range(3)]
    joined = context_cat(rows)
    assert torch.equal(joined["rest"][1][0], ctx["rest"][1][0]) and joined["head"].shape[0] == 3


# --- the policy's integrator ---------------------------------------------------------------------
def test_default_integrator_is_euler_with_the_policys_own_steps(reference: ReferencePolicy) -> None:
    assert reference.integrator().steps == reference.default_steps == 10
    assert torch.equal(x_of(reference, steps=None), x_of(reference, steps=10))
    assert torch.equal(x_of(reference, steps=STEPS), manual(reference, [True] * STEPS))
    with pytest.raises(ValueError, match="steps must be >= 1"):
        EulerFlow(0)


def test_a_policy_integrates_with_its_own_schedule(reference: ReferencePolicy, tiny_checkpoint: Path) -> None:
    own = load(OwnScheduleFlow, tiny_checkpoint)
    integ = own.integrator()
    assert integ.steps == 6 and integ.timesteps[0] == 1.0 and integ.timesteps[1] > 1.0 - 1 / 6
    with torch.inference_mode():
        sample = own.prepare(own.example_observation(0))
        ctx = own.condition(sample, Branch.COND)
        x = own.init_noise(3)
        for i, t in enumerate(integ.timesteps):
            x = x + integ.dts[i] * own.denoise_step(ctx, x, torch.full((1,), t))
    assert torch.equal(x_of(own, guidance=1.0, steps=None), x)
    assert not torch.allclose(x, x_of(reference, guidance=1.0, steps=6), atol=1e-3)  # not the server's Euler
    assert isinstance(own.integrator(3), ShiftedEuler) and own.integrator(3).steps == 3
    settings = SamplerSettings(None, None, "sequential").for_policy(own)
    assert (settings.steps, settings.guidance) == (6, 3.0)


# --- guidance interval -------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("cls", "plan"), [(EarlyGuidance, [True, True, False, False]), (LateGuidance, [False, False, True, True])]
)
def test_a_guidance_interval_guides_only_its_steps(tiny_checkpoint: Path, cls: type[Policy], plan: list[bool]) -> None:
    policy = load(cls, tiny_checkpoint)
    assert list(policy.guided_steps(STEPS)) == plan
    x = x_of(policy)
    assert torch.equal(x, manual(policy, plan))
    assert not torch.equal(x, manual(policy, [True] * STEPS))
    torch.testing.assert_close(x_of(policy, mode="batched"), x, rtol=0, atol=ATOL)
    assert GuidanceInterval(0.0, 0.25).guided(4) == (True, False, False, False)


@pytest.mark.slow
def test_cfgp2_skips_unguided_steps_on_both_ranks_alike(tiny_checkpoint: Path, tmp_path: Path) -> None:
    """Two real gloo ranks: the conditional rank's x is bitwise the sequential one (the unconditional rank skips
    the unguided steps' collectives and takes x back before guidance resumes; had the ranks disagreed on which
    steps have one, the pair would hang until the timeout)."""
    classes = ["EarlyGuidance", "LateGuidance", "TreeContextPolicy"]
    port, out = free_port(), tmp_path / "x.pt"
    args = [str(port), str(tiny_checkpoint), str(STEPS), str(out), *(f"contract_policies:{c}" for c in classes)]
    ranks = [
        subprocess.Popen(
            [str(VENV_BIN / "python"), str(PLUGIN_DIR / "cfg_pair.py"), str(r), *args],
            env=subprocess_env(),
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=120)[0] for p in ranks]
    finally:
        for p in ranks:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in ranks] == [0, 0], logs
    for name, x in zip(classes, torch.load(out), strict=True):
        policy = load(load_policy_class(f"tests.support.plugins.contract_policies:{name}"), tiny_checkpoint)
        assert torch.equal(x, x_of(policy, seed=7)), name


# --- policies without an unconditional branch ------------------------------------------------------
def test_a_policy_without_an_unconditional_branch_is_never_guided(tiny_checkpoint: Path) -> None:
    policy = load(UnguidedPolicy, tiny_checkpoint)
    settings = SamplerSettings(None, None, "sequential").for_policy(policy)
    assert settings.guidance == 1.0
    assert torch.equal(x_of(policy, guidance=settings.guidance), manual(policy, [False] * STEPS))
    with pytest.raises(ValueError, match="no unconditional branch"):
        x_of(policy, guidance=3.0)
    with pytest.raises(LayoutError, match="guidance must be 1.0, got 3"):
        SamplerSettings(None, 3.0, "sequential").for_policy(policy)
    with pytest.raises(LayoutError, match="cfgp=2 has nothing to run"):
        SamplerSettings(None, None, "sequential").for_policy(policy, cfgp=2)


def test_builtin_declarations_match_their_classes() -> None:
    assert set(BUILTIN_POLICIES) >= {REFERENCE, LEROBOT}
    assert load_policy_class(REFERENCE) is ReferencePolicy
    for name, declared in BUILTIN_POLICIES.items():
        try:
            cls = load_policy_class(name)
        except ValueError as exc:  # lerobot's extra not installed: nothing to compare
            assert name != REFERENCE and "No module named" in str(exc), exc
            continue
        assert cls.has_unconditional is declared.has_unconditional, name


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--policy", "lerobot", "--cfgp", "2"], "--policy lerobot has no unconditional branch"),
        (["--policy", "lerobot", "--guidance", "3"], "guidance must be 1.0, got 3"),
        (["--policy", "lerobot", "--cfgp", "2", "--dp", "2", "--guidance", "1.5"], "cfgp=2 has nothing to run"),
    ],
    ids=["cfgp2", "guidance", "cfgp2-dp2"],
)
def test_serve_refuses_guidance_for_a_policy_without_an_unconditional_branch(
    policyserver_main, tmp_path: Path, flags: list[str], words: str
) -> None:
    # A local checkpoint of a family with no unconditional branch: the launch reads its type before torch (for a
    # source not fetched yet and no --lerobot-family, only the loaded policy can tell, and it is checked then).
    (tmp_path / "smolvla").mkdir()
    (tmp_path / "smolvla" / "config.json").write_text(json.dumps({"type": "smolvla"}))
    result = policyserver_main(
        "serve", "--checkpoint", str(tmp_path / "smolvla"), "--host", "127.0.0.1", "--port", "0", *flags
    )
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0], result.stderr
    assert "listening" not in result.stdout


# --- session history ---------------------------------------------------------------------------------
def test_the_ingress_keeps_each_sessions_last_observations(tiny_checkpoint: Path) -> None:
    policy = load(HistoryPolicy, tiny_checkpoint)
    history = SessionHistory(policy, max_sessions=2)
    obs = [policy.prepare(policy.example_observation(k)) for k in range(4)]

    def states(sample: Sample) -> list[np.ndarray]:
        assert sample.tensors["state"].shape[:2] == (1, 2)
        return [sample.tensors["state"][0, k].numpy() for k in range(2)]

    first = states(history.extend("a", obs[0]))
    np.testing.assert_array_equal(first[0], first[1])  # padded with the oldest, as LeRobot's queues
    second = states(history.extend("a", obs[1]))
    np.testing.assert_array_equal(second[0], obs[0].tensors["state"][0])
    np.testing.assert_array_equal(second[1], obs[1].tensors["state"][0])
    other = states(history.extend("b", obs[2]))  # another session sees none of a's
    np.testing.assert_array_equal(other[0], obs[2].tensors["state"][0])
    third = states(history.extend("a", obs[3]))
    np.testing.assert_array_equal(third[0], obs[1].tensors["state"][0])
    alone = states(history.extend(None, obs[1]))
    np.testing.assert_array_equal(alone[0], alone[1])
    history.extend("c", obs[0])
    assert len(history) == 2  # bounded: "b" went first
    again = states(history.extend("b", obs[3]))
    np.testing.assert_array_equal(again[0], again[1])
    assert SessionHistory(load(ReferencePolicy, tiny_checkpoint)).extend("a", obs[0]) is obs[0]


def test_a_session_whose_shapes_change_starts_its_history_afresh(tiny_checkpoint: Path) -> None:
    policy = load(HistoryPolicy, tiny_checkpoint)
    history = SessionHistory(policy)
    small = policy.example_observation(0)
    big = dict(small, **{"observation/image": np.zeros((64, 64, 3), dtype=np.uint8)})
    history.extend("a", policy.prepare(small))
    stacked = history.extend("a", policy.prepare(big))
    assert stacked.tensors["camera0"].shape == (1, 2, 64, 64, 3)


class OneArgumentPostprocess(ReferencePolicy):
    """A plug-in written before ``postprocess_batch`` took the batch's sample: the server still serves it."""

    def postprocess_batch(self, x: torch.Tensor) -> list[np.ndarray]:  # type: ignore[override]
        return [np.full(self.action_shape, 7.0, dtype=np.float32) for _ in range(x.shape[0])]


def test_a_plugin_with_the_one_argument_postprocess_batch_is_still_served(tiny_checkpoint: Path) -> None:
    from policy_operator.layout import ParallelLayout
    from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest, Replica
    from policy_operator.runtime.parallel.groups import Groups
    from policy_operator.runtime.parallel.heartbeat import Heartbeat, MemoryKV

    policy = load(OneArgumentPostprocess, tiny_checkpoint)
    replica = Replica(
        policy,
        Groups(ParallelLayout(1, 1), 0),
        SamplerSettings(steps=2, guidance=1.0, cfg_mode="sequential"),
        Heartbeat(MemoryKV, 0, 1.0),  # never started: nothing is published
    )
    sample = policy.prepare(policy.example_observation(0))
    actions, _ = replica.execute(Batch((InferenceRequest("a", sample, 1), InferenceRequest("b", sample, 2))))
    assert [a.tolist() for a in actions] == [np.full(policy.action_shape, 7.0).tolist()] * 2
