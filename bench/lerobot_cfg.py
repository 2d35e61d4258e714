"""A CFG family (LingBot-VA) through ``--policy lerobot`` in the three CFG layouts, 1 and 8 robots over the WebSocket.

Writes a LingBot-VA checkpoint with random weights (``--size base``: the
published transformer -- 30 layers, 24 x 128 heads, guidance 5.0 on 20 video
steps, then the cache write and 50 action steps -- and Wan2.2 VAE, in
bfloat16; its UMT5 text encoder at the published width with 2 of its 24
layers: family_lingbot_va.py's base size; ``--layers`` cuts the transformer
for a quicker call), then serves it once per layout with
bench/lerobot_robots.py (one process per robot, closed loop):

- sequential CFG (cfgp=1, the two branches one after the other),
- batched CFG (cfgp=1, one forward of both branches),
- cfgp=2 over gloo on one GPU (``--backend gloo --share-gpu``: functional, both ranks share the card),
- with ``--two-gpus``: cfgp=2 over NCCL, one branch per GPU (a kind with two GPUs).

    python bench/lerobot_cfg.py --device cuda                       # H100/H200: published size, random weights
    python bench/lerobot_cfg.py --device cuda --two-gpus            # on a two-GPU kind, adds cfgp=2 over NCCL
    python bench/lerobot_cfg.py --device cpu --size tiny --n 5      # CPU smoke run
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def write_checkpoint(args: argparse.Namespace) -> Path:
    import torch

    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

    root = Path(args.workdir) / f"lingbot_va-{args.size}-{args.layers or 'all'}"
    if (root / "model.safetensors").is_file():
        return root

    def configure(config: Any) -> None:
        if args.layers:
            config.num_layers = args.layers

    def build(config: Any) -> Any:
        from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

        with torch.device(args.device):  # built where it runs: the published transformer is ~5B parameters
            return LingBotVAPolicy(config)

    write_tiny_checkpoint("lingbot_va", root, size=args.size, seed=0, configure=configure, build=build)
    return root


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="base", choices=["tiny", "base"])
    p.add_argument("--layers", type=int, default=0, help="transformer layers (0: the size's own, 30 at base)")
    p.add_argument("--workdir", default="/tmp/ck")
    p.add_argument("--robots", default="1,8")
    p.add_argument("--n", type=int, default=10, help="measured requests per robot")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--two-gpus", action="store_true", help="also cfgp=2 over NCCL, one branch per GPU")
    p.add_argument(
        "--variants",
        default="sequential,batched,cfgp2",
        help="which layouts, comma-separated: sequential, batched, cfgp2 (gloo, one GPU); --two-gpus adds nccl",
    )
    p.add_argument("--logs", default="/tmp")
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "lerobot-cfg.md"))
    args = p.parse_args()
    common = f"--device {args.device} --max-batch 8" + (" --threads 1" if args.device == "cpu" else "")
    layouts = {
        "sequential": f"sequential CFG=--cfg-mode sequential {common}",
        "batched": f"batched CFG=--cfg-mode batched {common}",
        "cfgp2": f"cfgp 2 gloo, one GPU=--cfgp 2 --backend gloo {'--share-gpu ' if args.device == 'cuda' else ''}{common}",
        "nccl": f"cfgp 2 NCCL, two GPUs=--cfgp 2 --backend nccl {common}",
    }
    picked = args.variants.split(",") + (["nccl"] if args.two_gpus else [])
    unknown = sorted(set(picked) - set(layouts))
    if unknown:
        p.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(layouts)})")
    variants = [layouts[name] for name in dict.fromkeys(picked)]
    root = write_checkpoint(args)
    cmd = [sys.executable, str(REPO / "bench" / "lerobot_robots.py"), "--checkpoint", str(root)]
    cmd += ["--robots", args.robots, "--n", str(args.n), "--warmup", str(args.warmup), "--logs", args.logs]
    label = f"LingBot-VA {args.size}{f', {args.layers} layers' if args.layers else ''} (random weights), guidance 5.0"
    cmd += ["--label", label, "--out", args.out]
    for variant in variants:
        cmd += ["--variant", variant]
    return subprocess.run(cmd, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
