"""pi0/pi0.5's grouped attention (runtime/policy/lerobot/attention.py): transformers' eager math, no copies.

In float32 it answers what LeRobot's ``eager`` attention answers
(repeated key/value heads, additive mask, float32 softmax) for any grouping;
a bfloat16 policy (``Pi0.grouped_attention``, on by default: faster on an
H100, docs/benchmarks.md) routes every Gemma attention module of the prefix and the
action expert through it, and LeRobot's per-call ``_attn_implementation =
"eager"`` on the model's config does not undo that; a float32 policy keeps
LeRobot's path.  The bfloat16 answers' bound against LeRobot's float32 ones is
tests/test_lerobot_speed.py's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from policy_operator.runtime.policy.interface import Branch, collate  # noqa: E402
from policy_operator.runtime.policy.lerobot import LeRobotPolicy  # noqa: E402
from policy_operator.runtime.policy.lerobot.attention import NAME, grouped_attention  # noqa: E402
from tests.support.lerobot_tiny import reduced_paligemma, write_small_pi  # noqa: E402


class _Heads(torch.nn.Module):
    def __init__(self, groups: int) -> None:
        super().__init__()
        self.num_key_value_groups = groups


@pytest.mark.parametrize(("heads", "kv_heads"), [(8, 1), (8, 2), (4, 4)])
def test_grouped_attention_answers_transformers_eager_attention(heads: int, kv_heads: int) -> None:
    from transformers.models.gemma.modeling_gemma import eager_attention_forward

    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    batch, length, keys, dim = 3, 5, 11, 16
    query = torch.randn(batch, length, heads, dim, generator=gen).transpose(1, 2)  # as the projections leave it
    key = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    value = torch.randn(batch, kv_heads, keys, dim, generator=gen)
    allowed = torch.rand(batch, 1, length, keys, generator=gen) > 0.3
    allowed[..., 0] = True  # every query sees one key at least, as the prefix's masks guarantee
    mask = torch.where(allowed, 0.0, -2.3819763e38)  # LeRobot's additive mask value
    module = _Heads(heads // kv_heads)
    ours, weights = grouped_attention(module, query, key, value, mask, scaling=dim**-0.5)
    eager, _ = eager_attention_forward(module, query, key, value, mask, scaling=dim**-0.5)
    assert weights is None and ours.shape == eager.shape == (batch, length, heads, dim)
    torch.testing.assert_close(ours, eager, rtol=1e-5, atol=1e-5)
    other = mask.clone()
    other[..., 0] = -2.3819763e38
    other[..., 1] = 0.0
    assert not torch.allclose(grouped_attention(module, query, key, value, other, scaling=dim**-0.5)[0], ours)


def _attention_configs(policy: LeRobotPolicy) -> list[str]:
    model = policy.loaded.policy.model.paligemma_with_expert
    language = model.paligemma.model.language_model
    return [
        layer.self_attn.config._attn_implementation  # noqa: SLF001
        for layers in (language.layers, model.gemma_expert.model.layers)
        for layer in layers
    ]


def test_a_bfloat16_pi05_attends_through_it_and_float32_keeps_lerobots_eager(tmp_path: Path) -> None:
    root = write_small_pi("pi05", tmp_path, seed=4)
    with reduced_paligemma():
        bf16 = LeRobotPolicy.load(str(root), device=torch.device("cpu"), dtype=torch.bfloat16)
        fp32 = LeRobotPolicy.load(str(root), device=torch.device("cpu"))
        implementations = _attention_configs(bf16)
        assert implementations and set(implementations) == {NAME}
        sample = collate([bf16.prepare(bf16.example_observation(0))])
        context = bf16.condition(sample, Branch.COND)
        x = bf16.init_noise(0)
        bf16.denoise_step(context, x, bf16.integrator().time(0, 1, x.device))
        expert = bf16.loaded.policy.model.paligemma_with_expert.gemma_expert.model
        assert expert.config._attn_implementation == "eager"  # noqa: SLF001 - LeRobot set it during the step
        assert set(_attention_configs(bf16)) == {NAME}
        assert set(_attention_configs(fp32)) <= {"eager", "sdpa", None}
