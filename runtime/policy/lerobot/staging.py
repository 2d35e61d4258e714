"""The cameras' preprocessing moved from the per-request CPU pipeline onto the serving device, for the whole batch.

LeRobot's preprocessor turns each camera frame into float CHW in [0, 1] and
normalizes it (the VLAs' images are ``IDENTITY``, Diffusion Policy's
``MEAN_STD``), one request at a time on the host -- for SmolVLA's two
480x640 cameras 7.4 MB of float32 per request, built on one intra-op thread
and then copied to the GPU.  Here ``prepare`` keeps each frame as the robot
sent it (uint8 HWC: a quarter of the bytes) and runs the saved preprocessor
on the rest (state, task); ``finish`` converts and normalizes the batch's
frames on the device with the same element-wise operations LeRobot runs on
the CPU (``float() / 255``, ``(x - mean) / (std + eps)``), so the model sees
the same values.  The tokenizer's answer for a text is cached (``TokenCache``):
a robot sends the same instruction every request.

A checkpoint whose preprocessor renames a camera, or normalizes images with
another mode, keeps LeRobot's CPU path (``DeviceStaging.of`` returns None).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from policy_operator.runtime.policy.lerobot.wire import ObservationSpec

TOKEN_CACHE_SIZE = 256


@dataclass(frozen=True)
class CameraNorm:
    """LeRobot's ``MEAN_STD`` for one camera: ``(x - mean) / (std + eps)``, its statistics float32 [C, 1, 1]."""

    mean: torch.Tensor
    std: torch.Tensor
    eps: float


@dataclass
class DeviceStaging:
    cameras: tuple[str, ...]
    norms: dict[str, CameraNorm]
    _on: dict[torch.device, dict[str, tuple[torch.Tensor, torch.Tensor]]]

    @classmethod
    def of(cls, spec: ObservationSpec, preprocessor: Any) -> DeviceStaging | None:
        """The staging of ``preprocessor``'s image steps, or None when they are not the ones it reproduces."""
        from lerobot.configs.types import FeatureType, NormalizationMode
        from lerobot.processor import NormalizerProcessorStep, RenameObservationsProcessorStep

        cameras = tuple(f.key for f in spec.features if f.kind == "VISUAL")
        if not cameras:
            return None
        norms: dict[str, CameraNorm] = {}
        for step in preprocessor.steps:
            if isinstance(step, RenameObservationsProcessorStep) and set(step.rename_map) & set(cameras):
                return None
            if not isinstance(step, NormalizerProcessorStep):
                continue
            mode = step.norm_map.get(FeatureType.VISUAL, NormalizationMode.IDENTITY)
            stats = {k: step._tensor_stats[k] for k in cameras if k in step._tensor_stats}  # noqa: SLF001
            if mode == NormalizationMode.IDENTITY or not stats:
                continue
            if mode != NormalizationMode.MEAN_STD or norms or step.normalize_observation_keys is not None:
                return None
            for key, s in stats.items():
                mean, std = (s[k].detach().to("cpu", torch.float32) for k in ("mean", "std"))
                norms[key] = CameraNorm(mean, std, float(step.eps))
        return cls(cameras, norms, {})

    def take(self, frame: dict[str, Any]) -> dict[str, torch.Tensor]:
        """Pop the cameras out of a parsed frame, each with its batch dimension (uint8 HWC or float CHW)."""
        return {key: frame.pop(key)[None] for key in self.cameras}

    def _stats(self, key: str, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        on = self._on.setdefault(device, {})
        if key not in on:
            norm = self.norms[key]
            on[key] = (norm.mean.to(device), (norm.std + norm.eps).to(device))
        return on[key]

    def finish(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The batch's cameras (on the device) as LeRobot's preprocessor leaves them: float CHW, normalized."""
        out = dict(batch)
        for key in self.cameras:
            image = batch[key]
            if image.dtype == torch.uint8:  # [..., H, W, C] -> [..., C, H, W] in [0, 1]
                image = image.movedim(-1, -3).float().div_(255.0)
            if key in self.norms:
                mean, denom = self._stats(key, image.device)
                image = (image - mean) / denom
            out[key] = image
        return out


class TokenCache:
    """The saved tokenizer step's answer per text, computed once: ``_tokenize_text`` is replaced on the step
    (LeRobot calls it with the task, or pi0.5's prompt with the discretized state in it)."""

    def __init__(self, step: Any, size: int = TOKEN_CACHE_SIZE) -> None:
        self.tokenize: Callable[[Any], dict[str, torch.Tensor]] = step._tokenize_text  # noqa: SLF001
        self._cached = functools.lru_cache(maxsize=size)(self._tokenize)
        step._tokenize_text = self  # noqa: SLF001

    def _tokenize(self, text: str | tuple[str, ...]) -> dict[str, torch.Tensor]:
        return dict(self.tokenize(list(text) if isinstance(text, tuple) else text))

    def __call__(self, text: str | Sequence[str]) -> dict[str, torch.Tensor]:
        key = text if isinstance(text, str) else tuple(text)
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in self._cached(key).items()}

    @classmethod
    def install(cls, preprocessor: Any) -> list[TokenCache]:
        from lerobot.processor import TokenizerProcessorStep

        return [cls(step) for step in preprocessor.steps if isinstance(step, TokenizerProcessorStep)]
