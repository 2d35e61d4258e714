"""LingBot-VA (LeRobot ``lingbot_va``): a video-action world model whose video denoising runs classifier-free guidance.

The family's whole serving split and its offline tiny config live in this one
module (docs/runtime.md, "Adding a LeRobot family", uses it as the worked
example).  LeRobot's ``predict_action_chunk`` runs one autoregressive chunk in
two stages on one Wan2.2 dual-stream transformer: ``num_inference_steps``
video-latent steps, guided by ``guidance_scale`` (5.0 published) with the
empty prompt as the unconditional branch, then one more video pass at t=0 that
writes the clean latents into the transformer's KV cache, then
``action_num_inference_steps`` action steps that attend to that cache, guided by
``action_guidance_scale`` (1.0 published: unguided).  The server runs the same
steps as one trajectory through its own sampler, so the guidance goes through
its CFG path (sequential, batched, or cfgp=2 with one branch per rank):

* ``x`` is one row per request: the video latents ``[48, F, h, w]`` and the
  actions ``[action_dim, F, action_per_frame, 1]`` flattened side by side, drawn
  as LeRobot draws them (latents first, then actions, in the model's dtype).
* Step ``i`` of the integrator (``TwoStage``) is the video stage for
  ``i < num_inference_steps``, the cache write at ``i == num_inference_steps``,
  and the action stage after; ``denoise`` answers each stage's velocity in its
  own slice (zeros elsewhere) and ``TwoStage.step`` applies LeRobot's own
  ``FlowMatchScheduler`` of that stage to that slice only.
* ``guided_steps`` marks the video steps guided; the cache write and the
  action steps run the conditional branch alone (what LeRobot keeps of its
  batch-2 forward there), so under cfgp=2 only the conditional rank writes
  and reads the cache.
* The context of a branch is its prompt embedding (the task's, or the empty
  prompt's), the request's first-frame latent and an empty KV cache of the
  transformer's own layout, row-major like every other context: per layer
  ``[B, slots, heads, head_dim]`` keys and values, and each slot's mask, id and
  is-predicted flag per row.  ``denoise`` lends those tensors to the
  transformer's attention modules for the one call, so the cache write lands
  in this request's context, never in the shared module.

Every request is a first chunk: LeRobot's state after ``reset()`` (the first
observation conditions the chunk, the actions of frame 0 are dropped).  Later
chunks of LeRobot's stream also feed back the frames observed while the
previous chunk ran and the actions executed, through the same cache; serving
those needs the session to own the cache and the robot to send those frames,
which this module does not do yet (docs/runtime.md says so).
"""

from __future__ import annotations

import string
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from policy_operator.runtime.policy.interface import Context, Integrator
from policy_operator.runtime.policy.lerobot.families import Family

WAN_DIR = "wan"  # the bundled VAE, text encoder and tokenizer (what ``wan_pretrained_path`` names)
CACHE = "pos"  # the transformer's cache name in LeRobot's code
TOKENS_KEY = "lingbot_va.task_tokens"  # the task, tokenized by prepare on the CPU
TOKEN_MASK_KEY = "lingbot_va.task_mask"
LATENT_CHANNELS = 48  # LeRobot draws the latents with 48 channels whatever the config (the Wan2.2 VAE's z_dim)


class TwoStage(Integrator):
    """The video stage's scheduler steps, the cache write, then the action stage's, on their slices of ``x``.

    ``timesteps`` holds the step indices (``denoise`` reads its stage from them); ``step`` runs LeRobot's
    ``FlowMatchScheduler.step`` itself (``x + v * (sigma_next - sigma)``) so the arithmetic is its own.
    """

    def __init__(self, video: Any, action: Any, video_steps: int, action_steps: int, split: int) -> None:
        import torch.nn.functional as F  # noqa: N812

        video.set_timesteps(video_steps)
        action.set_timesteps(action_steps)
        self.video, self.action, self.split = video, action, split
        self.video_t = F.pad(video.timesteps, (0, 1), mode="constant", value=0)  # its last entry: the cache write
        self.action_t = action.timesteps  # LeRobot's own last action pass (t=0) only writes a cache it clears
        self.video_steps = video_steps
        self.timesteps = tuple(float(i) for i in range(video_steps + 1 + action_steps))

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        if i == self.video_steps:  # the cache write: x stays
            return x
        x = x.clone()
        if i < self.video_steps:
            x[:, : self.split] = self.video.step(out[:, : self.split], self.video_t[i], x[:, : self.split])
        else:
            j = i - self.video_steps - 1
            x[:, self.split :] = self.action.step(out[:, self.split :], self.action_t[j], x[:, self.split :])
        return x


