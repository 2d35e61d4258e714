"""GR00T N1.7 (LeRobot ``groot``): a Qwen3-VL backbone once per request, then a flow-matching DiT action head per step.

LeRobot's ``GR00TN17.get_action`` runs the Qwen3-VL backbone over the prompt and
the camera frames (the preprocessor's GR00T steps pack them and apply Qwen3-VL's
chat template and image processor), encodes the state, then integrates the
action head from noise at t=0 to actions at t=1 in ``num_inference_timesteps``
Euler steps, each step's time discretized into ``num_timestep_buckets``.
``condition`` is everything up to that loop (the backbone's features, the
state features, the masks and the embodiment), ``denoise`` is one pass of the
action encoder, the DiT and the action decoder, ``Buckets`` is the loop's
arithmetic -- all under LeRobot's bf16 autocast when the config's ``use_bf16``.

No checkpoint code runs: LeRobot passes ``trust_remote_code=True`` when it
builds the backbone and its processor; ``loading`` and ``pipelines_loaded``
build them from the checkpoint's bundled directories with transformers' own
Qwen3-VL classes and ``trust_remote_code=False`` instead.  The checkpoint
bundles GR00T's base model directory (``base/``, ``base_model_path``) and the
backbone's config and processor (``backbone/``, the Qwen3-VL model name),
each named by its path relative to the checkpoint.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from policy_operator.runtime.policy.interface import Context, Integrator
from policy_operator.runtime.policy.lerobot.families import Family

BASE_DIR = "base"  # GR00T's base model directory (config.json + weights of GR00TN17)
BACKBONE_DIR = "backbone"  # the Qwen3-VL config, tokenizer (with its chat template), image and video processors
PATCH_KEYS = ("pixel_values", "image_grid_thw")  # Qwen3-VL's: one row per image patch / image, not per request
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>"]
SPECIAL_TOKENS += ["<|image_pad|>", "<|video_pad|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{% for c in message['content'] %}"
    "{% if c['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}"
    "{{ c['text'] }}{% endif %}{% endfor %}<|im_end|>\n{% endfor %}"
)


class Buckets(Integrator):
    """GR00T's loop: t = i / n, fed as ``int(t * buckets)`` (an int64 per row); ``x + (1 / n) * v``."""

    time_dtype = torch.long

    def __init__(self, steps: int, buckets: int) -> None:
        if steps < 1:
            raise ValueError(f"steps must be >= 1, got {steps}")
        self.timesteps = tuple(float(int(i / float(steps) * buckets)) for i in range(steps))
        self.dt = 1.0 / steps

    def step(self, x: torch.Tensor, out: torch.Tensor, i: int) -> torch.Tensor:
        return x + self.dt * out


def build_processor(directory: str) -> Any:
    """LeRobot's ``_build_n1_7_processor`` with transformers' own classes and no remote code."""
    import transformers

    hub: Any = transformers
    tokenizer = hub.AutoTokenizer.from_pretrained(directory, trust_remote_code=False)
    proc = hub.Qwen3VLProcessor(
        image_processor=hub.Qwen2VLImageProcessor.from_pretrained(directory, trust_remote_code=False),
        tokenizer=tokenizer,
        video_processor=hub.Qwen3VLVideoProcessor.from_pretrained(directory, trust_remote_code=False),
        chat_template=tokenizer.chat_template,
    )
    proc.tokenizer.padding_side = "left"
    return proc


