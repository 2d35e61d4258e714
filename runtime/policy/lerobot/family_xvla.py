"""X-VLA (LeRobot ``xvla``): a Florence-2 encoder and a soft-prompted transformer that predicts the clean chunk.

LeRobot's ``generate_actions`` encodes the prompt and the primary camera with
Florence-2's encoder once (the other cameras' image tokens ride along), then
for ``i = steps .. 1`` re-noises its current estimate with the request's fixed
noise -- ``x_t = x1 * t + action * (1 - t)`` at ``t = i / steps`` -- and asks
the transformer for the clean chunk again.  The step's state is therefore two
tensors, the noise ``x1`` and the estimate: ``x`` holds both side by side on
the last dimension (``[chunk, 2 * dim_action]``), ``denoise`` answers the new
estimate in the second half, and ``Reestimate.step`` keeps the noise and takes
the estimate.  No unconditional branch (X-VLA was not trained for CFG).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from policy_operator.runtime.policy.interface import Context, Integrator
from policy_operator.runtime.policy.lerobot.families import Family

TOKENIZER_DIR = "tokenizer"  # the bundled BART-style tokenizer (tiny.py's name for a bundled tokenizer)


class Reestimate(Integrator):
    """X-VLA's loop: t = i / steps for i = steps .. 1; each step replaces the estimate (x's second half)."""

    def __init__(self, steps: int, dim: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.timesteps = tuple(i / steps for i in range(steps, 0, -1))
        self.dim = dim

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        return torch.cat([x[..., : self.dim], out[..., self.dim :]], dim=-1)


class XVLA(Family):
    references = ("tokenizer_name",)
    device_preprocessing = False  # its preprocessor scales and ImageNet-normalizes the cameras in its own steps

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self.model = policy.model
        self.dim = int(self.model.dim_action)
        self.target_dtype: torch.dtype = self.model._get_target_dtype()  # noqa: SLF001
        self.noise_dtype = self.target_dtype  # drawn in it by draw_noise, kept in it

    @property
    def chunk(self) -> int:
        return int(self.config.chunk_size)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (1, self.chunk, 2 * self.dim)

    def draw_noise(self, generator: torch.Generator) -> torch.Tensor:
        x1 = torch.randn((1, self.chunk, self.dim), generator=generator, dtype=self.target_dtype)
        return torch.cat([x1, torch.zeros_like(x1)], dim=-1)  # the estimate starts at zero, as LeRobot's

    @property
    def default_steps(self) -> int:
        return max(1, int(self.config.num_denoising_steps))

    def integrator(self, steps: int) -> Integrator:
        return Reestimate(steps, self.dim)

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        inputs = self.policy._build_model_inputs(batch)  # noqa: SLF001 - LeRobot's own view of the batch
        images = inputs["image_input"].to(dtype=self.target_dtype)
        return {
            "enc": self.model.forward_vlm(inputs["input_ids"], images, inputs["image_mask"]),
            "domain": inputs["domain_id"],
            "proprio": inputs["proprio"].to(dtype=self.target_dtype),
        }

    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        x1, estimate = x[..., : self.dim], x[..., self.dim :]
        t = t.to(self.target_dtype)
        x_t = x1 * t.view(-1, 1, 1) + estimate * (1 - t).view(-1, 1, 1)
        proprio, x_t = self.model.action_space.preprocess(context["proprio"], x_t)
        new = self.model.transformer(
            domain_id=context["domain"], action_with_noise=x_t, proprio=proprio, t=t, **context["enc"]
        )
        return torch.cat([torch.zeros_like(x1), new], dim=-1)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        actions: torch.Tensor = self.model.action_space.postprocess(x[..., self.dim :])
        return actions

    def rtc_unsupported(self) -> str | None:
        return (
            "X-VLA's transformer predicts the clean chunk and each step re-noises it with the request's fixed "
            "noise; real-time chunking's correction is for a velocity integrated from t=1 (SmolVLA, pi0, pi0.5)"
        )


FAMILY = XVLA


def tiny_config(root: Path, size: str) -> Any:
    """An X-VLA config of ``size``: a small Florence-2 (DaViT + BART encoder) built from config, and a locally
    trained BPE tokenizer bundled under ``root/tokenizer`` in place of ``facebook/bart-large``'s."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.xvla.configuration_xvla import XVLAConfig

    from policy_operator.runtime.policy.lerobot.tiny import train_tokenizer

    if size != "tiny":
        raise ValueError(
            "xvla has no base size here: its published Florence-2-large backbone is loaded from its checkpoint; "
            "serve a fetched X-VLA checkpoint"
        )
    tokenizer = train_tokenizer()
    tokenizer.save_pretrained(root / TOKENIZER_DIR)
    ids = {"pad_token_id": tokenizer.pad_token_id, "bos_token_id": tokenizer.bos_token_id}
    ids["eos_token_id"] = tokenizer.eos_token_id
    florence = {
        "vision_config": {
            "depths": [1, 1],
            "patch_size": [7, 3],
            "patch_stride": [4, 2],
            "patch_padding": [3, 1],
            "patch_prenorm": [False, True],
            "embed_dim": [16, 32],
            "num_heads": [2, 2],
            "num_groups": [2, 2],
            "window_size": 2,
            "drop_path_rate": 0.0,
            "projection_dim": 32,
            "max_temporal_embeddings": 4,
            "max_position_embeddings": 16,
        },
        "text_config": {
            "model_type": "bart",
            "vocab_size": len(tokenizer),
            "d_model": 32,
            "encoder_layers": 1,
            "decoder_layers": 1,
            "encoder_attention_heads": 2,
            "decoder_attention_heads": 2,
            "encoder_ffn_dim": 64,
            "decoder_ffn_dim": 64,
            "max_position_embeddings": 128,
            **ids,
        },
        **ids,
    }
    cameras = {key: PolicyFeature(FeatureType.VISUAL, (3, 32, 32)) for key in ("top", "wrist")}
    inputs = {f"observation.images.{key}": feature for key, feature in cameras.items()}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (6,))
    return XVLAConfig(
        florence_config=florence,
        tokenizer_name=TOKENIZER_DIR,
        tokenizer_max_length=8,
        hidden_size=32,
        depth=2,
        num_heads=2,
        num_domains=2,
        len_soft_prompts=4,
        dim_time=8,
        max_len_seq=128,
        action_mode="auto",
        num_denoising_steps=3,
        max_state_dim=8,
        max_action_dim=8,
        chunk_size=4,
        n_action_steps=4,
        resize_imgs_with_padding=(32, 32),
        device="cpu",
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (6,))},
    )
