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
* Each row's memory is a ``Stream``: its cache for each branch this rank runs
  (per layer ``[1, slots, heads, head_dim]`` keys and values) under one slot
  layout (each slot's id, mask and is-predicted flag), as LeRobot's CFG batch
  shares one;
  the first observation's latent; the streaming VAE's causal cache; the last
  chunk's actions.  The context of a branch is only the rows' indices into the
  running batch's streams and the branch, so batched CFG's concatenation of
  contexts copies nothing; ``denoise`` lends each row's cache to the
  transformer's attention modules for the call (rows whose layouts are equal
  run as one batch), so the cache writes and LeRobot's own evictions land in
  the row's stream, never in the shared module.

A request alone is a first chunk: LeRobot's state after ``reset()`` (the first
observation conditions the chunk, the actions of frame 0 are dropped).  A
session's stream is kept on this rank (``MAX_SESSIONS``, least recently used
first) under the key the ingress tags its requests with (``SESSION_TAG``,
engine/history.py keeps the ledger); its next request carries the observations
recorded while the chunk ran (``keyframes``), which ``condition`` feeds back
with the chunk's actions as LeRobot's ``_compute_kv_cache`` does (its
predictions leave the cache; the keyframes' latents and the executed actions
are written for each branch it keeps) before the chunk runs at the stream's frame
offset and answers all F frames of actions.  Three chunks of a session equal
LeRobot's own ``select_action`` stream (tests/test_lerobot_lingbot_va.py).
Under cfgp=2 each rank keeps its own stream of a session; the unconditional
rank, which runs the guided video steps only, feeds back the actions the robot
received (the ingress's ``SESSION_ACTIONS``, mapped back through the saved
postprocessor's statistics) and replays on its slot layout what the skipped
steps did (``_replay``).
"""

from __future__ import annotations

import string
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.policy.interface import Branch, Context, Integrator
from policy_operator.runtime.policy.lerobot.families import Family
from policy_operator.runtime.policy.session_state import SESSION_ACTIONS, SESSION_TAG

WAN_DIR = "wan"  # the bundled VAE, text encoder and tokenizer (what ``wan_pretrained_path`` names)
CACHE = "pos"  # the transformer's cache name in LeRobot's code
TOKENS_KEY = "lingbot_va.task_tokens"  # the task, tokenized by prepare on the CPU
TOKEN_MASK_KEY = "lingbot_va.task_mask"
LATENT_CHANNELS = 48  # LeRobot draws the latents with 48 channels whatever the config (the Wan2.2 VAE's z_dim)
# Sessions a replica keeps the memory of (the least recently used go first).  At the published size one
# session's caches are LeRobot's whole pool per branch: 30 layers x (keys, values) x 2160 slots x 24 heads x 128
# x 2 bytes = 0.8 GB of bfloat16, twice with guidance on one rank (cfgp=2: once per rank), so 8 sessions hold
# 12.7 GB next to the 5B model.
MAX_SESSIONS = 8


def _clone(value: Any) -> Any:
    return value.clone() if isinstance(value, torch.Tensor) else value


@dataclass
class Stream:
    """One row's memory across its chunks: a request's alone, or its session's (kept by the family).

    ``layout`` is LeRobot's per-slot bookkeeping (ids, mask, is-predicted flags), one for both branches as
    LeRobot's CFG batch shares it; ``kv`` each branch's keys and values per layer ``[1, slots, heads, dim]``."""

    layout: dict[str, torch.Tensor]
    kv: dict[Branch, tuple[tuple[torch.Tensor, torch.Tensor], ...]]
    text: dict[Branch, torch.Tensor]
    first: torch.Tensor | None = None  # the first observation's latent: frame 0 of the first chunk, then fed back
    vae: list[Any] = field(default_factory=list)  # the streaming VAE's causal cache after the stream's last frames
    frame_st_id: int = 0  # latent frames fed back so far (LeRobot's ``_frame_st_id``): 0 during a first chunk
    executed: torch.Tensor | None = None  # the last chunk's actions as LeRobot feeds them back (the output rank's)
    chunks: int = 0  # chunks run
    replay: bool = False  # cfgp=2's unconditional rank skipped its last chunk's unguided steps (``_replay``)

    def copy(self) -> Stream:
        return Stream(
            {k: v.clone() for k, v in self.layout.items()},
            {b: tuple((k.clone(), v.clone()) for k, v in layers) for b, layers in self.kv.items()},
            dict(self.text),
            _clone(self.first),
            [_clone(v) for v in self.vae],
            self.frame_st_id,
            _clone(self.executed),
            self.chunks,
            self.replay,
        )


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
    references = LEROBOT_FAMILIES["lingbot_va"].references
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
        self.max_sessions = MAX_SESSIONS
        # cfgp=2's unconditional rank feeds back the actions its robot received (the ingress's SESSION_ACTIONS),
        # mapped back through the checkpoint's own statistics (``attach`` reads them)
        self._actions_back: Any = None
        self.cfgp2_unsupported: str | None = (
            "this LingBot-VA checkpoint's postprocessor is not one action unnormalizer, so the answered actions "
            "cfgp=2's unconditional rank feeds back cannot be mapped back: it continues a session with cfgp=1 only"
        )
        self._sessions: OrderedDict[int, Stream] = OrderedDict()  # session key -> its stream, on this rank
        self._batch: list[Stream] = []  # the running batch's rows (``denoise`` and ``finish`` read them)
        self._pending = False  # ``condition`` made this batch's streams; ``unconditional`` takes them

    def attach(self, root: Path) -> None:
        """The inverse of the checkpoint's saved action unnormalizer (LingBot-VA's postprocessor: QUANTILES with
        the statistics it saved), for cfgp=2's unconditional rank: the same step class built from the saved
        postprocessor's config and statistics (data only, no code), run forward as policy.py's
        ``actions_to_model`` runs it for real-time chunking."""
        import json

        from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
        from lerobot.processor import UnnormalizerProcessorStep
        from safetensors.torch import load_file

        from policy_operator.runtime.checkpoint.trusted_steps import POSTPROCESSOR_JSON

        try:
            saved = json.loads((root / POSTPROCESSOR_JSON).read_text())
            steps = [s for s in saved.get("steps", []) if s.get("registry_name") == "unnormalizer_processor"]
            if len(steps) != 1 or Path(str(steps[0].get("state_file"))).name != steps[0].get("state_file"):
                return  # none, several, or a state file outside the checkpoint's own directory
            config = steps[0]["config"]
            back = UnnormalizerProcessorStep(
                features={
                    k: PolicyFeature(FeatureType[v["type"]], tuple(v["shape"])) for k, v in config["features"].items()
                },
                norm_map={FeatureType[k]: NormalizationMode[v] for k, v in config["norm_map"].items()},
                eps=float(config.get("eps", 1e-8)),
            )
            back.load_state_dict(load_file(str(root / steps[0]["state_file"])))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return
        self._actions_back, self.cfgp2_unsupported = back, None

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

    # --- each row's stream: a request's own, or its session's -------------------------------------------
    def keyframes(self, chunk: int) -> int:
        """The observations LeRobot's ``select_action`` buffers while chunk ``chunk - 1`` runs: one every
        ``max(1, action_per_frame // 4)`` actions of each frame, over F - 1 frames after a first chunk, F after."""
        cfg = self.config
        apf = int(cfg.action_per_frame)
        frames = int(cfg.frame_chunk_size) - (1 if chunk == 1 else 0)
        return frames * (apf // max(1, apf // 4))

    def _pool(self, session: bool) -> int:
        """A session's cache holds LeRobot's whole pool (``attn_window // 2`` chunks of latent and action tokens,
        the oldest evicted first, as its ``allocate_slots`` does); a request alone needs its first chunk's slots."""
        if not session:
            return self.slots
        f, apf = int(self.config.frame_chunk_size), int(self.config.action_per_frame)
        return (int(self.config.attn_window) // 2) * (self.latent_tokens + f * apf)

    def _empty(self, slots: int, device: torch.device) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
        """One branch's empty cache: per layer keys and values ``[1, slots, heads, head_dim]``."""
        transformer = self.policy.transformer
        shape = (1, slots, transformer.num_attention_heads, transformer.attention_head_dim)
        return tuple(
            (
                torch.zeros(shape, dtype=self.policy.dtype, device=device),
                torch.zeros(shape, dtype=self.policy.dtype, device=device),
            )
            for _ in transformer.blocks
        )

    def _new_stream(self, text: torch.Tensor | None, session: bool, device: torch.device, branch: Branch) -> Stream:
        """A stream with ``branch``'s cache (the other one's is added when this rank runs it too)."""
        slots = self._pool(session)
        layout = {
            "id": torch.full((slots,), -1, dtype=torch.long, device=device),
            "mask": torch.zeros((slots,), dtype=torch.bool, device=device),
            "is_pred": torch.zeros((slots,), dtype=torch.bool, device=device),
        }
        texts = {Branch.UNCOND: self._negative_text(device)}
        if text is not None:
            texts[Branch.COND] = text
        return Stream(layout, {branch: self._empty(slots, device)}, texts)

    def _encode(self, stream: Stream, frames: list[dict[str, torch.Tensor]], *, fresh: bool) -> torch.Tensor:
        """``frames`` encoded by LeRobot's own ``_encode_frames`` through the streaming VAE holding ``stream``'s
        causal cache (a fresh one for a first observation), which it keeps for the stream's next frames."""
        vae = self.policy._frozen["streaming_vae"]  # noqa: SLF001
        if fresh:
            vae.clear_cache()
        else:
            vae.feat_cache = stream.vae
        try:
            return self.policy._encode_frames(frames).to(self.policy.dtype)  # noqa: SLF001
        finally:
            stream.vae = vae.feat_cache
            vae.clear_cache()

    def _rows(self, batch: Mapping[str, torch.Tensor], *, alone: bool = False) -> list[Stream]:
        """Each row's stream: a first chunk's new one (kept as its session's when the row is tagged), or a
        continuation's session stream with the keyframes and last chunk's actions fed back into its cache.
        ``alone``: cfgp=2's unconditional rank (no conditional text for a request alone; a session's stream
        replays the steps it skips).  Every row is checked before any state changes, so a refused batch leaves
        every session as it was."""
        cams = self.config.obs_cam_keys
        rows = batch[cams[0]].shape[0]
        continuing = batch[cams[0]].dim() == 5  # [B, K, C, H, W]: the keyframes of a continuation
        tags = batch.get(SESSION_TAG)
        keys: list[tuple[int, int] | None] = [
            None if tags is None else (int(tags[r, 0]), int(tags[r, 1])) for r in range(rows)
        ]
        if continuing:
            self._check(keys)
        tokens = batch[TOKENS_KEY] if batch[TOKENS_KEY].dim() == 2 else batch[TOKENS_KEY][:, -1]
        masks = batch[TOKEN_MASK_KEY] if batch[TOKEN_MASK_KEY].dim() == 2 else batch[TOKEN_MASK_KEY][:, -1]
        out: list[Stream] = []
        done: dict[int, Stream] = {}  # a session's stream before this batch, for a padded copy of its row
        for r, key in enumerate(keys):
            if not continuing:
                text = None if alone else self._embed(tokens[r : r + 1], masks[r : r + 1])
                branch = Branch.UNCOND if alone else Branch.COND
                stream = self._new_stream(text, key is not None, tokens.device, branch)
                stream.first = self._encode(stream, [{k: batch[k][r : r + 1] for k in cams}], fresh=True)
                stream.chunks, stream.replay = 1, alone
                if key is not None and key[0] not in done:
                    self._keep(key[0], stream)
                    done[key[0]] = stream
                out.append(stream)
                continue
            assert key is not None
            if key[0] in done:  # a bucket's padding repeats the last row: it runs on a copy, never stored
                stream = done[key[0]].copy()
            else:
                stream = self._sessions[key[0]]
                self._sessions.move_to_end(key[0])
                if keys.count(key) > 1:
                    done[key[0]] = stream.copy()
            frames = [{k: batch[k][r : r + 1, j] for k in cams} for j in range(batch[cams[0]].shape[1])]
            if stream.replay:
                self._replay(stream.layout)
            if stream.executed is None:  # cfgp=2's unconditional rank: the actions the robot received
                stream.executed = self._answered(batch[SESSION_ACTIONS][r])
            self._feed_back(stream, self._encode(stream, frames, fresh=False))
            stream.executed, stream.chunks, stream.replay = None if alone else stream.executed, key[1] + 1, alone
            out.append(stream)
        return out

    def _check(self, keys: list[tuple[int, int] | None]) -> None:
        """Every continuation row's session has the state of the chunk its tag names, on this rank."""
        for key in keys:
            if key is None:
                raise ValueError("LingBot-VA keyframes arrived without a session tag (the ingress adds it)")
            stream = self._sessions.get(key[0])
            if stream is None or stream.chunks != key[1]:
                self._sessions.pop(key[0], None)
                raise ValueError(
                    f"LingBot-VA has no state of chunk {key[1]} for this session on this replica "
                    f"({'none' if stream is None else f'it ran {stream.chunks} chunks'}); the session must start "
                    "again with a first chunk"
                )

    def _answered(self, actions: torch.Tensor) -> torch.Tensor:
        """A chunk's answer ``[h, used]`` back in LeRobot's feedback layout ``[1, action_dim, F, apf, 1]``: the
        postprocessor's statistics undone, then ``finish`` (a first chunk's frame 0 and the unused channels
        zeros).  Exact up to the statistics' float rounding (about 1e-7)."""
        f, apf = int(self.config.frame_chunk_size), int(self.config.action_per_frame)
        frames = actions.shape[0] // apf
        assert self._actions_back is not None, "the ingress refuses continuations under cfgp2_unsupported"
        actions = self._actions_back._normalize_action(actions[None].float().cpu(), inverse=False)[0]  # noqa: SLF001
        full = torch.zeros(self.action_shape, dtype=self.policy.dtype, device=actions.device)
        used = torch.as_tensor(self.config.used_action_channel_ids, device=actions.device)
        full[0, used, f - frames :, :, 0] = actions.t().reshape(len(used), frames, apf).to(full.dtype)
        return full

    def _replay(self, layout: dict[str, torch.Tensor]) -> None:
        """What the unguided steps of the last chunk did to the slot layout on the conditional rank, done here
        without computing them: the cache write (the clean latents' slots, kept as predictions), then each action
        step's slots (allocated, evicting the oldest when full, and freed), as LeRobot's ``update_cache``."""
        self._allocate(layout, self.latent_tokens, keep=True)
        for _ in range(int(self.config.action_num_inference_steps)):
            self._allocate(layout, int(self.config.frame_chunk_size) * int(self.config.action_per_frame), keep=False)

    @staticmethod
    def _allocate(layout: dict[str, torch.Tensor], size: int, *, keep: bool) -> None:
        """LeRobot's ``WanAttention.allocate_slots`` + ``update_cache`` (+ ``restore_cache`` unless ``keep``) on
        the layout alone: the same tensors, the same ops."""
        mask, ids = layout["mask"], layout["id"]
        free = (~mask).nonzero(as_tuple=False).squeeze(-1)
        if free.numel() < size:
            used = mask.nonzero(as_tuple=False).squeeze(-1)
            to_free = used[torch.argsort(ids[used])[: size - free.numel()]]
            mask[to_free] = False
            ids[to_free] = -1
            free = (~mask).nonzero(as_tuple=False).squeeze(-1)
        slots = free[:size]
        new_id = ids[mask].max() + 1 if mask.any() else torch.tensor(0, device=ids.device, dtype=ids.dtype)
        mask[slots] = True
        ids[slots] = new_id
        layout["is_pred"][slots] = True
        if not keep:
            mask[slots] = False

    def _keep(self, key: int, stream: Stream) -> None:
        self._sessions.pop(key, None)  # a session's new first chunk starts its episode afresh
        self._sessions[key] = stream
        while len(self._sessions) > self.max_sessions:
            self._sessions.popitem(last=False)

    def _feed_back(self, stream: Stream, latents: torch.Tensor) -> None:
        """LeRobot's ``_compute_kv_cache``: its predictions leave the cache, then the observed keyframes' latents
        (after the first observation's, the first time) and the actions executed are written into the caches of
        the branches this rank runs, as one batch (two on one rank with CFG, as LeRobot's CFG batch writes them;
        one under cfgp=2 or without guidance)."""
        from lerobot.policies.lingbot_va.utils import get_mesh_id

        p = self.config.patch_size
        layout = stream.layout
        layout["mask"][layout["is_pred"]] = False
        if stream.frame_st_id == 0:
            assert stream.first is not None
            latents = torch.cat([stream.first, latents], dim=2)
        assert stream.executed is not None
        actions = stream.executed.to(latents)
        actions[:, ~self.policy._action_mask] *= 0  # noqa: SLF001
        device = latents.device
        rows = [(stream, branch) for branch in (Branch.COND, Branch.UNCOND) if branch in stream.kv]
        n = len(rows)
        grid = get_mesh_id(
            latents.shape[-3] // p[0], latents.shape[-2] // p[1], latents.shape[-1] // p[2], 0, 1, stream.frame_st_id
        )
        video = {
            "noisy_latents": latents.repeat(n, 1, 1, 1, 1),
            "timesteps": torch.zeros([n, latents.shape[2]], dtype=torch.float32, device=device),
            "grid_id": grid.to(device)[None].repeat(n, 1, 1),
            "text_emb": None,  # each row's branch's (``_forward``)
        }
        grid = get_mesh_id(
            actions.shape[-3], actions.shape[-2], actions.shape[-1], 1, 1, stream.frame_st_id, action=True
        )
        action = {
            "noisy_latents": actions.repeat(n, 1, 1, 1, 1),
            "timesteps": torch.zeros([n, actions.shape[2]], dtype=torch.float32, device=device),
            "grid_id": grid.to(device)[None].repeat(n, 1, 1),
            "text_emb": None,  # each row's branch's (``_forward``)
        }
        self._forward(rows, video, update=2, action=False)
        self._forward(rows, action, update=2, action=True)
        stream.frame_st_id += latents.shape[2]

    def _negative_text(self, device: torch.device) -> torch.Tensor:
        if self._negative is None:  # the empty prompt's embedding, the same for every request
            self._negative = self._embed(*self._tokens(""))
        return self._negative.to(device)

    @staticmethod
    def _context(rows: int, branch: Branch, device: torch.device) -> Context:
        """The rows' indices into this batch's streams and their branch: the streams themselves (caches,
        layouts) stay with this module, so a batched-CFG concatenation of contexts never copies them."""
        return {
            "row": torch.arange(rows, dtype=torch.long, device=device),
            "branch": torch.full((rows,), int(branch), dtype=torch.long, device=device),
        }

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        rows = self._rows(batch)
        self._batch, self._pending = rows, True
        return self._context(len(rows), Branch.COND, batch[TOKENS_KEY].device)

    def unconditional(self, batch: dict[str, torch.Tensor]) -> Context:
        if self._pending:  # one rank runs both branches: the conditional one made this batch's streams
            self._pending = False
            for stream in self._batch:  # a session's first chunk on this rank: its unconditional cache starts
                if Branch.UNCOND not in stream.kv:
                    stream.kv[Branch.UNCOND] = self._empty(stream.layout["mask"].shape[0], stream.layout["mask"].device)
        else:  # cfgp=2's unconditional rank: its branch alone (a session's stream kept on this rank too)
            self._batch = self._rows(batch, alone=True)
        return self._context(len(self._batch), Branch.UNCOND, batch[TOKENS_KEY].device)

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
        who = [
            (self._batch[r], Branch(b))
            for r, b in zip(context["row"].tolist(), context["branch"].tolist(), strict=True)
        ]
        starts = [stream.frame_st_id for stream, _ in who]
        first = torch.tensor([s == 0 for s in starts], device=device)  # a first chunk: frame 0 is the observation
        out = torch.zeros_like(x)
        if i <= video_steps:
            tv = self._two_stage.video_t[i]
            latents = x[:, : self.split].reshape(rows, *self.latent_shape[1:]).clone()
            for r, (stream, _) in enumerate(who):
                if starts[r] == 0:
                    latents[r, :, 0:1] = stream.first[0, :, 0:1]
            times = torch.ones([rows, f], dtype=torch.float32, device=device) * tv
            times[:, 0:1] *= (~first).float()[:, None]
            grids = [get_mesh_id(f // p[0], h // p[1], w // p[2], 0, 1, s).to(device) for s in starts]
            inputs = {"noisy_latents": latents, "timesteps": times, "grid_id": torch.stack(grids), "text_emb": None}
            pred = self._forward(who, inputs, update=1 if i == video_steps else 0, action=False)
            if i < video_steps:
                pred = data_seq_to_patch(p, pred, f, h, w, batch_size=rows)
                out[:, : self.split] = pred.flatten(1).to(x.dtype)
            return out
        j = i - video_steps - 1
        actions = x[:, self.split :].reshape(rows, *self.action_shape[1:]).clone()
        actions[:, :, 0:1] *= (~first).to(actions.dtype)[:, None, None, None, None]  # a first chunk's frame 0: zeros
        times = torch.ones([rows, f], dtype=torch.float32, device=device) * self._two_stage.action_t[j]
        times[:, 0:1] *= (~first).float()[:, None]
        actions[:, ~self.policy._action_mask] *= 0  # noqa: SLF001 - the unused channels, as LeRobot zeroes them
        apf = actions.shape[-2]
        grids = [get_mesh_id(f, apf, 1, 1, 1, s, action=True).to(device) for s in starts]
        inputs = {"noisy_latents": actions, "timesteps": times, "grid_id": torch.stack(grids), "text_emb": None}
        pred = self._forward(who, inputs, update=0, action=True)
        out[:, self.split :] = rearrange(pred, "b (f n) c -> b c f n 1", f=f).flatten(1).to(x.dtype)
        return out

    def _forward(
        self, who: list[tuple[Stream, Branch]], inputs: dict[str, Any], *, update: int, action: bool
    ) -> torch.Tensor:
        """The transformer over ``who``'s rows, each with its stream's cache of its branch lent to the attention
        modules for the call.  LeRobot's cache has one slot layout (mask, ids, is-predicted flags) for its whole
        batch, so rows run together only where their layouts are equal (a request alone and its branches, or
        sessions at the same point); each group's layout, evictions included, goes back to its streams."""
        groups: dict[tuple[Any, ...], list[int]] = {}
        for r, (stream, _) in enumerate(who):
            layout = stream.layout
            key = (
                stream.frame_st_id,
                layout["mask"].shape[0],
                torch.cat([layout["id"], layout["mask"].long(), layout["is_pred"].long()]).cpu().numpy().tobytes(),
            )
            groups.setdefault(key, []).append(r)
        preds: list[torch.Tensor | None] = [None] * len(who)
        for members in groups.values():
            text = torch.cat([who[r][0].text[who[r][1]] for r in members])
            part = {k: (text if k == "text_emb" else v[members]) for k, v in inputs.items()}
            pred = self._run([who[r] for r in members], part, update=update, action=action)
            for n, r in enumerate(members):
                preds[r] = pred[n : n + 1]
        return torch.cat([pred for pred in preds if pred is not None])

    def _run(
        self, who: list[tuple[Stream, Branch]], inputs: dict[str, Any], *, update: int, action: bool
    ) -> torch.Tensor:
        transformer = self.policy.transformer
        layout = who[0][0].layout
        alone = len(who) == 1
        lent = []
        for n, block in enumerate(transformer.blocks):
            keys = [stream.kv[branch][n][0] for stream, branch in who]
            values = [stream.kv[branch][n][1] for stream, branch in who]
            cache = {
                "k": keys[0] if alone else torch.cat(keys),
                "v": values[0] if alone else torch.cat(values),
                "id": layout["id"].clone(),
                "mask": layout["mask"].clone(),
                "is_pred": layout["is_pred"].clone(),
            }
            block.attn1.attn_caches[CACHE] = cache
            lent.append(cache)
        try:
            pred = transformer(inputs, update_cache=update, cache_name=CACHE, action_mode=action)
        finally:
            for block in transformer.blocks:
                block.attn1.attn_caches[CACHE] = None
        for stream, _ in who:  # every layer allocated the same slots: the layout, evictions included, persists
            for name in ("id", "mask", "is_pred"):
                stream.layout[name].copy_(lent[0][name])
        if update and not alone:  # what the call wrote stays in each row's own cache
            for n, cache in enumerate(lent):
                for m, (stream, branch) in enumerate(who):
                    stream.kv[branch][n][0].copy_(cache["k"][m : m + 1])
                    stream.kv[branch][n][1].copy_(cache["v"][m : m + 1])
        return pred

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        """The chunk LeRobot returns (a first chunk drops frame 0, the observation's own); each session keeps
        the chunk's actions as LeRobot keeps them for its next feedback (frame 0's zeros, unused channels zeroed)."""
        actions = x[:, self.split :].reshape(x.shape[0], *self.action_shape[1:])
        first = self._batch[0].frame_st_id == 0
        for r, stream in enumerate(self._batch[: x.shape[0]]):
            kept = actions[r : r + 1].clone().to(self.policy.dtype)
            if first:
                kept[:, :, 0:1] = 0
            kept[:, ~self.policy._action_mask] *= 0  # noqa: SLF001
            stream.executed = kept
        a = actions[:, self.config.used_action_channel_ids]
        if first:
            a = a[:, :, 1:]
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
                "action_per_frame": 4,  # every observation a keyframe; 4 of them encode to one latent frame
                "frame_chunk_size": 2,
                "attn_window": 4,
                "num_inference_steps": 3,
                "action_num_inference_steps": 4,
            }
            if tiny
            else {}
        ),
    )