class LingBotVA(Family):
    has_unconditional = True
    references = ("wan_pretrained_path",)
    compile_prefix = False  # condition runs the streaming VAE (a Python list of cached features) row by row

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        cfg = self.config
        if float(cfg.action_guidance_scale) > 1:
            raise ValueError(
                f"LingBot-VA with action_guidance_scale {cfg.action_guidance_scale:g}: the server guides the video "
                "stage only (guidance_scale); serve a checkpoint whose action_guidance_scale is 1.0 (published)"
            )
        if cfg.camera_layout != "width_concat" or int(cfg.video_exec_step) != -1:
            raise ValueError("LingBot-VA is served with camera_layout width_concat and video_exec_step -1 only")
        policy._ensure_frozen_modules()  # noqa: SLF001 - the VAE, text encoder and tokenizer, loaded once
        self.default_guidance = float(cfg.guidance_scale)
        self.noise_dtype = policy.dtype  # the transformer's (the config's), whatever the serving dtype
        self.latent_hw = policy._latent_hw  # noqa: SLF001
        h, w = self.latent_hw
        f = int(cfg.frame_chunk_size)
        self.latent_shape = (1, LATENT_CHANNELS, f, h, w)
        self.action_shape = (1, int(cfg.action_dim), f, int(cfg.action_per_frame), 1)
        self.split = LATENT_CHANNELS * f * h * w
        p = cfg.patch_size
        self.latent_tokens = (f * h * w) // (p[0] * p[1] * p[2])
        # A first chunk holds the clean latents' keys (the cache write) and one step's own keys at a time (each
        # step writes them into free slots and frees them again): LeRobot's pool is attn_window // 2 chunks deep
        # for its stream, but its first chunk uses these slots, in this order, and no more.
        self.slots = self.latent_tokens + max(self.latent_tokens, f * int(cfg.action_per_frame))
        self._negative: torch.Tensor | None = None
        self._two_stage = self._schedules()

    # --- shapes and steps --------------------------------------------------------
    @property
    def action_dim(self) -> int:
        return len(self.config.used_action_channel_ids)

    @property
    def chunk(self) -> int:  # frame 0 conditions the first chunk: its actions are dropped, as LeRobot drops them
        return (int(self.config.frame_chunk_size) - 1) * int(self.config.action_per_frame)

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (1, self.split + int(torch.Size(self.action_shape).numel()))

    def draw_noise(self, generator: torch.Generator) -> torch.Tensor:
        dtype = self.policy.dtype
        latents = torch.randn(self.latent_shape, generator=generator, dtype=dtype)
        actions = torch.randn(self.action_shape, generator=generator, dtype=dtype)
        return torch.cat([latents.flatten(1), actions.flatten(1)], dim=1)

    @property
    def default_steps(self) -> int:
        return int(self.config.num_inference_steps) + 1 + int(self.config.action_num_inference_steps)

    def integrator(self, steps: int) -> Integrator:
        if steps != self.default_steps:
            raise ValueError(
                f"LingBot-VA runs num_inference_steps + 1 + action_num_inference_steps = {self.default_steps} "
                f"model calls (its checkpoint's config sets them), got steps={steps}; leave --steps unset"
            )
        return self._two_stage

    def _schedules(self) -> TwoStage:
        from lerobot.policies.lingbot_va.utils import FlowMatchScheduler

        cfg = self.config
        return TwoStage(
            FlowMatchScheduler(shift=cfg.snr_shift, sigma_min=0.0, extra_one_step=True),
            FlowMatchScheduler(shift=cfg.action_snr_shift, sigma_min=0.0, extra_one_step=True),
            int(cfg.num_inference_steps),
            int(cfg.action_num_inference_steps),
            self.split,
        )

    def guided_steps(self, steps: int) -> tuple[bool, ...]:
        video = int(self.config.num_inference_steps)
        return tuple(i < video for i in range(steps))

    # --- conditioning ---------------------------------------------------------------
    def sample_tensors(self, batch: Mapping[str, Any]) -> dict[str, torch.Tensor]:
        """The task tokenized on the CPU as ``_get_t5_prompt_embeds`` tokenizes it (the text encoder runs in
        ``condition``)."""
        task = batch.get("task")
        prompt = task[0] if isinstance(task, list | tuple) else task
        ids, mask = self._tokens(prompt or "")
        return {TOKENS_KEY: ids, TOKEN_MASK_KEY: mask}

    def _tokens(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        from lerobot.policies.lingbot_va.utils import clean_prompt

        tokens = self.policy._frozen["tokenizer"](  # noqa: SLF001
            [clean_prompt(prompt)],
            padding="max_length",
            max_length=int(self.config.max_sequence_length),
            truncation=True,
            add_special_tokens=True,
            return_attention_mask=True,
            return_tensors="pt",
        )
        return tokens.input_ids, tokens.attention_mask

    def _embed(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """One prompt's UMT5 embedding, trimmed to its length and zero-padded, as ``_get_t5_prompt_embeds``."""
        encoder = self.policy._frozen["text_encoder"]  # noqa: SLF001
        device = next(encoder.parameters()).device
        embeds = encoder(ids.to(device), mask.to(device)).last_hidden_state
        embeds = embeds.to(dtype=self.policy.dtype, device=self.config.device)
        length = int(mask.gt(0).sum())
        row = embeds[0, :length]
        return torch.cat([row, row.new_zeros(ids.shape[1] - length, row.shape[1])])[None]

    def _first_latent(self, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Each row's first-frame latent, encoded alone by a fresh streaming VAE, as the first chunk is."""
        policy = self.policy
        rows = []
        for r in range(next(iter(batch.values())).shape[0]):
            policy._frozen["streaming_vae"].clear_cache()  # noqa: SLF001
            rows.append(policy._encode_frames([{k: batch[k][r : r + 1] for k in self.config.obs_cam_keys}]))  # noqa: SLF001
        return torch.cat(rows).to(policy.dtype)

    def _context(self, text: torch.Tensor, first: torch.Tensor) -> Context:
        transformer = self.policy.transformer
        rows = text.shape[0]
        shape = (rows, self.slots, transformer.num_attention_heads, transformer.attention_head_dim)
        layers = tuple(
            (
                torch.zeros(shape, dtype=self.policy.dtype, device=text.device),
                torch.zeros(shape, dtype=self.policy.dtype, device=text.device),
            )
            for _ in transformer.blocks
        )
        return {
            "text": text,
            "first": first,
            "kv": layers,
            "id": torch.full((rows, self.slots), -1, dtype=torch.long, device=text.device),
            "mask": torch.zeros((rows, self.slots), dtype=torch.bool, device=text.device),
            "is_pred": torch.zeros((rows, self.slots), dtype=torch.bool, device=text.device),
        }

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        text = torch.cat(
            [
                self._embed(batch[TOKENS_KEY][r : r + 1], batch[TOKEN_MASK_KEY][r : r + 1])
                for r in range(batch[TOKENS_KEY].shape[0])
            ]
        )
        return self._context(text, self._first_latent(batch))

    def unconditional(self, batch: dict[str, torch.Tensor]) -> Context:
        if self._negative is None:  # the empty prompt's embedding, the same for every request
            self._negative = self._embed(*self._tokens(""))
        rows = batch[TOKENS_KEY].shape[0]
        return self._context(self._negative.expand(rows, -1, -1).clone(), self._first_latent(batch))

    # --- one model call ---------------------------------------------------------------
    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        from einops import rearrange
        from lerobot.policies.lingbot_va.utils import data_seq_to_patch, get_mesh_id

        cfg = self.config
        i = int(t[0])
        video_steps = int(cfg.num_inference_steps)
        rows = x.shape[0]
        f, (h, w), p = int(cfg.frame_chunk_size), self.latent_hw, cfg.patch_size
        device = x.device
        out = torch.zeros_like(x)
        if i <= video_steps:
            tv = self._two_stage.video_t[i]
            latents = x[:, : self.split].reshape(rows, *self.latent_shape[1:]).clone()
            latents[:, :, 0:1] = context["first"][:, :, 0:1]
            times = torch.ones([f], dtype=torch.float32, device=device) * tv
            times[0:1] *= 0
            grid = get_mesh_id(latents.shape[-3] // p[0], latents.shape[-2] // p[1], latents.shape[-1] // p[2], 0, 1, 0)
            inputs = {
                "noisy_latents": latents,
                "timesteps": times[None].repeat(rows, 1),
                "grid_id": grid.to(device)[None].repeat(rows, 1, 1),
                "text_emb": context["text"],
            }
            pred = self._forward(context, inputs, update=1 if i == video_steps else 0, action=False)
            if i < video_steps:
                pred = data_seq_to_patch(p, pred, f, h, w, batch_size=rows)
                out[:, : self.split] = pred.flatten(1).to(x.dtype)
            return out
        j = i - video_steps - 1
        actions = x[:, self.split :].reshape(rows, *self.action_shape[1:]).clone()
        actions[:, :, 0:1] = 0  # frame 0's actions: the zero condition of a first chunk
        times = torch.ones([f], dtype=torch.float32, device=device) * self._two_stage.action_t[j]
        times[0:1] *= 0
        actions[:, ~self.policy._action_mask] *= 0  # noqa: SLF001 - the unused channels, as LeRobot zeroes them
        grid = get_mesh_id(actions.shape[-3], actions.shape[-2], actions.shape[-1], 1, 1, 0, action=True)
        inputs = {
            "noisy_latents": actions,
            "timesteps": times[None].repeat(rows, 1),
            "grid_id": grid.to(device)[None].repeat(rows, 1, 1),
            "text_emb": context["text"],
        }
        pred = self._forward(context, inputs, update=0, action=True)
        out[:, self.split :] = rearrange(pred, "b (f n) c -> b c f n 1", f=f).flatten(1).to(x.dtype)
        return out

    def _forward(self, context: Context, inputs: dict[str, torch.Tensor], *, update: int, action: bool) -> torch.Tensor:
        """The transformer with ``context``'s cache lent to its attention modules for this call (rows share a slot
        layout: they run in lockstep from the same empty cache, so row 0's mask, ids and flags are every row's)."""
        transformer = self.policy.transformer
        lent = []
        for block, (keys, values) in zip(transformer.blocks, context["kv"], strict=True):
            cache = {
                "k": keys,
                "v": values,
                "id": context["id"][0].clone(),
                "mask": context["mask"][0].clone(),
                "is_pred": context["is_pred"][0].clone(),
            }
            block.attn1.attn_caches[CACHE] = cache
            lent.append(cache)
        try:
            pred = transformer(inputs, update_cache=update, cache_name=CACHE, action_mode=action)
        finally:
            for block in transformer.blocks:
                block.attn1.attn_caches[CACHE] = None
        if update:  # every layer wrote the same slots: keep the slot layout in the context
            for name in ("id", "mask", "is_pred"):
                context[name].copy_(lent[0][name].expand_as(context[name]))
        return pred

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        actions = x[:, self.split :].reshape(x.shape[0], *self.action_shape[1:])
        a = actions[:, self.config.used_action_channel_ids][:, :, 1:]  # drop frame 0, as the first chunk does
        return a.squeeze(-1).flatten(2).transpose(1, 2).contiguous().to(torch.float32)

    def rtc_unsupported(self) -> str | None:
        return (
            "LingBot-VA's actions are denoised after its video stage, by a second flow with its own schedule, "
            "conditioned on a frame-0 action that is not a returned action; real-time chunking's inpainting of "
            "the first actions has no place in that trajectory"
        )

    def cast(self, dtype: torch.dtype) -> None:
        if dtype != self.policy.dtype:
            raise ValueError(
                f"LingBot-VA runs in its checkpoint's dtype ({self.config.dtype}); serve it with --dtype "
                f"{self.config.dtype} (its norms and time embeddings stay float32 as LeRobot builds them)"
            )


FAMILY = LingBotVA


def tiny_config(root: Path, size: str) -> Any:
    """A LingBot-VA config of ``size`` with its frozen parts (a Wan2.2-shaped VAE, a UMT5 encoder, a T5
    tokenizer over a small vocabulary) written under ``root/wan`` with seeded random weights, offline.

    ``base``: the published transformer and VAE (bfloat16); the UMT5-XXL encoder at its published width (the
    transformer's text projection takes it) with 2 of its 24 layers and the small vocabulary."""
    import diffusers
    import transformers
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig

    hub: Any = transformers  # resolved lazily: their stubs lag the classes
    wan_vae: Any = diffusers.AutoencoderKLWan

    tiny = size == "tiny"
    wan = root / WAN_DIR
    generator = torch.Generator().manual_seed(0)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -3.0) for c in string.ascii_lowercase] + [("\u2581" + c, -2.5) for c in string.ascii_lowercase]
    tokenizer = hub.T5TokenizerFast(vocab=pieces, extra_ids=0)
    tokenizer.save_pretrained(wan / "tokenizer")
    text_dim = 32 if tiny else 4096
    wan_vae(
        base_dim=8 if tiny else 160,
        decoder_base_dim=None if tiny else 256,
        z_dim=LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2] if tiny else [1, 2, 4, 4],
        num_res_blocks=1 if tiny else 2,
        temperal_downsample=[False, True, True],
        is_residual=True,
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=(torch.randn(LATENT_CHANNELS, generator=generator) * 0.1).tolist(),
        latents_std=(torch.rand(LATENT_CHANNELS, generator=generator) + 0.5).tolist(),
    ).save_pretrained(wan / "vae")
    hub.UMT5EncoderModel(
        hub.UMT5Config(
            vocab_size=len(tokenizer),
            d_model=text_dim,
            d_kv=8 if tiny else 64,
            d_ff=64 if tiny else 10240,
            num_layers=1 if tiny else 2,  # published: 24; it runs once per request, outside the denoising loop
            num_heads=2 if tiny else 64,
        )
    ).save_pretrained(wan / "text_encoder")
    cameras = ["observation.images.top", "observation.images.wrist"]
    side = 32 if tiny else 128
    inputs = {key: PolicyFeature(FeatureType.VISUAL, (3, side, side)) for key in cameras}
    inputs["observation.state"] = PolicyFeature(FeatureType.STATE, (6,))
    return LingBotVAConfig(
        wan_pretrained_path=WAN_DIR,
        device="cpu",
        dtype="float32" if tiny else "bfloat16",
        obs_cam_keys=cameras,
        height=side,
        width=side,
        text_dim=text_dim,
        max_sequence_length=8 if tiny else 512,
        used_action_channel_ids=list(range(6)),
        input_features=inputs,
        output_features={"action": PolicyFeature(FeatureType.ACTION, (6,))},
        **(
            {
                "num_attention_heads": 2,
                "attention_head_dim": 24,
                "action_dim": 8,
                "freq_dim": 32,
                "ffn_dim": 64,
                "num_layers": 2,
                "action_per_frame": 2,
                "frame_chunk_size": 3,
                "attn_window": 4,
                "num_inference_steps": 3,
                "action_num_inference_steps": 4,
            }
            if tiny
            else {}
        ),
    )
