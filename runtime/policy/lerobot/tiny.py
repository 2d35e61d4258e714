"""LeRobot checkpoints with seeded random weights, written offline: what tests, demos and benchmarks serve.

Every stock LeRobot config names a hub repository (SmolVLA's SmolVLM, pi0's
PaliGemma tokenizer, Diffusion Policy's ImageNet backbone).  These writers
bundle what a config names into the checkpoint instead: a SmolVLM config and
processor whose tokenizer is a small byte-level BPE trained here, saved under
``vlm/`` and named by that relative path, which ``loading.resolve_reference``
resolves against the checkpoint directory -- so the directory can be copied
or fetched anywhere.  The output is a normal LeRobot pretrained directory
(``save_pretrained`` of the policy, its preprocessor and postprocessor, with
made-up dataset statistics) plus the project's manifest.

Sizes: ``tiny`` builds in a fraction of a second and predicts on a CPU in
milliseconds; ``base`` is the published size (SmolVLA: a SmolVLM2-500M-shaped
backbone with 16 of its 32 text layers, ~450M parameters; pi0 and pi0.5:
PaliGemma ``gemma_2b`` + ``gemma_300m`` expert, ~3.5B, bfloat16).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.runtime.checkpoint.format import write_manifest
from policy_operator.runtime.policy.lerobot.families import family_class, family_module
from policy_operator.runtime.policy.lerobot.loading import go_offline

VLM_DIR = "vlm"  # the bundled VLM config + processor, named by this relative path
TOKENIZER_DIR = "tokenizer"  # pi0's bundled tokenizer
FAMILIES = tuple(LEROBOT_FAMILIES)  # the registry's: families.py's own and each family_<type>.py
SIZES = ("tiny", "base")
PROMPTS = [
    "pick up the red cube and put it in the bowl",
    "push the t to the target",
    "open the top drawer",
    "fold the towel in half",
    "stack the blocks",
]
SPECIAL_TOKENS = [
    "<pad>",
    "<|im_start|>",
    "<end_of_utterance>",
    "<image>",
    "<fake_token_around_image>",
    "<global-img>",
    "<bos>",
    "<eos>",
]


def train_tokenizer(vocab_size: int = 300) -> Any:
    """A byte-level BPE with SmolVLM's special tokens, trained here on a few prompts (any text still encodes)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        PROMPTS,
        trainer=trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=SPECIAL_TOKENS,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        ),
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        bos_token="<bos>",
        eos_token="<eos>",
        extra_special_tokens={
            "fake_image_token": "<fake_token_around_image>",
            "image_token": "<image>",
            "global_image_token": "<global-img>",
            "end_of_utterance_token": "<end_of_utterance>",
        },
    )


