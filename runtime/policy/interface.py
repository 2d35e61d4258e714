"""The ``Policy`` interface every served model implements.

Serving splits a flow-matching policy at the seams that matter for
parallelism: ``prepare`` validates and preprocesses on the replica driver
*before* anything is sent to other ranks (a bad request must never reach a
collective); ``condition`` + ``denoise_step`` are the only per-CFG-branch work,
so with ``cfgp=2`` each rank runs one branch; ``postprocess`` runs on the
output rank only.  A real model plugs in by import path
(``--policy pkg.module:Class``) and implements the same methods.

Everything after ``prepare`` works on a *batch*: the replica collates the
prepared samples of the requests it runs together (``collate``), and
``condition``, ``denoise_step`` and ``postprocess_batch`` see one row per
request.  Rows never interact (no op mixes the batch dimension), which is
what makes a request's actions the same, up to floating-point reassociation,
whichever batch it ran in.
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import torch


class Branch(IntEnum):
    """CFG branch; the value is the cfg index of the rank that computes it under cfgp=2."""

    COND = 0
    UNCOND = 1


ROWS_KEY = "rows"  # Sample.meta of a collated batch: each request's meta


@dataclass
class Sample:
    """A validated request, ready to broadcast: CPU tensors plus small metadata.

    Kept on the CPU so it crosses the gloo control group cheaply and every rank
    moves it to its own device.
    """

    tensors: dict[str, torch.Tensor]  # leading dimension: one row per request (1 after ``prepare``)
    meta: dict[str, Any] = field(default_factory=dict)  # one request's; a collated batch has ``rows``

    @property
    def batch_size(self) -> int:
        return next(iter(self.tensors.values())).shape[0] if self.tensors else len(self.rows())

    def group_key(self) -> Hashable:
        """Samples with equal keys can be collated: same tensor names, per-row shapes and dtypes."""
        return tuple(sorted((name, tuple(t.shape[1:]), t.dtype) for name, t in self.tensors.items()))

    def rows(self) -> list[dict[str, Any]]:
        """Each request's ``meta``, in batch order (a prepared, uncollated sample is one row)."""
        rows = self.meta.get(ROWS_KEY)
        return list(rows) if rows is not None else [self.meta]


def collate(samples: Sequence[Sample]) -> Sample:
    """One batch from samples of one ``group_key``: tensors concatenated row-wise, metas kept per row."""
    if not samples:
        raise ValueError("an empty batch")
    keys = {s.group_key() for s in samples}
    if len(keys) > 1:
        raise ValueError(f"samples of {len(keys)} different shapes cannot share a batch")
    tensors = {name: torch.cat([s.tensors[name] for s in samples]) for name in samples[0].tensors}
    return Sample(tensors, {ROWS_KEY: [row for s in samples for row in s.rows()]})


class Policy(ABC):
    """A flow-matching action policy split for CFG-parallel serving."""

    name: str = "policy"  # steps and guidance are the server's (--steps / --guidance), not the model's

    @classmethod
    @abstractmethod
    def load(cls, checkpoint: str, *, device: torch.device, dtype: torch.dtype) -> Policy:
        """Build the model from a checkpoint directory onto ``device``."""

    @property
    @abstractmethod
    def action_shape(self) -> tuple[int, int]:
        """(horizon, action_dim) of one action chunk."""

    @property
    @abstractmethod
    def device(self) -> torch.device: ...

    @abstractmethod
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        """Validate and preprocess one observation; raise InvalidObservation on bad input."""

    def collate(self, samples: Sequence[Sample]) -> Sample:
        """The batch ``condition`` gets; override when samples of one key still need padding to stack."""
        return collate(samples)

    @abstractmethod
    def condition(self, sample: Sample, branch: Branch) -> torch.Tensor:
        """Context of one CFG branch for each of the batch's rows, computed once per request.

        The unconditional branch must cost the same as the conditional one
        (e.g. learned null tokens of the same length), or cfg ranks wait on
        each other every step.
        """

    @abstractmethod
    def denoise_step(self, context: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """Flow velocity at ``x`` and time ``t`` for a batch of contexts (B rows, or 2B with batched CFG)."""

    @abstractmethod
    def init_noise(self, seed: int) -> torch.Tensor:
        """x at t=1 for one request (batch 1), a deterministic function of ``seed`` on every device and in
        every batch: the sampler stacks one per row."""

    @abstractmethod
    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        """Final x of one request (batch 1) -> float32 actions [horizon, action_dim] (output rank only)."""

    def postprocess_batch(self, x: torch.Tensor) -> list[np.ndarray]:
        """Final x of a batch -> each row's actions; one device-to-host copy, then ``postprocess`` per row."""
        host = x.cpu()
        return [self.postprocess(host[i : i + 1]) for i in range(host.shape[0])]

    def compile(self, mode: str = "default") -> None:  # noqa: B027 - optional: the default compiles nothing
        """Optional speed-up hook (``--compile``), e.g. torch.compile of the denoiser."""

    def metadata(self) -> dict[str, Any]:
        horizon, action_dim = self.action_shape
        return {"policy_name": self.name, "action_horizon": horizon, "action_dim": action_dim}

    def example_observation(self, seed: int = 0) -> dict[str, Any]:
        """A valid observation, used for warm-up and by the bundled client."""
        raise NotImplementedError


def load_policy_class(path: str) -> type[Policy]:
    """Resolve ``pkg.module:Class``; errors name the path so a typo is obvious."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--policy must look like 'pkg.module:Class', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import policy {path!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"{path!r} is not a subclass of {Policy.__module__}.Policy")
    return cls


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}") from None
