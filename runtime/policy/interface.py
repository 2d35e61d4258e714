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

What real policies need beyond one context tensor and the server's Euler
loop is declared here too: the context may be any tree of tensors (a KV
cache), the policy owns its integrator and timesteps (``integrator``), says
whether it has an unconditional branch at all (``has_unconditional``), on
which steps guidance applies (``guided_steps``) and how many past
observations of a session it needs (``history``).
"""

from __future__ import annotations

import importlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, Protocol

import numpy as np
import torch
from torch.utils import _pytree as pytree

from policy_operator.builtin_policies import policy_target
from policy_operator.constants import DEFAULT_STEPS


class Branch(IntEnum):
    """CFG branch; the value is the cfg index of the rank that computes it under cfgp=2."""

    COND = 0
    UNCOND = 1


ROWS_KEY = "rows"  # Sample.meta of a collated batch: each request's meta

#: What ``condition`` returns and ``denoise_step`` reads: a tensor, or any tree of them (dicts, tuples, lists;
#: e.g. a KV cache per layer and a pad mask), every tensor with the batch as its dimension 0.
Context = Any


def context_map(fn: Callable[..., torch.Tensor], context: Context, *others: Context) -> Context:
    """``fn`` over every tensor of ``context`` (and the same positions of ``others``), keeping its tree."""
    return pytree.tree_map(fn, context, *others)


def context_cat(contexts: Sequence[Context]) -> Context:
    """Contexts of one tree shape, concatenated row-wise."""
    return context_map(lambda *rows: torch.cat(rows), *contexts)


def context_rows(context: Context, rows: slice) -> Context:
    """The rows ``rows`` of every tensor of ``context``."""
    return context_map(lambda t: t[rows], context)


class Integrator(ABC):
    """How the sampler moves ``x`` from the initial noise to actions, owned by the policy (``Policy.integrator``).

    ``timesteps[i]`` is the time ``denoise_step`` sees at step ``i`` (one per
    row, as a ``time_dtype`` tensor); ``step`` turns that step's output -- a
    velocity, a noise prediction, guided already when CFG runs -- into the
    next ``x``.  A policy trained with its own schedule (LeRobot's Euler from
    t=1 in float32 increments, Diffusion Policy's DDIM) answers exactly as its
    own code only when the server integrates the same way.
    """

    timesteps: tuple[float, ...]
    time_dtype: torch.dtype = torch.float32

    @property
    def steps(self) -> int:
        return len(self.timesteps)

    def time(self, i: int, rows: int, device: torch.device) -> torch.Tensor:
        """Step ``i``'s time for ``rows`` rows."""
        return torch.full((rows,), self.timesteps[i], device=device, dtype=self.time_dtype)

    @abstractmethod
    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        """``x`` after step ``i``, given the (guided) output of ``denoise_step`` at ``x``."""


class EulerFlow(Integrator):
    """Flow matching from noise (t=1) to actions (t=0) in ``steps`` equal Euler steps: ``x + dt * v``."""

    def __init__(self, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.timesteps = tuple(1.0 - i / steps for i in range(steps))
        self.dt = -1.0 / steps

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        return x + self.dt * out


@dataclass(frozen=True)
class GuidanceInterval:
    """The steps guidance applies to, as a fraction of the trajectory: step ``i`` of ``n`` when
    ``start <= i / n < stop`` (``GuidanceInterval(0, 0.25)`` guides the first quarter, as Cosmos3-Edge guides
    its first step of four).  Unguided steps run the conditional branch alone."""

    start: float = 0.0
    stop: float = 1.0

    def guided(self, steps: int) -> tuple[bool, ...]:
        return tuple(self.start <= i / steps < self.stop for i in range(steps))


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


class Preprocessor(Protocol):
    """A policy's ``prepare`` without its model: picklable, so the front-end process (``--frontend process``)
    validates and preprocesses each observation there and the model process only receives tensors."""

    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        """What ``Policy.prepare`` returns for ``obs``, bit for bit; raise InvalidObservation on bad input."""
        ...


class Policy(ABC):
    """A flow-matching (or diffusion) action policy split for CFG-parallel serving."""

    name: str = "policy"
    #: The policy was trained with a null condition, so classifier-free guidance can run: without one, cfgp=2 and
    #: a guidance other than 1.0 are refused (built-ins declare it in policy_operator/builtin_policies.py too,
    #: where ``serve`` reads it before torch; a plug-in's is checked when it loads).
    has_unconditional: bool = True
    #: Steps guidance applies to (None: all); see ``guided_steps``.
    guidance_interval: GuidanceInterval | None = None
    #: How many of a session's observations, latest last, one request needs (Diffusion Policy's ``n_obs_steps``);
    #: the ingress keeps them (runtime/serving/history.py) and ``stack_history`` makes them one sample.
    history: int = 1
    #: --steps when the flag is not given.
    default_steps: int = DEFAULT_STEPS
    #: --guidance when the flag is not given (e.g. a checkpoint's own guidance scale); None: the server's default.
    default_guidance: float | None = None

    @classmethod
    @abstractmethod
    def load(cls, checkpoint: str, *, device: torch.device, dtype: torch.dtype) -> Policy:
        """Build the model from a checkpoint directory onto ``device``."""

    @classmethod  # noqa: B027 - optional: nothing to import by default
    def import_dependencies(cls) -> None:
        """Import what ``load`` needs, before the load is timed: a start's log then tells the imports from the
        weights (LeRobot's imports took 11-15 s on the H100 host, its pi0.5 weights 2.1-2.5 s)."""

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

    def preprocessor(self) -> Preprocessor | None:
        """Optional: ``prepare`` as a picklable object that needs no weights (``Preprocessor``).  Without one (the
        default), a split server (``--frontend process``) decodes in its front-end and prepares in the model
        process, as the inline server does."""
        return None

    def collate(self, samples: Sequence[Sample]) -> Sample:
        """The batch ``condition`` gets; override when samples of one key still need padding to stack."""
        return collate(samples)

    def stack_history(self, samples: Sequence[Sample]) -> Sample:
        """One request from a session's last ``history`` prepared samples, oldest first (fewer observations than
        that are padded with the oldest, as LeRobot's queues are): each tensor stacked on dimension 1."""
        if len(samples) == 1:
            return samples[0]
        tensors = {name: torch.stack([s.tensors[name] for s in samples], dim=1) for name in samples[-1].tensors}
        return Sample(tensors, dict(samples[-1].meta))

    @abstractmethod
    def condition(self, sample: Sample, branch: Branch) -> Context:
        """Context of one CFG branch for each of the batch's rows, computed once per request.

        A tensor or any tree of them, batch first (``Context``).  The
        unconditional branch must cost the same as the conditional one (e.g.
        learned null tokens of the same length), or cfg ranks wait on each
        other every step.
        """

    @abstractmethod
    def denoise_step(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """The model's output at ``x`` and time ``t`` (a velocity for flow matching) for a batch of contexts
        (B rows, or 2B with batched CFG); ``integrator().step`` applies it."""

    def integrator(self, steps: int | None = None) -> Integrator:
        """How ``x`` goes from noise to actions in ``steps`` steps (None: the policy's own number)."""
        return EulerFlow(self.default_steps if steps is None else steps)

    def guided_steps(self, steps: int) -> tuple[bool, ...]:
        """Which of ``steps`` steps are guided when guidance runs; all unless ``guidance_interval`` says otherwise.
        Under cfgp=2 both ranks compute it, and the unconditional rank skips the others (no collective)."""
        if self.guidance_interval is None:
            return (True,) * steps
        return self.guidance_interval.guided(steps)

    @abstractmethod
    def init_noise(self, seed: int) -> torch.Tensor:
        """x at the first step for one request (batch 1), a deterministic function of ``seed`` on every device
        and in every batch: the sampler stacks one per row."""

    @abstractmethod
    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        """Final x of one request (batch 1) -> float32 actions [horizon, action_dim] (output rank only)."""

    def actions_to_model(self, actions: np.ndarray) -> torch.Tensor:
        """The inverse of ``postprocess``: float32 actions ``[h, action_dim]`` as the server returned them -> the
        model's final ``x`` for those rows (as wide as ``x``; LeRobot's padded dimensions are zeros), float32 on
        the CPU.  Optional; real-time chunking needs it (the
        robot sends back the actions it executes), and a policy without it reports ``rtc`` off in its metadata
        and refuses ``rtc`` requests (``rtc_unsupported``)."""
        raise NotImplementedError

    def postprocess_batch(self, x: torch.Tensor, sample: Sample | None = None) -> list[np.ndarray]:
        """Final x of a batch -> each row's actions; one device-to-host copy, then ``postprocess`` per row.

        ``sample`` is the batch ``condition`` got (its first ``len(x)`` rows are ``x``'s; a bucket may pad it
        with more), for a policy whose actions depend on its request's prepared tensors (LeRobot's actions
        relative to the state); the server always passes it, the default ignores it.
        """
        host = x.cpu()
        return [self.postprocess(host[i : i + 1]) for i in range(host.shape[0])]

    def stage_seconds(self) -> Mapping[str, float]:
        """Optional: the last batch's compute split by stage name (e.g. ``prefix``, ``denoise``,
        ``postprocess``), read once ``postprocess_batch`` returned; /metrics' ``policy_stage_seconds`` shows
        them.  Empty by default."""
        return {}

    def compile(self, mode: str = "default") -> None:  # noqa: B027 - optional: the default compiles nothing
        """Optional speed-up hook (``--compile``), e.g. torch.compile of the denoiser."""

    def metadata(self) -> dict[str, Any]:
        horizon, action_dim = self.action_shape
        return {"policy_name": self.name, "action_horizon": horizon, "action_dim": action_dim}

    def example_observation(self, seed: int = 0) -> dict[str, Any]:
        """A valid observation, used for warm-up and by the bundled client."""
        raise NotImplementedError


def load_policy_class(policy: str) -> type[Policy]:
    """Resolve a built-in name or ``pkg.module:Class``; errors name the path so a typo is obvious."""
    path = policy_target(policy)
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"--policy must be a built-in name or look like 'pkg.module:Class', got {path!r}")
    try:
        cls = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot import policy {path!r}: {exc}") from exc
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise ValueError(f"{path!r} is not a subclass of {Policy.__module__}.Policy")
    return cls


def parse_dtype(name: str) -> torch.dtype:
    table = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    try:
        return table[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; choose one of {sorted(table)}") from None