class Groot(Family):
    references = ("base_model_path",)
    device_preprocessing = False  # the cameras go through GR00T's own pack and Qwen3-VL steps

    def __init__(self, policy: Any) -> None:
        super().__init__(policy)
        self.model = policy._groot_model  # noqa: SLF001
        self.head = self.model.action_head
        self.autocast = bool(self.config.use_bf16)
        self.noise_dtype = self.head.dtype if not self.autocast else torch.bfloat16
        horizon = int(self.head.config.action_horizon)
        self._chunk = int(policy._resolve_prediction_horizon(torch.empty(1, horizon, 1)))  # noqa: SLF001

    @classmethod
    @contextlib.contextmanager
    def loading(cls, root: Path) -> Iterator[None]:
        """While LeRobot builds the policy: GR00T's base model with the bundled backbone, no remote code."""
        from lerobot.policies.groot import groot_n1_7

        model = groot_n1_7.GR00TN17
        original = model.__dict__["from_pretrained"]
        backbone = str(root / BACKBONE_DIR)

        def from_pretrained(klass: Any, *args: Any, **kwargs: Any) -> Any:
            kwargs["transformers_loading_kwargs"] = {"trust_remote_code": False}
            kwargs["model_name"] = backbone
            return original.__func__(klass, *args, **kwargs)

        model.from_pretrained = classmethod(from_pretrained)
        try:
            yield
        finally:
            model.from_pretrained = original

    @classmethod
    def pipelines_loaded(cls, preprocessor: Any, root: Path) -> None:
        """The Qwen3-VL step's processor, built now from the bundled directory without remote code."""
        from lerobot.policies.groot.processor_groot import GrootN17VLMEncodeStep

        for step in preprocessor.steps:
            if isinstance(step, GrootN17VLMEncodeStep):
                step.model_name = str(root / BACKBONE_DIR)
                step._proc = build_processor(step.model_name)  # noqa: SLF001

    @property
    def chunk(self) -> int:
        return self._chunk

    @property
    def noise_shape(self) -> tuple[int, ...]:
        return (1, int(self.head.config.action_horizon), int(self.head.action_dim))

    def draw_noise(self, generator: torch.Generator) -> torch.Tensor:
        return torch.randn(self.noise_shape, generator=generator, dtype=self.noise_dtype)

    @property
    def default_steps(self) -> int:
        return int(self.head.num_inference_timesteps)

    def integrator(self, steps: int) -> Integrator:
        return Buckets(steps, int(self.head.num_timestep_buckets))

    def _autocast(self, device: torch.device) -> Any:
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16, enabled=self.autocast)

    def sample_tensors(self, batch: Any) -> dict[str, torch.Tensor]:
        # Qwen3-VL's patches and grids are not one row per request: a batch dimension of 1 makes them collate
        return {key: batch[key][None] for key in PATCH_KEYS if isinstance(batch.get(key), torch.Tensor)}

    def condition(self, batch: dict[str, torch.Tensor]) -> Context:
        batch = {k: v.flatten(0, 1) if k in PATCH_KEYS else v for k, v in batch.items()}
        inputs = self.policy._filter_groot_inputs(batch, include_action=False)  # noqa: SLF001
        with self._autocast(next(iter(batch.values())).device):
            backbone_inputs, action_inputs = self.model.prepare_input(inputs)
            backbone = self.model.backbone(backbone_inputs)
            features = self.head._encode_features(backbone, action_inputs)  # noqa: SLF001
        return {
            "vl": features.backbone_features,
            "state": features.state_features,
            "embodiment": action_inputs.embodiment_id,
            "image_mask": backbone.image_mask,
            "attention_mask": backbone.backbone_attention_mask,
        }

    def denoise(self, context: Context, x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        head = self.head
        with self._autocast(x.device):
            features = head.action_encoder(x, t, context["embodiment"])
            if head.config.add_pos_embed:
                positions = torch.arange(features.shape[1], dtype=torch.long, device=x.device)
                features = features + head.position_embedding(positions).unsqueeze(0)
            hidden = torch.cat((context["state"], features), dim=1)
            if head.config.use_alternate_vl_dit:
                out = head.model(
                    hidden_states=hidden,
                    encoder_hidden_states=context["vl"],
                    timestep=t,
                    image_mask=context["image_mask"],
                    backbone_attention_mask=context["attention_mask"],
                )
            else:
                out = head.model(hidden_states=hidden, encoder_hidden_states=context["vl"], timestep=t)
            velocity: torch.Tensor = head.action_decoder(out, context["embodiment"])[:, -head.action_horizon :]
        return velocity

    def finish(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.chunk, : self.action_dim]

    def rtc_unsupported(self) -> str | None:
        return (
            "GR00T integrates from noise at t=0 to actions at t=1 over discretized time buckets, and its own "
            "real-time chunking inpaints the initial noise with the previous actions; the server's correction is "
            "LeRobot's flow from t=1 (SmolVLA, pi0, pi0.5)"
        )


FAMILY = Groot


def bundle(preprocessor: Any) -> None:
    """Before the pipelines are saved: the Qwen3-VL step names the bundled backbone by its relative path."""
    from lerobot.policies.groot.processor_groot import GrootN17VLMEncodeStep

    for step in preprocessor.steps:
        if isinstance(step, GrootN17VLMEncodeStep):
            step.model_name = BACKBONE_DIR


def tiny_config(root: Path, size: str) -> Any:
    """A GR00T N1.7 config with its base model and a small Qwen3-VL backbone bundled, random weights, offline:
    a locally trained byte-level BPE with Qwen's special tokens and a chat template that places each image's
    pad token as Qwen3-VL's does, Qwen3-VL's own image and video processors, a 2-layer Qwen3-VL, a 2-layer DiT."""
    import transformers
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.groot.configuration_groot import GrootConfig
    from lerobot.policies.groot.groot_n1_7 import GR00TN17, GR00TN17Config
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from policy_operator.runtime.policy.lerobot.tiny import PROMPTS

    if size != "tiny":
        raise ValueError("groot has no base size here: its Cosmos-Reason2-2B backbone comes with its checkpoint")
    hub: Any = transformers
    backbone = root / BACKBONE_DIR
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(
        [*PROMPTS, "user assistant system"],
        trainer=trainers.BpeTrainer(
            vocab_size=300,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    tokenizer = hub.PreTrainedTokenizerFast(
        tokenizer_object=bpe, pad_token="<|endoftext|>", eos_token="<|im_end|>", chat_template=CHAT_TEMPLATE
    )
    tokenizer.save_pretrained(backbone)
    ids = {token: tokenizer.convert_tokens_to_ids(token) for token in SPECIAL_TOKENS}
    hub.Qwen3VLConfig(
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=True,
        text_config={
            "model_type": "qwen3_vl_text",
            "head_dim": 16,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_attention_heads": 2,
            "num_hidden_layers": 2,
            "num_key_value_heads": 1,
            "vocab_size": len(tokenizer),
            "max_position_embeddings": 4096,
            "rope_scaling": {"mrope_interleaved": True, "mrope_section": [4, 2, 2], "rope_type": "default"},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
        vision_config={
            "model_type": "qwen3_vl",
            "deepstack_visual_indexes": [0],
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "num_position_embeddings": 64,
            "out_hidden_size": 32,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
        },
    ).save_pretrained(backbone)
    pixels = {"min_pixels": 32 * 32, "max_pixels": 64 * 64}
    hub.Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, **pixels).save_pretrained(backbone)
    hub.Qwen3VLVideoProcessor(patch_size=16, merge_size=2, temporal_patch_size=2).save_pretrained(backbone)
    base = GR00TN17(
        GR00TN17Config(
            model_name=str(backbone),
            backbone_embedding_dim=32,
            select_layer=2,
            max_state_dim=8,
            max_action_dim=8,
            action_horizon=4,
            hidden_size=32,
            input_embedding_dim=32,
            max_seq_len=64,
            diffusion_model_cfg={
                "positional_embeddings": None,
                "num_layers": 2,
                "num_attention_heads": 2,
                "attention_head_dim": 16,
                "norm_type": "ada_norm",
                "dropout": 0.0,
                "final_dropout": True,
                "output_dim": 32,
                "interleave_self_attention": True,
            },
            vl_self_attention_cfg={
                "positional_embeddings": None,
                "num_layers": 1,
                "num_attention_heads": 2,
                "attention_head_dim": 16,
                "dropout": 0.0,
                "final_dropout": True,
            },
            num_inference_timesteps=4,
            image_crop_size=[32, 32],
            image_target_size=[32, 32],
            use_albumentations_transforms=False,
        ),
        transformers_loading_kwargs={"trust_remote_code": False},
        load_backbone_weights=False,
    )
    base.config.model_name = BACKBONE_DIR  # relocatable: ``loading`` names the bundled directory
    base.save_pretrained(root / BASE_DIR)
    return GrootConfig(
        base_model_path=BASE_DIR,
        chunk_size=4,
        n_action_steps=4,
        max_state_dim=8,
        max_action_dim=8,
        use_bf16=False,
        device="cpu",
        input_features={
            "observation.images.top": PolicyFeature(FeatureType.VISUAL, (3, 32, 32)),
            "observation.state": PolicyFeature(FeatureType.STATE, (6,)),
        },
        output_features={"action": PolicyFeature(FeatureType.ACTION, (6,))},
    )
