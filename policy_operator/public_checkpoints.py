"""The public hub repositories the examples serve: one list, which tests hold every ``hf://`` example to.

A new user's first ``kubectl apply`` should download something that exists.
Every ``hf://`` source in ``examples/`` must be a row here
(tests/test_examples.py), and docs/examples.md shows this table, rendered from
it (``render_table``; ``python -m policy_operator.public_checkpoints
docs/examples.md`` rewrites that block).  Each row says what else the
checkpoint names on the hub -- the fetch Job downloads those too -- and whether
one of them is gated: then the PolicyServer needs ``checkpoint.secretRef``, a
Secret whose ``token`` is a Hugging Face token of an account that accepted that
repository's licence.  Torch-free: the operator's and the docs' side read it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Final

PALIGEMMA_TOKENIZER: Final = "google/paligemma-3b-pt-224"  # pi0 / pi0.5's tokenizer (LeRobot's processors name it)
SMOLVLM: Final = "HuggingFaceTB/SmolVLM2-500M-Video-Instruct"  # SmolVLA's VLM config and processor
# LingBot-VA's frozen VAE, UMT5-XXL text encoder and tokenizer: its config's wan_pretrained_path (LeRobot's default).
# The authors' release (the Robbyant/lingbot-va README's model table, Apache-2.0), which LeRobot, the authors'
# instructions and third-party guides download without a token (`huggingface-cli download robbyant/lingbot-va-base`).
LINGBOT_VA_WAN: Final = "robbyant/lingbot-va-base"


@dataclass(frozen=True)
class PublicCheckpoint:
    lerobot_type: str  # config.json's type: what ``policy.type: lerobot`` serves it as
    summary: str
    references: tuple[str, ...] = ()  # hub repositories the checkpoint names (fetched with it)
    gated: tuple[str, ...] = ()  # those of them that need an accepted licence and a token


PUBLIC_CHECKPOINTS: Final[Mapping[str, PublicCheckpoint]] = MappingProxyType(
    {
        "lerobot/smolvla_base": PublicCheckpoint(
            "smolvla", "SmolVLA, 450M, pretrained on community datasets", (SMOLVLM,)
        ),
        "lerobot/pi05_base": PublicCheckpoint(
            "pi05", "pi0.5 base (PaliGemma 3B + action expert)", (PALIGEMMA_TOKENIZER,), (PALIGEMMA_TOKENIZER,)
        ),
        "lerobot/pi0_base": PublicCheckpoint(
            "pi0", "pi0 base (PaliGemma 3B + action expert)", (PALIGEMMA_TOKENIZER,), (PALIGEMMA_TOKENIZER,)
        ),
        "lerobot/diffusion_pusht": PublicCheckpoint("diffusion", "Diffusion Policy trained on PushT (one camera)"),
        "lerobot/lingbot_va_base": PublicCheckpoint(
            "lingbot_va",
            "LingBot-VA base, a ~5B Wan2.2 video-action world model (guidance 5.0 on its video)",
            (LINGBOT_VA_WAN,),
        ),
    }
)

BEGIN: Final = "<!-- BEGIN GENERATED: public-checkpoints -->"
END: Final = "<!-- END GENERATED: public-checkpoints -->"


def render_table() -> str:
    """The markdown table of ``PUBLIC_CHECKPOINTS``, between its markers."""
    rows = [
        "| `checkpoint.source` | LeRobot type | what | also fetched | gated (needs `checkpoint.secretRef`) |",
        "|---|---|---|---|---|",
    ]
    for repo, c in PUBLIC_CHECKPOINTS.items():
        also = ", ".join(f"`{r}`" for r in c.references) or "-"
        gated = ", ".join(f"`{r}`" for r in c.gated) or "no"
        rows.append(f"| `hf://{repo}` | `{c.lerobot_type}` | {c.summary} | {also} | {gated} |")
    return "\n".join([BEGIN, *rows, END])


def rewrite(text: str) -> str:
    """``text`` with its generated block replaced by ``render_table()``; ValueError without the markers."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"no {BEGIN} ... {END} block")
    return text[:start] + render_table() + text[end + len(END) :]


def main(argv: list[str]) -> int:
    for name in argv:
        path = Path(name)
        path.write_text(rewrite(path.read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