def _write_smolvlm(directory: Path, size: str) -> None:
    import transformers

    smolvlm: Any = transformers  # the processors and config are resolved lazily: their stubs lag the classes

    tokenizer = train_tokenizer()
    if size == "tiny":
        text: dict[str, Any] = {
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 4,
            "num_attention_heads": 4,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "vocab_size": len(tokenizer),
        }
        vision: dict[str, Any] = {
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "image_size": 64,
            "patch_size": 16,
        }
        scale, side = 2, 64
    else:  # SmolVLM2-500M-Video-Instruct's shapes
        text = {
            "hidden_size": 960,
            "intermediate_size": 2560,
            "num_hidden_layers": 32,
            "num_attention_heads": 15,
            "num_key_value_heads": 5,
            "head_dim": 64,
            "vocab_size": 49280,
            "rope_theta": 100000.0,
        }
        vision = {
            "hidden_size": 768,
            "intermediate_size": 3072,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "image_size": 512,
            "patch_size": 16,
        }
        scale, side = 4, 512
    text.update({"model_type": "llama", "max_position_embeddings": 8192, "pad_token_id": tokenizer.pad_token_id})
    smolvlm.SmolVLMConfig(
        text_config=text,
        vision_config=vision,
        scale_factor=scale,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
    ).save_pretrained(directory)
    images = smolvlm.SmolVLMImageProcessor(
        do_resize=False, do_image_splitting=False, size={"longest_edge": side}, max_image_size={"longest_edge": side}
    )
    smolvlm.SmolVLMProcessor(
        image_processor=images,
        tokenizer=tokenizer,
        video_processor=smolvlm.SmolVLMVideoProcessor(),
        image_seq_len=(side // vision["patch_size"] // scale) ** 2,
    ).save_pretrained(directory)


def _features(state_dim: int, action_dim: int, cameras: dict[str, tuple[int, int, int]]) -> dict[str, Any]:
    from lerobot.configs.types import FeatureType, PolicyFeature

    inputs = {"observation.state": PolicyFeature(FeatureType.STATE, (state_dim,))}
    inputs.update({key: PolicyFeature(FeatureType.VISUAL, shape) for key, shape in cameras.items()})
    return {"input_features": inputs, "output_features": {"action": PolicyFeature(FeatureType.ACTION, (action_dim,))}}


def _stats(config: Any, generator: torch.Generator) -> dict[str, dict[str, torch.Tensor]]:
    """Made-up dataset statistics for every normalized feature (non-trivial, so (un)normalization is exercised)."""
    stats: dict[str, dict[str, torch.Tensor]] = {}
    for key, feature in {**config.input_features, **config.output_features}.items():
        shape = tuple(feature.shape) if feature.type.name != "VISUAL" else (feature.shape[0], 1, 1)
        mean = torch.randn(shape, generator=generator) * 0.1
        std = torch.rand(shape, generator=generator) + 0.5
        stats[key] = {
            "mean": mean,
            "std": std,
            "min": mean - 2 * std,
            "max": mean + 2 * std,
            "q01": mean - 2 * std,
            "q99": mean + 2 * std,
        }
    return stats


def _smolvla(root: Path, size: str) -> Any:
    from lerobot.policies.smolvla.configuration_smolvla import SmolVLAConfig

    _write_smolvlm(root / VLM_DIR, size)
    tiny = size == "tiny"
    return SmolVLAConfig(
        vlm_model_name=VLM_DIR,
        load_vlm_weights=False,
        pad_language_to="max_length",
        device="cpu",
        num_vlm_layers=4 if tiny else 16,
        chunk_size=8 if tiny else 50,
        n_action_steps=8 if tiny else 50,
        num_steps=4 if tiny else 10,
        max_state_dim=8 if tiny else 32,
        max_action_dim=8 if tiny else 32,
        tokenizer_max_length=16 if tiny else 48,
        resize_imgs_with_padding=(64, 64) if tiny else (512, 512),
        **_features(
            6,
            6,
            {
                "observation.images.top": (3, 48, 64) if tiny else (3, 480, 640),
                "observation.images.wrist": (3, 48, 64) if tiny else (3, 480, 640),
            },
        ),
    )


def _pi(root: Path, size: str, kind: str) -> Any:
    if size == "tiny":
        raise ValueError(
            f"{kind} has no tiny size: its PaliGemma backbone is gemma_2b-wide whatever the variant "
            "(the vision projection is fixed at 2048 and the vocabulary at 257152 in LeRobot 0.6)"
        )
    from lerobot.policies.pi0.configuration_pi0 import PI0Config
    from lerobot.policies.pi05.configuration_pi05 import PI05Config

    train_tokenizer().save_pretrained(root / TOKENIZER_DIR)
    cls = PI0Config if kind == "pi0" else PI05Config
    return cls(
        paligemma_variant="gemma_2b",
        action_expert_variant="gemma_300m",
        dtype="bfloat16",
        device="cpu",
        **_features(
            14,
            14,
            {"observation.images.base_0_rgb": (3, 224, 224), "observation.images.left_wrist_0_rgb": (3, 224, 224)},
        ),
    )


def _diffusion(root: Path, size: str) -> Any:
    from lerobot.policies.diffusion.configuration_diffusion import DiffusionConfig

    tiny = size == "tiny"
    return DiffusionConfig(
        pretrained_backbone_weights=None,
        use_group_norm=True,
        noise_scheduler_type="DDIM",
        device="cpu",
        num_inference_steps=4 if tiny else 10,
        horizon=8 if tiny else 16,
        n_action_steps=4 if tiny else 8,
        n_obs_steps=2,
        down_dims=(16, 32) if tiny else (512, 1024, 2048),
        kernel_size=3 if tiny else 5,
        n_groups=4 if tiny else 8,
        diffusion_step_embed_dim=16 if tiny else 128,
        spatial_softmax_num_keypoints=4 if tiny else 32,
        crop_shape=None if tiny else (84, 84),
        **_features(2, 2, {"observation.image": (3, 32, 32) if tiny else (3, 96, 96)}),
    )


BUILDERS: dict[str, Callable[[Path, str], Any]] = {
    "smolvla": _smolvla,
    "pi0": lambda root, size: _pi(root, size, "pi0"),
    "pi05": lambda root, size: _pi(root, size, "pi05"),
    "diffusion": _diffusion,
}


def tiny_config(family: str, directory: str | Path, size: str = "tiny") -> Any:
    """The LeRobot config of ``family`` at ``size``, with whatever it names written under ``directory``."""
    if family not in FAMILIES:
        raise ValueError(f"unknown LeRobot family {family!r}; choose one of {sorted(FAMILIES)}")
    if size not in SIZES:
        raise ValueError(f"unknown size {size!r}; choose one of {list(SIZES)}")
    go_offline()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    build = BUILDERS[family] if family in BUILDERS else family_module(family).tiny_config  # a family_<type>.py's own
    return build(root, size)


@contextlib.contextmanager
def _bundled_tokenizer(path: Path | None) -> Iterator[None]:
    """pi0's processor factory names the PaliGemma tokenizer on the hub; while it builds, load ours instead."""
    if path is None:
        yield
        return
    from lerobot.processor import tokenizer_processor

    hub = tokenizer_processor.AutoTokenizer

    class Bundled:
        @staticmethod
        def from_pretrained(name: str, *args: Any, **kwargs: Any) -> Any:
            return hub.from_pretrained(str(path), *args, **kwargs)

    tokenizer_processor.AutoTokenizer = Bundled
    try:
        yield
    finally:
        tokenizer_processor.AutoTokenizer = hub


def write_tiny_checkpoint(
    family: str,
    directory: str | Path,
    *,
    size: str = "tiny",
    seed: int = 0,
    build: Callable[[Any], Any] | None = None,
    configure: Callable[[Any], None] | None = None,
) -> Path:
    """A LeRobot pretrained directory of ``family`` with weights seeded by ``seed``, written without any hub.

    ``configure`` adjusts the config before anything is built; ``build`` (config -> policy) replaces LeRobot's
    own policy class, e.g. to build on a GPU.
    """
    from lerobot.policies.factory import get_policy_class, make_pre_post_processors

    root = Path(directory)
    torch.manual_seed(seed)  # what a family bundles is seeded too (LingBot-VA's VAE and text encoder, GR00T's base)
    config = tiny_config(family, root, size)
    if configure is not None:
        configure(config)
    vlm = getattr(config, "vlm_model_name", None)
    if vlm == VLM_DIR:  # built from the bundled directory; saved under its relative name
        config.vlm_model_name = str(root / VLM_DIR)
    kind = family_class(family)
    bundled = {  # a family's references to directories it bundled: absolute while building, saved relative
        name: getattr(config, name) for name in kind.references if (root / str(getattr(config, name))).is_dir()
    }
    for name, relative in bundled.items():
        setattr(config, name, str(root / relative))
    torch.manual_seed(seed)
    with kind.loading(root):
        policy = build(config) if build is not None else get_policy_class(family)(config)
    stats = _stats(config, torch.Generator().manual_seed(seed))
    with _bundled_tokenizer(root / TOKENIZER_DIR if (root / TOKENIZER_DIR).is_dir() else None):
        preprocessor, postprocessor = make_pre_post_processors(config, dataset_stats=stats)
    if vlm == VLM_DIR:
        config.vlm_model_name = VLM_DIR
    for name, relative in bundled.items():
        setattr(config, name, relative)
    for step in preprocessor.steps:  # the tokenizer is named by its path relative to the checkpoint
        if getattr(step, "tokenizer_name", None):
            step.tokenizer_name = VLM_DIR if vlm else TOKENIZER_DIR
    bundle = None if family in BUILDERS else getattr(family_module(family), "bundle", None)
    if bundle is not None:  # a family module's own renaming of what its steps name (GR00T's Qwen3-VL step)
        bundle(preprocessor)
    policy.save_pretrained(root)
    preprocessor.save_pretrained(root)
    postprocessor.save_pretrained(root)
    write_manifest(root)
    return root
