"""A pi0 / pi0.5 small enough for a CPU test: LeRobot's own model code around a reduced PaliGemma.

LeRobot 0.6 builds PaliGemma with a fixed vocabulary (257152 tokens) and a
vision projection fixed at 2048 wide, so every ``paligemma_variant`` it
accepts is at least gemma_2b-wide (``gemma_300m`` fails at inference with
"Expected size 2048 but got size 1024"): ~1B parameters before one layer.
``reduced_paligemma`` shrinks what those constants size -- the Gemma
variants (2 layers, 64 / 32 wide), the vocabulary, the SigLIP tower, the
projection (to the text width) -- at the two constructors LeRobot calls, for
both the pi0 and the pi0.5 module.  Everything else (prefix, KV cache, action
expert, the denoising loop, the processors) is LeRobot's code unchanged.  The
patch must be active while such a checkpoint is written and while it loads.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

VOCAB = 320  # the bundled tokenizer's ~300 ids fit


def _small_gemma(module: Any) -> Any:
    def get_gemma_config(variant: str) -> Any:
        width = 64 if variant == "gemma_2b" else 32
        return module.GemmaConfig(width=width, depth=2, mlp_dim=2 * width, num_heads=2, num_kv_heads=1, head_dim=16)

    return get_gemma_config


def _small_paligemma(original: Any) -> Any:
    def build(config: Any) -> Any:
        config._vocab_size = VOCAB  # noqa: SLF001 - LeRobot sets the same private field
        config.image_token_index = VOCAB - 1
        config.text_config.vocab_size = VOCAB
        vision = config.vision_config
        vision.hidden_size, vision.intermediate_size, vision.num_hidden_layers = 32, 64, 1
        vision.num_attention_heads = 2
        vision.projection_dim = config.text_config.hidden_size
        return original(config=config)

    return build


def _small_expert(original: Any) -> Any:
    def build(config: Any) -> Any:
        config.vocab_size = VOCAB
        return original(config=config)

    return build


@contextlib.contextmanager
def reduced_paligemma() -> Iterator[None]:
    from lerobot.policies.pi0 import modeling_pi0
    from lerobot.policies.pi05 import modeling_pi05

    saved = []
    for module in (modeling_pi0, modeling_pi05):
        for name, make in (
            ("get_gemma_config", lambda m, o: _small_gemma(m)),
            ("PaliGemmaForConditionalGenerationWithPiGemma", lambda m, o: _small_paligemma(o)),
            ("PiGemmaForCausalLM", lambda m, o: _small_expert(o)),
        ):
            original = getattr(module, name)
            saved.append((module, name, original))
            setattr(module, name, make(module, original))
    try:
        yield
    finally:
        for module, name, original in reversed(saved):
            setattr(module, name, original)


def configure_small_pi(config: Any) -> None:
    """Float32 (the 1e-5 comparison), a short chunk, few steps, small cameras."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    config.dtype = "float32"
    config.chunk_size = config.n_action_steps = 8
    config.num_inference_steps = 4
    config.image_resolution = (56, 56)
    config.input_features = {
        "observation.state": PolicyFeature(FeatureType.STATE, (6,)),
        "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 48, 64)),
    }
    config.output_features = {"action": PolicyFeature(FeatureType.ACTION, (6,))}


def write_small_pi(family: str, directory: Path, seed: int = 0) -> Path:
    """A pi0 or pi0.5 checkpoint on the reduced backbone (load it inside ``reduced_paligemma`` too)."""
    with reduced_paligemma():
        return write_tiny_checkpoint(family, directory, size="base", seed=seed, configure=configure_small_pi)
