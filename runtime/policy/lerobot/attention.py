"""pi0/pi0.5's attention in reduced precision: one fused kernel, the shared key/value head never copied per head.

LeRobot runs PaliGemma's prefix and the action expert with transformers'
``eager`` attention: ``repeat_kv`` copies the one key/value head of Gemma's
multi-query attention to all eight query heads, then a matrix product, the
mask added, a float32 softmax and another product.  On an H100 the copies
alone took 2.1 ms of each denoising step's 3.4 ms at batch 8
(bench/results/lerobot-kernels-h100.md).  ``grouped_attention`` computes the
same function with one ``scaled_dot_product_attention`` call: each key/value
head's query heads become more query rows against that one head (a reshape
of the queries, no copy of the keys), the additive mask broadcast over them.
Its softmax accumulates in float32 inside the kernel rather than over
bfloat16 scores, so it serves reduced precision only (``use_grouped_attention``
is called for ``--dtype bfloat16``); float32 keeps LeRobot's eager path and its
1e-5 equality.  LeRobot sets ``_attn_implementation = "eager"`` on the model's
config at every call; each attention module gets its own copy of that config
naming this function, which those assignments do not reach.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812

NAME = "policy_operator_grouped_sdpa"


def grouped_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [B, H, L, D], ``key``/``value`` [B, Hkv, S, D], an
    additive ``attention_mask`` [B, 1 or H, L, >= S]; answers [B, L, H, D] as ``eager_attention_forward`` does."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * length, dim)
    mask = None
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :keys].to(query.dtype)
        mask = mask.expand(batch, heads, length, keys).reshape(batch, kv_heads, group * length, keys)
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)
    return out.reshape(batch, heads, length, dim).transpose(1, 2).contiguous(), None


def use_grouped_attention(models: Iterable[torch.nn.Module]) -> int:
    """Every attention module under ``models`` runs ``grouped_attention``; answers how many."""
    from transformers import AttentionInterface

    AttentionInterface.register(NAME, grouped_attention)
    count = 0
    for model in models:
        for module in model.modules():
            config = getattr(module, "config", None)
            if config is None or not hasattr(module, "num_key_value_groups"):
                continue
            own = copy.copy(config)
            own._attn_implementation = NAME  # noqa: SLF001 - transformers' own selector
            module.config = own
            count += 1
    return count
