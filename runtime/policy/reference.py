"""The reference policy: a small but real flow-matching transformer action model.

Shaped like the action experts of pi0-style policies: a transformer over the
action chunk, conditioned by cross-attention on observation tokens (image
patches of every camera, one proprio-state token, byte-level prompt tokens) and
by adaLN on the flow time.  Classifier-free guidance's unconditional branch
swaps the observation tokens for learned null tokens of the same length, so
both branches cost the same and cfg ranks never wait on each other.
Weights are seeded-random (``policyserver checkpoint init``); the point is the
serving path, not the task.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from policy_operator.constants import CONFIG_FILE, WEIGHTS_FILE
from policy_operator.runtime.checkpoint.format import CheckpointError, write_manifest
from policy_operator.runtime.errors import InvalidObservation
from policy_operator.runtime.policy.interface import Branch, Policy, Sample
from policy_operator.runtime.policy.observation import parse_observation


@dataclass(frozen=True)
class PolicyConfig:
    name: str = "reference-flow-policy"
    horizon: int = 16
    action_dim: int = 8
    width: int = 64
    depth: int = 2
    heads: int = 4
    mlp_ratio: int = 4
    image_size: int = 32
    patch_size: int = 8
    max_cameras: int = 2
    joint_dim: int = 7
    gripper_dim: int = 1
    prompt_tokens: int = 16
    action_mean: list[float] = field(default_factory=list)
    action_std: list[float] = field(default_factory=list)
    # The documented range of every joint and gripper value: a state beyond it (3e38, -1e30...) is refused
    # as invalid_observation instead of overflowing the state projection into NaN actions.
    max_abs_state: float = 1.0e4

    def __post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")
        if self.image_size % self.patch_size:
            raise ValueError(f"image_size {self.image_size} is not divisible by patch_size {self.patch_size}")
        for name in ("action_mean", "action_std"):
            values = getattr(self, name)
            if values and len(values) != self.action_dim:
                raise ValueError(f"{name} has {len(values)} entries, action_dim is {self.action_dim}")

    @property
    def patches_per_camera(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def context_tokens(self) -> int:
        return self.max_cameras * self.patches_per_camera + 1 + self.prompt_tokens

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PolicyConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise CheckpointError(f"{CONFIG_FILE} has unknown fields: {sorted(unknown)}")
        return cls(**data)


SIZES: dict[str, PolicyConfig] = {
    "tiny": PolicyConfig(),
    "small": PolicyConfig(horizon=32, width=256, depth=4, heads=8, image_size=64, patch_size=8, prompt_tokens=32),
    # The GPU benchmark size: 229 context tokens, ~400M parameters.
    "base": PolicyConfig(
        horizon=32, width=1024, depth=16, heads=16, image_size=224, patch_size=16, max_cameras=1, prompt_tokens=32
    ),
}


def _timestep_embedding(t: torch.Tensor, dim: int) -> torch.Tensor:
    half = dim // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = t.float()[:, None] * 1000.0 * freqs[None]
    return torch.cat([torch.cos(args), torch.sin(args)], dim=-1)


class _Block(nn.Module):
    def __init__(self, width: int, heads: int, mlp_ratio: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(width, elementwise_affine=False)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width, elementwise_affine=False)
        self.q_cross = nn.Linear(width, width)
        self.kv_cross = nn.Linear(width, 2 * width)
        self.proj_cross = nn.Linear(width, width)
        self.norm3 = nn.LayerNorm(width, elementwise_affine=False)
        self.mlp = nn.Sequential(
            nn.Linear(width, mlp_ratio * width), nn.GELU(approximate="tanh"), nn.Linear(mlp_ratio * width, width)
        )
        self.ada = nn.Linear(width, 9 * width)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, n, w = x.shape
        return x.view(b, n, self.heads, w // self.heads).transpose(1, 2)

    def _merge(self, x: torch.Tensor) -> torch.Tensor:
        b, h, n, d = x.shape
        return x.transpose(1, 2).reshape(b, n, h * d)

    def forward(self, x: torch.Tensor, ctx: torch.Tensor, temb: torch.Tensor) -> torch.Tensor:
        s1, b1, g1, s2, b2, g2, s3, b3, g3 = self.ada(temb)[:, None].chunk(9, dim=-1)
        h = self.norm1(x) * (1 + s1) + b1
        q, k, v = self.qkv(h).chunk(3, dim=-1)
        x = x + g1 * self.proj(
            self._merge(F.scaled_dot_product_attention(self._heads(q), self._heads(k), self._heads(v)))
        )
        h = self.norm2(x) * (1 + s2) + b2
        k, v = self.kv_cross(ctx).chunk(2, dim=-1)
        att = F.scaled_dot_product_attention(self._heads(self.q_cross(h)), self._heads(k), self._heads(v))
        x = x + g2 * self.proj_cross(self._merge(att))
        h = self.norm3(x) * (1 + s3) + b3
        return x + g3 * self.mlp(h)


def _normal(*shape: int, std: float = 1.0) -> torch.Tensor:
    """Normal(0, std) weights, or none on the meta device: ``load`` builds the model there only to assign the
    checkpoint's tensors, and a normal draw on meta goes through torch's Python meta kernels, whose first use
    imports sympy and dynamo (~0.5-1 s of every server's start).  Off meta it draws what ``randn * std`` draws."""
    weights = torch.empty(*shape)
    return weights if weights.is_meta else weights.normal_(0.0, std)


class FlowTransformer(nn.Module):
    """Observation encoder + action denoiser; batch-first everywhere."""

    def __init__(self, cfg: PolicyConfig) -> None:
        super().__init__()
        self.cfg = cfg
        w = cfg.width
        self.patch = nn.Conv2d(3, w, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.camera_pos = nn.Parameter(_normal(cfg.max_cameras, cfg.patches_per_camera, w, std=0.02))
        self.empty_camera = nn.Parameter(_normal(cfg.patches_per_camera, w, std=0.02))
        self.state = nn.Linear(cfg.joint_dim + cfg.gripper_dim, w)
        self.prompt = nn.Embedding(257, w, _weight=_normal(257, w))  # bytes + padding id 0; nn.Embedding's init
        self.prompt_pos = nn.Parameter(_normal(cfg.prompt_tokens, w, std=0.02))
        self.ctx_norm = nn.LayerNorm(w)
        self.null_context = nn.Parameter(_normal(cfg.context_tokens, w, std=0.02))
        self.action_in = nn.Linear(cfg.action_dim, w)
        self.action_pos = nn.Parameter(_normal(cfg.horizon, w, std=0.02))
        self.time = nn.Sequential(nn.Linear(w, w), nn.SiLU(), nn.Linear(w, w))
        self.blocks = nn.ModuleList(_Block(w, cfg.heads, cfg.mlp_ratio) for _ in range(cfg.depth))
        self.out_norm = nn.LayerNorm(w, elementwise_affine=False)
        self.action_out = nn.Linear(w, cfg.action_dim)

    def encode(
        self, images: torch.Tensor, present: torch.Tensor, state: torch.Tensor, tokens: torch.Tensor
    ) -> torch.Tensor:
        """images [B, C, 3, S, S] float in [-1, 1]; present [B, C] bool; state [B, D]; tokens [B, P] long."""
        b, c = images.shape[:2]
        patches = self.patch(images.flatten(0, 1)).flatten(2).transpose(1, 2).view(b, c, -1, self.cfg.width)
        patches = torch.where(present[:, :, None, None], patches, self.empty_camera) + self.camera_pos
        ctx = torch.cat(
            [patches.flatten(1, 2), self.state(state)[:, None], self.prompt(tokens) + self.prompt_pos], dim=1
        )
        return self.ctx_norm(ctx)

    def velocity(self, ctx: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        temb = self.time(_timestep_embedding(t, self.cfg.width).to(x.dtype))
        h = self.action_in(x) + self.action_pos
        for block in self.blocks:
            h = block(h, ctx, temb)
        return self.action_out(self.out_norm(h))


def camera_key(index: int) -> str:
    """The Sample tensor of camera slot ``index``: [B, H, W, 3] uint8, as the robot sent it."""
    return f"camera{index}"


@functools.lru_cache(maxsize=1024)
def _tokenize(prompt: str, length: int) -> torch.Tensor:
    """[1, length] byte tokens (0 pads).  Cached: a robot sends the same instruction with every frame, and the
    tensor is only ever read (``collate`` concatenates rows into a new tensor)."""
    data = prompt.encode("utf-8")[:length]
    ids = np.zeros((1, length), dtype=np.int64)
    ids[0, : len(data)] = np.frombuffer(data, dtype=np.uint8)
    ids[0, : len(data)] += 1  # in int64: uint8 + 1 would wrap at byte 255
    return torch.from_numpy(ids)


class ReferencePreprocessor:
    """The reference policy's ``prepare``, without its weights: the same object serves in the model process and,
    pickled, in the front-end process (``--frontend process``)."""

    def __init__(self, cfg: PolicyConfig) -> None:
        self.cfg = cfg
        # the camera mask for each number of cameras, [1, max_cameras] bool, shared read-only
        self._present = [torch.arange(cfg.max_cameras)[None] < n for n in range(cfg.max_cameras + 1)]

    def __getstate__(self) -> dict[str, Any]:
        return {"cfg": self.cfg}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["cfg"])  # type: ignore[misc]

    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        cfg = self.cfg
        parsed = parse_observation(
            obs,
            joint_dim=cfg.joint_dim,
            gripper_dim=cfg.gripper_dim,
            max_cameras=cfg.max_cameras,
            max_abs_state=cfg.max_abs_state,
        )
        # Few calls, as this runs on the event loop between a robot's frame and its batch: each numpy or
        # torch call costs a few microseconds there, and several times that on a cold cache after an idle
        # wait.  ``present`` and the tokens are shared read-only tensors.
        n = len(parsed.cameras)
        tensors = {
            "present": self._present[n],
            "state": torch.from_numpy(parsed.state[None]),
            "tokens": _tokenize(parsed.prompt, cfg.prompt_tokens),
        }
        # Each camera as it came, uint8 HWC: one contiguous copy here (the frame's arrays are read-only), and the
        # layout change, resize and scaling run on the device in condition(). A strided HWC -> CHW copy of a
        # 224x224 frame alone cost the CPU ~0.4 ms per request.
        for i, img in enumerate(parsed.cameras):
            tensors[camera_key(i)] = torch.from_numpy(img[None].copy())
        return Sample(tensors=tensors, meta={"cameras": n})


class ReferencePolicy(Policy):
    name = "reference-flow-policy"
    #: False: pinning a request's tensors allocated page-locked memory per request, 7-9 ms of host time on the
    #: H200 (bench/gpu_split.py, bench/results/h200-lone-robot.md) against ~0.1 ms for copying its ~150 KB
    #: from pageable memory; a bench (bench/gpu.py) may still turn it on
    pin_memory = False

    def __init__(self, cfg: PolicyConfig, model: FlowTransformer, device: torch.device, dtype: torch.dtype) -> None:
        self.cfg = cfg
        self.model = model.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self._device = device
        self.dtype = dtype
        self.name = cfg.name
        mean = cfg.action_mean or [0.0] * cfg.action_dim
        std = cfg.action_std or [1.0] * cfg.action_dim
        self._mean = torch.tensor(mean, dtype=torch.float32)
        self._std = torch.tensor(std, dtype=torch.float32)
        self._preprocessor = ReferencePreprocessor(cfg)

    @classmethod
    def load(cls, checkpoint: str, *, device: torch.device, dtype: torch.dtype = torch.float32) -> ReferencePolicy:
        root = Path(checkpoint)
        try:
            cfg = PolicyConfig.from_dict(json.loads((root / CONFIG_FILE).read_text()))
        except FileNotFoundError:
            raise CheckpointError(f"{root} is not a checkpoint: {CONFIG_FILE} is missing") from None
        except (ValueError, TypeError, ArithmeticError) as exc:  # ArithmeticError: heads or patch_size 0
            raise CheckpointError(f"{root / CONFIG_FILE}: {exc}") from exc
        with torch.device("meta"):
            model = FlowTransformer(cfg)
        try:
            # straight onto the device: the cast to ``dtype`` then runs there, not on the host (a 1.6 GB
            # fp32 ``base`` checkpoint converted to bf16 by one intra-op thread before its copy)
            state = load_file(str(root / WEIGHTS_FILE), device=str(device))
        except FileNotFoundError:
            raise CheckpointError(f"{root} is not a checkpoint: {WEIGHTS_FILE} is missing") from None
        except SafetensorError as exc:  # truncated or corrupted file
            raise CheckpointError(f"{root / WEIGHTS_FILE} is not a readable safetensors file: {exc}") from exc
        try:
            model.load_state_dict(state, strict=True, assign=True)
        except RuntimeError as exc:
            raise CheckpointError(f"{root / WEIGHTS_FILE} does not match {CONFIG_FILE}: {exc}") from exc
        return cls(cfg, model, device, dtype)

    def compile(self, mode: str = "default") -> None:
        # The replica pads a batch to the next bucket and warm-up runs every bucket, smallest first.  dynamo's
        # automatic dynamic shapes (dynamic=None) trace the step twice, whatever the number of buckets: the
        # smallest batch as its own graph, then one graph over a symbolic batch that every larger bucket
        # reuses.  A pod started from the compile cache skips the per-bucket trace, AOT-autograd and kernel
        # load a static graph per bucket cost (bench/results/h200-start-dynamic.md); mode="reduce-overhead"
        # still records one CUDA graph per bucket, so each bucket replays as a graph.
        compiled = torch.compile(self.model.velocity, mode=mode, dynamic=None)
        if mode == "reduce-overhead":
            # A CUDA graph's output buffer is reused by its next replay; sequential CFG keeps
            # the conditional velocity while computing the unconditional one, so copy it out.
            self.model.velocity = lambda ctx, x, t: compiled(ctx, x, t).clone()  # type: ignore[method-assign]
        else:
            self.model.velocity = compiled  # type: ignore[method-assign]

    @property
    def action_shape(self) -> tuple[int, int]:
        return (self.cfg.horizon, self.cfg.action_dim)

    @property
    def device(self) -> torch.device:
        return self._device

    def metadata(self) -> dict[str, Any]:
        meta = super().metadata()
        meta.update(
            {
                "image_size": self.cfg.image_size,
                "max_cameras": self.cfg.max_cameras,
                "joint_dim": self.cfg.joint_dim,
                "gripper_dim": self.cfg.gripper_dim,
                "context_tokens": self.cfg.context_tokens,
            }
        )
        return meta

    # --- serving split ----------------------------------------------------------
    def prepare(self, obs: Mapping[str, Any]) -> Sample:
        return self._preprocessor.prepare(obs)

    def preprocessor(self) -> ReferencePreprocessor | None:
        """None for a subclass that overrides ``prepare``: its own runs in the model process, never this one."""
        return self._preprocessor if type(self).prepare is ReferencePolicy.prepare else None

    def pixels(self, tensors: Mapping[str, torch.Tensor], batch_size: int) -> torch.Tensor:
        """[B, max_cameras, 3, S, S] in [-1, 1] from the cameras of ``tensors`` (on this policy's device)."""
        s = self.cfg.image_size
        images = torch.zeros(batch_size, self.cfg.max_cameras, 3, s, s, device=self._device, dtype=self.dtype)
        for i in range(self.cfg.max_cameras):
            camera = tensors.get(camera_key(i))
            if camera is None:  # absent: masked by ``present`` in encode
                continue
            x = camera.permute(0, 3, 1, 2)
            if x.shape[-2:] != (s, s):  # bilinear on the byte values, rounded back to bytes
                x = F.interpolate(x.float(), size=(s, s), mode="bilinear", align_corners=False).round_().clamp_(0, 255)
            images[:, i] = x.to(self.dtype)  # 0..255 are exact in bf16 and fp16
        return images / 127.5 - 1.0

    @torch.inference_mode()
    def condition(self, sample: Sample, branch: Branch) -> torch.Tensor:
        if branch is Branch.UNCOND:
            return self.model.null_context[None].expand(sample.batch_size, -1, -1)
        pin = self.pin_memory and self._device.type == "cuda"
        t = {k: (v.pin_memory() if pin else v).to(self._device, non_blocking=True) for k, v in sample.tensors.items()}
        images = self.pixels(t, sample.batch_size)
        return self.model.encode(images, t["present"], t["state"].to(self.dtype), t["tokens"])

    def denoise_step(self, context: torch.Tensor, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        # No inference_mode of its own: the sampler runs it in one, and guided real-time chunking takes a
        # vector-Jacobian product through it with autograd (runtime/policy/rtc.py).
        return self.model.velocity(context, x, t)

    def init_noise(self, seed: int) -> torch.Tensor:
        # Drawn on the CPU generator so every device and layout starts from the same bits.
        g = torch.Generator().manual_seed(seed)
        noise = torch.randn((1, *self.action_shape), generator=g, dtype=torch.float32)
        return noise.to(self._device, dtype=self.dtype)

    def postprocess(self, x: torch.Tensor) -> np.ndarray:
        actions = x[0].float().cpu() * self._std + self._mean
        return actions.numpy().astype(np.float32, copy=False)

    def actions_to_model(self, actions: np.ndarray) -> torch.Tensor:
        return (torch.from_numpy(np.asarray(actions, dtype=np.float32)) - self._mean) / self._std

    def example_observation(self, seed: int = 0) -> dict[str, Any]:
        return example_observation(self.cfg, seed)


def example_observation(cfg: PolicyConfig, seed: int = 0, image_hw: tuple[int, int] = (224, 224)) -> dict[str, Any]:
    """A RoboLab/DROID-shaped observation (used for warm-up, the client and tests)."""
    rng = np.random.default_rng(seed)
    return {
        "observation/image": rng.integers(0, 256, size=(*image_hw, 3), dtype=np.uint8),
        "observation/joint_position": rng.standard_normal(cfg.joint_dim).astype(np.float32),
        "observation/gripper_position": rng.random(cfg.gripper_dim).astype(np.float32),
        "prompt": "put the banana in the bowl",
    }


def init_checkpoint(directory: str | Path, size: str = "tiny", seed: int = 0, **overrides: Any) -> Path:
    """Write a checkpoint with seeded random weights: config.json, model.safetensors, manifest.json."""
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {sorted(SIZES)}")
    cfg = PolicyConfig(**{**asdict(SIZES[size]), **overrides})
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    model = FlowTransformer(cfg)
    for module in model.modules():  # unit-variance activations, so actions depend on every input
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            nn.init.normal_(module.weight, std=1.0 / math.sqrt(module.weight[0].numel()))
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(root / WEIGHTS_FILE))
    (root / CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=2) + "\n")
    write_manifest(root)
    return root


__all__ = [
    "FlowTransformer",
    "InvalidObservation",
    "PolicyConfig",
    "ReferencePolicy",
    "SIZES",
    "camera_key",
    "example_observation",
    "init_checkpoint",
]
