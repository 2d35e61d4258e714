"""A LeRobot pretrained directory, loaded offline: config.json, model.safetensors and the saved processors.

Serving never reaches a hub: ``HF_HUB_OFFLINE`` is set before LeRobot (and
with it transformers and huggingface_hub) is imported, and forced on the
already imported hub client too.  A checkpoint names other repositories (the
SmolVLM config and processor, a PaliGemma tokenizer); each name resolves to a
directory of that name inside the checkpoint when there is one (how
``write_tiny_checkpoint`` bundles them, and how a fetched checkpoint may carry
them), else to the offline hub cache (``HF_HUB_CACHE``), where the fetch Job
puts them.  A missing one fails the load with the name, never a download.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.checkpoint.format import CheckpointError
from policy_operator.runtime.policy.lerobot.families import family_class

CONFIG_JSON = "config.json"
PREPROCESSOR_JSON = "policy_preprocessor.json"
POSTPROCESSOR_JSON = "policy_postprocessor.json"
TOKENIZER_STEP = "tokenizer_processor"
DEVICE_STEP = "device_processor"


def go_offline() -> None:
    """No hub access from this process: the environment for what imports next, the flag for what already did."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


@dataclass
class Loaded:
    """What one LeRobot pretrained directory holds, built on ``device``."""

    root: Path
    config: Any  # lerobot PreTrainedConfig (its subclass for the policy type)
    policy: Any  # lerobot PreTrainedPolicy, eval mode, on the device
    preprocessor: Any  # PolicyProcessorPipeline, run on the CPU by prepare
    postprocessor: Any  # PolicyProcessorPipeline, run on the output rank

    @property
    def type(self) -> str:
        return str(self.config.type)


def resolve_reference(name: str, root: Path) -> str:
    """A repository a checkpoint names: the directory of that name inside the checkpoint, or the name itself
    (resolved by the offline hub cache)."""
    bundled = root / name
    return str(bundled) if name and not Path(name).is_absolute() and bundled.is_dir() else name


def read_policy_type(root: Path) -> str:
    """The LeRobot policy type of a checkpoint directory, with a clear error for a directory that is not one."""
    try:
        data = json.loads((root / CONFIG_JSON).read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{root} is not a LeRobot checkpoint: {CONFIG_JSON} is missing") from None
    except ValueError as exc:
        raise CheckpointError(f"{root / CONFIG_JSON} is not JSON: {exc}") from exc
    kind = data.get("type") if isinstance(data, dict) else None
    if not isinstance(kind, str):
        raise CheckpointError(f"{root / CONFIG_JSON} has no LeRobot policy 'type' (smolvla, pi0, pi05, diffusion...)")
    return kind


def _tokenizer_overrides(root: Path) -> dict[str, Any]:
    """The saved preprocessor's tokenizer name, resolved as every other reference is."""
    try:
        steps = json.loads((root / PREPROCESSOR_JSON).read_text()).get("steps", [])
    except FileNotFoundError:
        raise CheckpointError(
            f"{root} has no saved preprocessor ({PREPROCESSOR_JSON}); save it with "
            "preprocessor.save_pretrained(dir) next to the policy"
        ) from None
    for step in steps:
        name = step.get("config", {}).get("tokenizer_name")
        if step.get("registry_name") == TOKENIZER_STEP and isinstance(name, str):
            return {TOKENIZER_STEP: {"tokenizer_name": resolve_reference(name, root)}}
    return {}


def load_pretrained(checkpoint: str | os.PathLike[str], device: torch.device) -> Loaded:
    """The policy on ``device`` (eval, no grad) and its pipelines; the preprocessor's tensors stay on the CPU."""
    go_offline()
    root = Path(checkpoint)
    kind = read_policy_type(root)
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    try:
        cls = get_policy_class(kind)
    except (ValueError, NotImplementedError, ImportError) as exc:
        raise CheckpointError(f"{root / CONFIG_JSON}: LeRobot cannot build policy type {kind!r}: {exc}") from exc
    config = PreTrainedConfig.from_pretrained(str(root))
    config.device = device.type
    if hasattr(config, "vlm_model_name"):
        config.vlm_model_name = resolve_reference(config.vlm_model_name, root)
    if kind in LEROBOT_FAMILIES:  # a family's other repositories (LingBot-VA's VAE, text encoder and tokenizer)
        for name in family_class(kind).references:
            setattr(config, name, resolve_reference(getattr(config, name), root))
    if getattr(config, "pretrained_backbone_weights", None):
        # torchvision would download ImageNet weights; the checkpoint's own weights replace them anyway
        config.pretrained_backbone_weights = None
    try:
        policy = cls.from_pretrained(str(root), config=config)
    except OSError as exc:  # a referenced repository neither bundled nor in the offline cache
        raise CheckpointError(f"{root}: {str(exc).splitlines()[0]}") from exc
    policy.to(device).eval().requires_grad_(False)
    preprocessor, postprocessor = make_pre_post_processors(
        config,
        pretrained_path=str(root),
        preprocessor_overrides={DEVICE_STEP: {"device": "cpu"}, **_tokenizer_overrides(root)},
    )
    return Loaded(root, config, policy, preprocessor, postprocessor)
