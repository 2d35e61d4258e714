"""Each LeRobot policy family split at the serving seams: condition once per request, one model call per step.

The flow families (SmolVLA, pi0, pi0.5) condition on the VLM's prefix: the
KV cache of the images, prompt (and, for SmolVLA, state) tokens, computed
once, as their own ``sample_actions`` does before its Euler loop.  The cache
travels as a tree of tensors -- each layer's (keys, values), batch first,
plus the prefix pad mask -- so batching, padding and row slicing work on it,
and ``denoise_step`` rebuilds a transformers ``DynamicCache`` around the same
tensors (no copy) for the action expert's own ``denoise_step``.  Diffusion
Policy conditions on its global conditioning vector (observation encoders
over the last ``n_obs_steps`` observations) and steps its own noise
scheduler (DDIM, or DDPM).  Each family's code up to its loop mirrors the
LeRobot 0.6 policy it wraps line for line; tests/test_lerobot_policies.py
checks the actions against LeRobot's ``predict_action_chunk``.  A flow family's
``unfinish`` inverts ``finish`` so real-time chunking can take returned
actions back into ``x``; Diffusion Policy says why it cannot.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
from abc import ABC, abstractmethod
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.policy.interface import Context, EulerFlow, Integrator
from policy_operator.runtime.policy.lerobot.attention import use_grouped_attention

STATE_KEY = "observation.state"
IMAGES_KEY = "observation.images"  # Diffusion Policy's stacked cameras
TOKENS_KEY = "observation.language.tokens"
TOKEN_MASK_KEY = "observation.language.attention_mask"


class LeRobotEuler(EulerFlow):
    """LeRobot's ``euler_integrate``: t = 1 + i * dt with dt = -1/n (as doubles, fed as float32), x + dt * v."""

    def __init__(self, steps: int) -> None:
        super().__init__(steps)
        self.timesteps = tuple(1.0 + i * self.dt for i in range(steps))


