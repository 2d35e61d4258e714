"""A LeRobot pretrained directory, loaded offline: config.json, model.safetensors and the saved processors.

Serving never reaches a hub: ``HF_HUB_OFFLINE`` is set before LeRobot (and
with it transformers and huggingface_hub) is imported, and forced on the
already imported hub client too.  A checkpoint names other repositories (the
SmolVLM config and processor, a PaliGemma tokenizer); each name resolves to a
directory of that name inside the checkpoint when there is one (how
``write_tiny_checkpoint`` bundles them, and how a fetched checkpoint may carry
them), else to the offline hub cache (``HF_HUB_CACHE``), where the fetch Job
puts them.  A missing one fails the load with the name, never a download.

A checkpoint never runs code unless the user opted in by name: before
LeRobot reads anything of it, ``checkpoint/trusted_steps.py`` checks the
policy type against the served families, every saved processor step against
LeRobot's registered steps (by name, never an import path), the weights for
pickles and -- without ``trust_remote_code`` -- the checkpoint's JSON for
``auto_map``; then the steps that take a ``trust_remote_code`` get the user's
choice, and transformers refuses (never prompts for) any other remote code.
Each refusal is a ``CheckpointError`` naming the file or the step.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.checkpoint.format import CheckpointError
from policy_operator.runtime.checkpoint.trusted_steps import (
    POSTPROCESSOR_JSON,
    PREPROCESSOR_JSON,
    TrustedCheckpoint,
    check_lerobot_checkpoint,
    step_overrides,
)
from policy_operator.runtime.policy.lerobot.families import family_class

CONFIG_JSON = "config.json"
TOKENIZER_STEP = "tokenizer_processor"
DEVICE_STEP = "device_processor"


def go_offline() -> None:
    """No hub access from this process: the environment for what imports next, the flag for what already did."""
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    import huggingface_hub.constants

    huggingface_hub.constants.HF_HUB_OFFLINE = True


def import_lerobot() -> None:
    """LeRobot's policy factory and with it every family's modules, transformers and diffusers: offline first, so
    nothing imported on the way can reach a hub."""
    go_offline()
    import lerobot.policies.factory  # noqa: F401 - imported for its cost, timed apart from the weights


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


def _tokenizer_overrides(trusted: TrustedCheckpoint) -> dict[str, Any]:
    """The saved preprocessor's tokenizer name, resolved as every other reference is."""
    for step in trusted.steps(PREPROCESSOR_JSON):
        name = step.config.get("tokenizer_name")
        if step.name == TOKENIZER_STEP and isinstance(name, str):
            return {TOKENIZER_STEP: {"tokenizer_name": resolve_reference(name, trusted.root)}}
    return {}


@contextlib.contextmanager
def _remote_code(trust: bool) -> Iterator[None]:
    """Without ``trust``, transformers refuses a repository's own code where no caller said either way (it would
    otherwise ask on a terminal for 15 s): its prompt's timeout at 0 is its own non-interactive refusal."""
    if trust:
        yield
        return
    from transformers import dynamic_module_utils

    before = dynamic_module_utils.TIME_OUT_REMOTE_CODE
    dynamic_module_utils.TIME_OUT_REMOTE_CODE = 0
    try:
        yield
    finally:
        dynamic_module_utils.TIME_OUT_REMOTE_CODE = before


def _check_registered(trusted: TrustedCheckpoint) -> None:
    """Every step name is one LeRobot itself registered (a name on the allowlist that some other import
    registered, or that LeRobot no longer has, is refused before LeRobot builds the pipeline)."""
    from lerobot.processor import ProcessorStepRegistry

    for steps in trusted.pipelines.values():
        for step in steps:
            try:
                cls = ProcessorStepRegistry.get(step.name)
            except KeyError:
                raise CheckpointError(f"{trusted.root / step.file}: {step} is not registered by LeRobot") from None
            if not str(getattr(cls, "__module__", "")).startswith("lerobot."):
                raise CheckpointError(
                    f"{trusted.root / step.file}: {step} is registered by {cls.__module__}, not by LeRobot"
                )


def load_pretrained(
    checkpoint: str | os.PathLike[str], device: torch.device, *, trust_remote_code: bool = False
) -> Loaded:
    """The policy on ``device`` (eval, no grad) and its pipelines; the preprocessor's tensors stay on the CPU.

    ``trust_remote_code``: the user's opt-in (``--trust-remote-code``) to the checkpoint's own Python files.
    """
    go_offline()
    root = Path(checkpoint)
    trusted = check_lerobot_checkpoint(root, trust_remote_code=trust_remote_code)  # before LeRobot reads any of it
    with _remote_code(trust_remote_code):
        return _load(trusted, device, trust_remote_code)


def _load(trusted: TrustedCheckpoint, device: torch.device, trust: bool) -> Loaded:
    root, kind = trusted.root, trusted.type
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
    family = family_class(kind) if kind in LEROBOT_FAMILIES else None
    if family is not None:  # a family's other repositories (LingBot-VA's VAE, text encoder and tokenizer)
        for name in family.references:
            setattr(config, name, resolve_reference(getattr(config, name), root))
    if getattr(config, "pretrained_backbone_weights", None):
        # torchvision would download ImageNet weights; the checkpoint's own weights replace them anyway
        config.pretrained_backbone_weights = None
    try:
        with family.loading(root) if family is not None else contextlib.nullcontext():
            policy = cls.from_pretrained(str(root), config=config)
    except OSError as exc:  # a referenced repository neither bundled nor in the offline cache
        raise CheckpointError(f"{root}: {str(exc).splitlines()[0]}") from exc
    policy.to(device).eval().requires_grad_(False)
    _check_registered(trusted)  # the policy's module has registered its own steps by now
    try:
        preprocessor, postprocessor = make_pre_post_processors(
            config,
            pretrained_path=str(root),
            preprocessor_overrides={
                DEVICE_STEP: {"device": "cpu"},
                **_tokenizer_overrides(trusted),
                **step_overrides(trusted.steps(PREPROCESSOR_JSON), trust_remote_code=trust),
            },
            postprocessor_overrides=step_overrides(trusted.steps(POSTPROCESSOR_JSON), trust_remote_code=trust),
        )
    except (ValueError, ImportError, OSError) as exc:  # a step refused: e.g. a tokenizer that needs remote code
        raise CheckpointError(f"{root}: a saved processor step did not load: {str(exc).splitlines()[0]}") from exc
    if family is not None:
        family.pipelines_loaded(preprocessor, root)
    return Loaded(root, config, policy, preprocessor, postprocessor)
