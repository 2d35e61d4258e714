"""SmolVLA's vision embeddings without a boolean-mask assignment: the same values, no host sync, one graph.

transformers' ``SmolVLMVisionEmbeddings.forward`` places each patch's
position id with ``position_ids[mask] = pos_ids[mask]``: boolean indexing,
whose output shape depends on the mask's values, so eager PyTorch waits for
the GPU there (a host sync per camera per request, in the middle of the
prefix) and torch.compile breaks the prefix's graph at it (eight breaks for
two cameras).  The two tensors have the same shape, so the assignment is
``torch.where(mask, pos_ids, position_ids)``.  ``mask_free_positions``
replaces the forward of one embeddings module with transformers' own code
(transformers 5.5) and that one line changed; ``forward`` keeps the
module's parameters, so nothing else about the model changes.
"""

from __future__ import annotations

from typing import Any

import torch


def forward(module: Any, pixel_values: torch.Tensor, patch_attention_mask: torch.Tensor) -> torch.Tensor:
    """``SmolVLMVisionEmbeddings.forward`` with the positions placed by ``torch.where``."""
    batch_size, _, max_im_h, max_im_w = pixel_values.shape

    patch_embeds = module.patch_embedding(pixel_values)
    embeddings = patch_embeds.flatten(2).transpose(1, 2)

    max_nb_patches_h, max_nb_patches_w = max_im_h // module.patch_size, max_im_w // module.patch_size
    boundaries = torch.arange(
        1 / module.num_patches_per_side, 1.0, 1 / module.num_patches_per_side, device=pixel_values.device
    )
    position_ids = torch.full(
        size=(batch_size, max_nb_patches_h * max_nb_patches_w), fill_value=0, device=pixel_values.device
    )

    nb_patches_h = patch_attention_mask[:, :, 0].sum(dim=1)
    nb_patches_w = patch_attention_mask[:, 0, :].sum(dim=1)

    step_h = 1.0 / nb_patches_h
    step_w = 1.0 / nb_patches_w

    max_patches_h = patch_attention_mask.size(1)
    max_patches_w = patch_attention_mask.size(2)
    h_indices = torch.arange(max_patches_h, device=position_ids.device, dtype=torch.float32)
    w_indices = torch.arange(max_patches_w, device=position_ids.device, dtype=torch.float32)

    fractional_coords_h = h_indices[None, :] * step_h[:, None]
    fractional_coords_w = w_indices[None, :] * step_w[:, None]

    fractional_coords_h = torch.clamp(fractional_coords_h, max=(1.0 - 1e-6))
    fractional_coords_w = torch.clamp(fractional_coords_w, max=(1.0 - 1e-6))

    fractional_coords_h = fractional_coords_h.to(pixel_values.dtype)
    fractional_coords_w = fractional_coords_w.to(pixel_values.dtype)

    bucket_coords_h = torch.bucketize(fractional_coords_h, boundaries, right=True)
    bucket_coords_w = torch.bucketize(fractional_coords_w, boundaries, right=True)

    pos_ids = bucket_coords_h[:, :, None] * module.num_patches_per_side + bucket_coords_w[:, None, :]
    pos_ids = pos_ids.reshape(batch_size, -1)

    position_ids = torch.where(patch_attention_mask.view(batch_size, -1), pos_ids, position_ids)

    return embeddings + module.position_embedding(position_ids)


def mask_free_positions(embeddings: Any) -> None:
    """Serve ``embeddings`` (a ``SmolVLMVisionEmbeddings``) with ``forward`` above."""
    embeddings.forward = lambda pixel_values, patch_attention_mask: forward(
        embeddings, pixel_values, patch_attention_mask
    )