class SchedulerSteps(Integrator):
    """A diffusers noise scheduler's own timesteps and ``step`` (Diffusion Policy's DDIM or DDPM)."""

    time_dtype = torch.long

    def __init__(self, scheduler: Any, steps: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.scheduler = copy.deepcopy(scheduler)  # set_timesteps is state: one copy per step count
        self.scheduler.set_timesteps(steps)
        self._timesteps = self.scheduler.timesteps
        self.timesteps = tuple(float(t) for t in self._timesteps)

    def time(self, i: int, rows: int, device: torch.device) -> torch.Tensor:
        return torch.full((rows,), self._timesteps[i], dtype=torch.long, device=device)

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        return self.scheduler.step(out, self._timesteps[i], x).prev_sample


def kv_tree(cache: Any) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """A transformers cache as each layer's (keys, values), [batch, heads, seq, dim]."""
    return tuple((layer.keys, layer.values) for layer in cache.layers)


def kv_cache(tree: tuple[tuple[torch.Tensor, torch.Tensor], ...]) -> Any:
    """A ``DynamicCache`` holding ``tree``'s tensors themselves (its own ``update`` would copy each of them).

    Its ``update`` concatenates a step's keys into new tensors and rebinds its own layer to them, never
    writing into ``tree``'s: a cache built per step leaves the context as the next step needs it, without the
    clone of every layer LeRobot's ``denoise_step`` makes first."""
    cache = DynamicCache()
    layers: list[Any] = []
    for keys, values in tree:
        layer = DynamicLayer()
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
        layers.append(layer)
    cache.layers = layers
    return cache


class Family(ABC):
    """One policy type's split; ``policy`` is the LeRobot policy (eval, on the serving device)."""

    history = 1
    needs_task = True
    #: Trained with a null condition (``unconditional`` is implemented): the server's CFG runs on it.  The
    #: registry (builtin_policies.LEROBOT_FAMILIES) says the same before torch; a test holds them together.
    has_unconditional = False
    #: The guidance the checkpoint itself runs with (its config's), None: the server's default for the policy.
    default_guidance: float | None = None
    #: Config attributes naming other repositories; loading resolves each against the checkpoint directory.
    references: tuple[str, ...] = ()
    #: The cameras' conversion and normalization may run on the device (policy.py); False when the family's saved
    #: preprocessor transforms images in steps of its own (X-VLA's ImageNet normalization).
    device_preprocessing = True

    @classmethod
    def loading(cls, root: Path) -> contextlib.AbstractContextManager[None]:
        """Entered while LeRobot builds the policy of the checkpoint at ``root`` (GR00T: its bundled backbone, no
        remote code)."""
        return contextlib.nullcontext()

    @classmethod  # noqa: B027 - optional: nothing by default
    def pipelines_loaded(cls, preprocessor: Any, root: Path) -> None:
        """After the saved pipelines loaded: what their steps need from the checkpoint at ``root``."""

    def __init__(self, policy: Any) -> None:
        self.policy = policy
        self.config = policy.config

    def attach(self, root: Path) -> None:  # noqa: B027 - optional: nothing by default
        """Once built on the checkpoint at ``root``: what the family reads from its directory (LingBot-VA: its
        saved action statistics, data only)."""

    @property
    def action_dim(self) -> int:
        return int(self.config.output_features["action"].shape[0])

    def cast(self, dtype: torch.dtype) -> None:
        """The serving dtype: the whole policy by default; a family whose LeRobot code keeps some parts in
        float32 (and casts its activations at their borders) keeps those."""
        self.policy.to(dtype)
        self.dtype = dtype

    dtype = torch.float32  # what ``cast`` made the policy's weights
    #: ``LeRobotPolicy.compile`` compiles ``condition`` (vision tower + VLM prefix) per batch bucket too.  Off
    #: where it was not measured to pay: Diffusion Policy's is a ResNet, not measured.
    compile_prefix = False

    @property
    @abstractmethod
    def chunk(self) -> int:
        """Actions per answer (rows of ``finish``'s output)."""

    @property
    @abstractmethod
    def noise_shape(self) -> tuple[int, ...]:
        """The initial x of one request, as LeRobot draws it (batch 1)."""

    noise_dtype: torch.dtype | None = torch.float32  # None: the model's dtype

    @property
    @abstractmethod
    def default_steps(self) -> int: ...

    @abstractmethod
    def integrator(self, steps: int) -> Integrator: ...

    @abstractmethod
    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        """The context of a batch of preprocessed observations (on the device)."""

    @abstractmethod
    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor: ...

    @abstractmethod
    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """Final x -> the action chunk ``predict_action_chunk`` returns (before the postprocessor)."""

    def rtc_unsupported(self) -> str | None:
        """Why real-time chunking cannot run on this family, or None (then ``unfinish`` is implemented)."""
        return None

    def unconditional(self, batch: dict[str, torch.Tensor]) -> Context:
        """The unconditional branch's context (a family with ``has_unconditional``)."""
        raise ValueError(f"LeRobot policy type {self.config.type!r} has no unconditional branch")

    def guided_steps(self, steps: int) -> tuple[bool, ...] | None:
        """Which steps guidance applies to (None: all)."""
        return None

    def sample_tensors(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """More tensors ``prepare`` adds to a request's sample from the preprocessed frame (e.g. a tokenized
        task the preprocessor leaves a string), so every rank conditions from tensors alone."""
        return {}

    def draw_noise(self, generator: torch.Generator) -> torch.Tensor:
        """The initial x of one request from its seed's generator, as LeRobot draws it."""
        return torch.randn(self.noise_shape, generator=generator)

    def unfinish(self, actions: torch.Tensor) -> torch.Tensor:
        """The inverse of ``finish``: a chunk's first h actions ``[1, h, action_dim]`` -> x's first h rows."""
        raise NotImplementedError


class _Flow(Family):
    @property
    def chunk(self) -> int:
        return int(self.config.chunk_size)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (1, int(self.config.chunk_size), int(self.config.max_action_dim))

    @property
    def default_steps(self) -> int:
        return int(self.config.num_inference_steps)

    def integrator(self, steps: int) -> Integrator:
        return LeRobotEuler(steps)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, :, : self.action_dim]

    def unfinish(self, actions: torch.Tensor) -> torch.Tensor:
        # The padded action dimensions hold zeros in training (``prepare_action``'s pad_vector).
        x = actions.new_zeros((*actions.shape[:-1], int(self.config.max_action_dim)))
        x[..., : actions.shape[-1]] = actions
        return x


class SmolVLA(_Flow):
    #: On an H100 (2 x 480x640, bf16): 5.2 ms at batch 1 compiled against 37.8 ms eager, 16.8 against 63.5 at
    #: batch 8, 90 s to compile each bucket (bench/results/lerobot-h100-round2.md); one graph since
    #: smolvlm_positions.py (before it, nine, and no bucket finished compiling in 200 s)
    compile_prefix = True

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        from policy_operator.runtime.policy.lerobot.smolvlm_positions import mask_free_positions

        # the same positions without a host sync (or a graph break) per camera in the prefix
        mask_free_positions(policy.model.vlm_with_expert.get_vlm_model().vision_model.embeddings)

    @property
    def default_steps(self) -> int:
        return int(self.config.num_steps)

    def cast(self, dtype: torch.dtype) -> None:
        # The VLM and the action expert only, as LeRobot runs the published checkpoint (its SmolVLM loads in
        # bfloat16, each layer casts its input to its weights' dtype); the state, action and time projections
        # stay float32: embed_prefix concatenates the state's embedding with the images' and embed_suffix feeds
        # the float32 noise straight into action_in_proj.
        self.policy.model.vlm_with_expert.to(dtype)

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        from lerobot.policies.common.vla_utils import make_att_2d_masks

        if not self.config.use_cache:
            raise ValueError("SmolVLA with use_cache=False recomputes its prefix every step; serve it with use_cache")
        policy, model = self.policy, self.policy.model
        batch = policy._prepare_batch(batch)
        images, img_masks = policy.prepare_images(batch)
        state = policy.prepare_state(batch)
        prefix_embs, pad_masks, att_masks = model.embed_prefix(
            images, img_masks, batch[TOKENS_KEY], batch[TOKEN_MASK_KEY], state=state
        )
        _, cache = model.vlm_with_expert.forward(
            attention_mask=make_att_2d_masks(pad_masks, att_masks),
            position_ids=torch.cumsum(pad_masks, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            use_cache=True,
        )
        return {"kv": kv_tree(cache), "pad": pad_masks}

    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return self.policy.model.denoise_step(
            prefix_pad_masks=context["pad"], past_key_values=kv_cache(context["kv"]), x_t=x, timestep=t
        )

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        actions = super().finish(x)
        if self.config.adapt_to_pi_aloha:
            actions = self.policy._pi_aloha_encode_actions(actions.clone())
        return actions

    def unfinish(self, actions: torch.Tensor) -> torch.Tensor:
        if self.config.adapt_to_pi_aloha:  # LeRobot's own inverse, which its training applies to the targets
            actions = self.policy._pi_aloha_encode_actions_inv(actions.clone())
        return super().unfinish(actions)


class Pi0(_Flow):
    """pi0: images and prompt in the prefix, the state in the action expert's suffix."""

    compile_prefix = True  # pi0.5 on an H100 (2 x 224², bf16): 11.6 ms at batch 1 compiled, 52 at batch 8
    #: LeRobot's bfloat16 mode keeps the SigLIP tower and its projector float32 (for training: the optimizer
    #: never sees a dtype toggle).  False: they run in the serving dtype too, casting the pixels to the patch
    #: embedding's dtype as SigLIP itself does; the features leave the tower in LeRobot's dtype either way.
    #: pi0.5 on an H100, compiled prefix: 25.5 -> 11.6 ms at batch 1, 135 -> 52 ms at batch 8 (a batch of 8's
    #: products, eager: 135.6 ms with the tower in full float32, 49.5 on TF32, 37.1 in bf16); tiny pi0.5 bf16
    #: against LeRobot fp32: 1.4e-3 of the action scale either way
    float32_vision = False
    #: In reduced precision, the prefix's and the expert's attention without the copies of the shared
    #: key/value head per query head (attention.py).  pi0.5 compiled on an H100: 10 steps 33.3 -> 29.0 ms at
    #: batch 8, 18.9 -> 19.3 ms at batch 1 (inside the 17.7-18.9 ms the shipped steps spread over that session's
    #: calls), the prefix unchanged (bench/results/lerobot-h100-round4.md)
    grouped_attention = True

    def cast(self, dtype: torch.dtype) -> None:
        if dtype == torch.bfloat16:  # LeRobot's own bfloat16 mode (norms float32), the tower as float32_vision says
            paligemma_with_expert = self.policy.model.paligemma_with_expert
            paligemma_with_expert.to_bfloat16_for_selected_params("bfloat16")
            paligemma = paligemma_with_expert.paligemma.model
            if not self.float32_vision:
                paligemma.vision_tower.to(dtype)
                paligemma.multi_modal_projector.to(dtype)
            if self.grouped_attention:
                use_grouped_attention([paligemma.language_model, paligemma_with_expert.gemma_expert.model])
            self.dtype = dtype
        else:
            super().cast(dtype)

    def _prefix(
        self, images: list[torch.Tensor], img_masks: list[torch.Tensor], tokens: torch.Tensor, masks: torch.Tensor
    ) -> dict[str, Any]:
        from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

        model = self.policy.model
        prefix_embs, pad_masks, att_masks = model.embed_prefix(images, img_masks, tokens, masks)
        model.paligemma_with_expert.paligemma.model.language_model.config._attn_implementation = "eager"
        _, cache = model.paligemma_with_expert.forward(
            attention_mask=prepare_attention_masks_4d(make_att_2d_masks(pad_masks, att_masks)),
            position_ids=torch.cumsum(pad_masks, dim=1) - 1,
            past_key_values=None,
            inputs_embeds=[prefix_embs, None],
            use_cache=True,
        )
        return {"kv": kv_tree(cache), "pad": pad_masks}

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        images, img_masks = self.policy._preprocess_images(batch)
        context = self._prefix(images, img_masks, batch[TOKENS_KEY], batch[TOKEN_MASK_KEY])
        context["state"] = self.policy.prepare_state(batch)
        return context

    def _suffix(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(self.policy.model.embed_suffix(context["state"], x, t))

    #: True: LeRobot's own ``denoise_step`` (cloning the prefix cache every step), the baseline
    #: bench/lerobot_kernels.py's ``lerobot-step`` variant measures ``denoise`` against
    lerobot_step = False

    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        """LeRobot's ``denoise_step`` line for line, less its clone of the whole prefix cache (``kv_cache`` builds a
        fresh cache over the context's tensors each step): the same values, four fewer copies per layer per
        step (the clone, and the cache rebuilt from it through ``update``)."""
        from lerobot.policies.common.vla_utils import make_att_2d_masks, prepare_attention_masks_4d

        model = self.policy.model
        if self.lerobot_step:
            state = {"state": context["state"]} if "state" in context else {}
            return model.denoise_step(
                prefix_pad_masks=context["pad"], past_key_values=kv_cache(context["kv"]), x_t=x, timestep=t, **state
            )
        suffix_embs, suffix_pad_masks, suffix_att_masks, adarms_cond = self._suffix(context, x, t)
        prefix_pad_masks = context["pad"]
        suffix_len = suffix_pad_masks.shape[1]
        batch_size, prefix_len = prefix_pad_masks.shape
        prefix_pad_2d_masks = prefix_pad_masks[:, None, :].expand(batch_size, suffix_len, prefix_len)
        suffix_att_2d_masks = make_att_2d_masks(suffix_pad_masks, suffix_att_masks)
        full_att_2d_masks = torch.cat([prefix_pad_2d_masks, suffix_att_2d_masks], dim=2)
        prefix_offsets = torch.sum(prefix_pad_masks, dim=-1)[:, None]
        position_ids = prefix_offsets + torch.cumsum(suffix_pad_masks, dim=1) - 1
        model.paligemma_with_expert.gemma_expert.model.config._attn_implementation = "eager"
        outputs_embeds, _ = model.paligemma_with_expert.forward(
            attention_mask=prepare_attention_masks_4d(full_att_2d_masks),
            position_ids=position_ids,
            past_key_values=kv_cache(context["kv"]),
            inputs_embeds=[None, suffix_embs],
            use_cache=False,
            adarms_cond=[None, adarms_cond],
        )
        suffix_out = outputs_embeds[1][:, -self.config.chunk_size :]
        return model.action_out_proj(suffix_out.to(dtype=torch.float32))


class Pi05(Pi0):
    """pi0.5: the state is discretized into the prompt by the preprocessor; the suffix has none."""

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        images, img_masks = self.policy._preprocess_images(batch)
        return self._prefix(images, img_masks, batch[TOKENS_KEY], batch[TOKEN_MASK_KEY])

    def _suffix(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> tuple[Any, ...]:
        return tuple(self.policy.model.embed_suffix(x, t))


class Diffusion(Family):
    """Diffusion Policy: a U-Net denoiser over the horizon, conditioned on the last ``n_obs_steps`` observations."""

    needs_task = False
    noise_dtype = None

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self.history = int(self.config.n_obs_steps)

    @property
    def chunk(self) -> int:
        return int(self.config.n_action_steps)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (1, int(self.config.horizon), self.action_dim)

    @property
    def default_steps(self) -> int:
        return int(self.policy.diffusion.num_inference_steps)

    def integrator(self, steps: int) -> Integrator:
        return SchedulerSteps(self.policy.diffusion.noise_scheduler, steps)

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        # [B, n_obs_steps, ...]: a history of one arrives without its step dimension
        batch = {
            k: v[:, None] if self.history == 1 and k.startswith("observation.") and k != TOKENS_KEY else v
            for k, v in batch.items()
        }
        if self.config.image_features:  # [B, n_obs_steps, cameras, C, H, W], as predict_action_chunk stacks them
            batch[IMAGES_KEY] = torch.stack([batch[key] for key in self.config.image_features], dim=-4)
        with self._autocast():
            return self.policy.diffusion._prepare_global_conditioning(batch)

    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        with self._autocast():
            return self.policy.diffusion.unet(x, t, global_cond=context).to(x.dtype)

    def cast(self, dtype: torch.dtype) -> None:
        # Autocast, weights kept: LeRobot's U-Net feeds its float32 timestep embedding and the observation
        # encoders' float32 inputs straight into its layers, so cast weights fail there; the noise and the
        # scheduler's update stay float32 as LeRobot's.
        self.dtype = dtype
        self.noise_dtype = torch.float32

    def _autocast(self) -> Any:
        device = next(self.policy.parameters()).device.type
        return torch.autocast(device, dtype=self.dtype, enabled=self.dtype != torch.float32)

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        start = int(self.config.n_obs_steps) - 1
        return x[:, start : start + int(self.config.n_action_steps)]

    def rtc_unsupported(self) -> str | None:
        return (
            f"Diffusion Policy denoises with a {self.config.noise_scheduler_type} noise scheduler, not a flow from "
            "noise at t=1, and real-time chunking's correction is the flow's (SmolVLA, pi0 and pi0.5 do it)"
        )


FAMILIES: Mapping[str, type[Family]] = {"smolvla": SmolVLA, "pi0": Pi0, "pi05": Pi05, "diffusion": Diffusion}


def family_module(kind: str) -> Any:
    """The module of a family added as one module: ``family_<type>.py`` here, with ``FAMILY`` and ``tiny_config``."""
    return importlib.import_module(f"{__package__}.family_{kind}")


def family_class(kind: str) -> type[Family]:
    """A served LeRobot type's split: one of this module's classes, or its own module's ``FAMILY``."""
    if kind in FAMILIES:
        return FAMILIES[kind]
    if kind in LEROBOT_FAMILIES:
        family: type[Family] = family_module(kind).FAMILY
        return family
    raise ValueError(f"LeRobot policy type {kind!r} is not served yet; served types: {sorted(LEROBOT_FAMILIES)}")


def family_of(policy: Any) -> Family:
    return family_class(str(policy.config.type))(policy)
