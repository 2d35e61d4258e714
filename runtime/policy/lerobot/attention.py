"""pi0/pi0.5's attention without the per-head copies of the shared key/value head: eager's math, fewer kernels.

LeRobot runs PaliGemma's prefix and the action expert with transformers'
``eager`` attention: ``repeat_kv`` copies the one key/value head of Gemma's
multi-query attention to all eight query heads, then a matrix product, the
mask added, a float32 softmax and another product.  ``grouped_attention``
makes the same products over the same numbers without the copies: each
key/value head's query heads become more query rows against that one head
(a reshape of the queries), the mask broadcast over them, the softmax as
eager's.  A first version called ``scaled_dot_product_attention`` on those
rows instead; on an H100 it made pi0.5's ten steps slower at batch 1 (one
key/value head left the fused kernel 7 blocks of work for 132 SMs; 19.4 ->
28.2 ms) and no faster at batch 8.  This one keeps the products as matrix
multiplications with 8x the rows: compiled on an H100 it takes pi0.5's ten
steps from 33.3 to 29.0 ms at batch 8 and leaves batch 1 within its spread
(bench/results/lerobot-h100-round4.md), so it is on in bfloat16
(``Pi0.grouped_attention``; bench/lerobot_kernels.py's ``grouped-attention``
variant measures it against the step without it).  LeRobot sets
``_attn_implementation = "eager"`` on the model's config at every call; each
attention module gets its own copy of that config naming this function, which
those assignments do not reach.
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
    scaling: float = 1.0,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: ``query`` [B, H, L, D], ``key``/``value`` [B, Hkv, S, D], an
    additive ``attention_mask`` [B, 1 or H, L, >= S]; answers [B, L, H, D] as ``eager_attention_forward`` does
    (inference: ``dropout`` is not applied)."""
    batch, heads, length, dim = query.shape
    kv_heads, keys = key.shape[1], key.shape[2]
    group = heads // kv_heads
    rows = query.reshape(batch, kv_heads, group * length, dim)
    scores = (torch.matmul(rows, key.transpose(2, 3)) * scaling).view(batch, kv_heads, group, length, keys)
    if attention_mask is not None:
        mask = attention_mask[:, :, :, :keys]
        mask = mask[:, :, None] if mask.shape[1] == 1 else mask.view(batch, kv_heads, group, length, keys)
        scores = scores + mask
    weights = F.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    out = torch.matmul(weights.view(batch, kv_heads, group * length, keys), value)
    return out.view(batch, heads, length, dim).transpose(1, 2).contiguous(), None


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
