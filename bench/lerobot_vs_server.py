"""This server's LeRobot path against LeRobot's own inference, side by side on the same random weights, in one process.

For each family: a checkpoint written offline (``write_tiny_checkpoint``,
``--tiny`` or the published size), loaded once by ``--policy lerobot``'s
``LeRobotPolicy`` (eager, or ``--compile MODE``: CUDA graphs per batch
bucket) and by LeRobot itself (eager, and with LeRobot's own
``compile_model``).  Measured, device synchronised:

- 1 robot: p50 of one request -- preprocessor, model, postprocessor -- for
  each contender (ours: prepare + sample_actions + postprocess_batch);
- 8 robots: requests/s when eight robots ask at once: ours runs them as one
  batch (what a replica does with ``--max-batch 8``); LeRobot serves them one
  at a time (a loop of ``predict_action_chunk``), 1 / its p50;
- max |ours - LeRobot eager| over the robots, same seed -> same noise.

The WebSocket server adds ~0.7 ms per request on top (bench/results/h200.md).

    python bench/lerobot_vs_server.py --device cuda --compile reduce-overhead                # H200: SmolVLA, pi0.5 (bf16)
    python bench/lerobot_vs_server.py --tiny                                                 # CPU, tiny configs
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]


def p50_ms(fn: Callable[[], Any], reps: int, sync: Callable[[], None]) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def bench_family(family: str, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    import torch

    from policy_operator.runtime.policy.interface import collate
    from policy_operator.runtime.policy.lerobot import LeRobotPolicy
    from policy_operator.runtime.policy.lerobot.loading import load_pretrained
    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint
    from policy_operator.runtime.policy.sampler import sample_actions
    from policy_operator.runtime.engine.history import SessionHistory

    device = torch.device(args.device)
    size = "tiny" if args.tiny else "base"
    started = time.perf_counter()

    def build(config: Any) -> Any:  # random init on the device: a 3.5B pi0 takes minutes on a host CPU
        from lerobot.policies.factory import get_policy_class

        with torch.device(args.device):
            return get_policy_class(family)(config)

    root = write_tiny_checkpoint(family, workdir / family, size=size, seed=0, build=build)
    write_s = time.perf_counter() - started

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    ours = LeRobotPolicy.load(str(root), device=device)
    if args.compile:
        import torch._dynamo

        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
        ours.compile(args.compile)
    robots = args.robots
    history = SessionHistory(ours)
    observations = [ours.example_observation(i) for i in range(robots)]
    seeds = [100 + i for i in range(robots)]

    def serve(indices: list[int]) -> list[np.ndarray]:
        samples = [history.extend(f"robot-{i}", ours.prepare(observations[i])) for i in indices]
        x = sample_actions(
            ours, collate(samples), [seeds[i] for i in indices], guidance=1.0, integrator=ours.integrator()
        )
        return ours.postprocess_batch(x)

    lerobot = load_pretrained(root, device)  # a second copy: LeRobot's own path, same weights

    def lerobot_request(i: int, loaded: Any = lerobot) -> np.ndarray:
        frame = ours.spec.parse(observations[i])
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in loaded.preprocessor(frame).items()}
        if ours.history > 1:
            batch = {
                k: (torch.stack([v] * ours.history, dim=1) if isinstance(v, torch.Tensor) else v)
                for k, v in batch.items()
            }
        noise = torch.randn(ours.family.noise_shape, generator=torch.Generator().manual_seed(seeds[i])).to(device)
        loaded.policy.reset()
        with torch.inference_mode():
            return loaded.postprocessor(loaded.policy.predict_action_chunk(batch, noise=noise))[0].float().numpy()

    for _ in range(3):  # warm (and compile every shape) before timing
        serve([0])
        serve(list(range(robots)))
        lerobot_request(0)
    sync()
    diff = max(float(np.abs(serve([i])[0] - lerobot_request(i)).max()) for i in range(robots))
    row: dict[str, Any] = {
        "family": family,
        "params_m": sum(p.numel() for p in ours.loaded.policy.parameters()) / 1e6,
        "steps": ours.integrator().steps,
        "chunk": list(ours.action_shape),
        "write_s": write_s,
        "diff": diff,
        "ours_1": p50_ms(lambda: serve([0]), args.reps, sync),
        "ours_8": p50_ms(lambda: serve(list(range(robots))), args.reps, sync),
        "lerobot_1": p50_ms(lambda: lerobot_request(0), args.reps, sync),
    }
    del lerobot
    if args.lerobot_compile:
        compiled = load_pretrained_compiled(root, device)
        for _ in range(3):
            lerobot_request(0, compiled)
        row["lerobot_compiled_1"] = p50_ms(lambda: lerobot_request(0, compiled), args.reps, sync)
    print(row, flush=True)
    return row


def load_pretrained_compiled(root: Path, device: Any) -> Any:
    """LeRobot's own compile option (``compile_model``: torch.compile of sample_actions, its compile_mode)."""
    import json

    from policy_operator.runtime.policy.lerobot.loading import load_pretrained

    config = json.loads((root / "config.json").read_text())
    config["compile_model"] = True
    compiled_root = root.with_name(root.name + "-compiled")
    compiled_root.mkdir(exist_ok=True)
    for item in root.iterdir():
        target = compiled_root / item.name
        if not target.exists():
            target.symlink_to(item)
    (compiled_root / "config.json").unlink()
    (compiled_root / "config.json").write_text(json.dumps(config))
    return load_pretrained(compiled_root, device)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help="comma-separated; default smolvla,pi05 (--tiny: smolvla,diffusion)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU-sized) instead of the published sizes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument(
        "--compile", default=None, metavar="MODE", help="this server's --compile (reduce-overhead: CUDA graphs)"
    )
    p.add_argument("--lerobot-compile", action="store_true", help="also time LeRobot with its compile_model option")
    p.add_argument("--robots", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    families = (args.families or ("smolvla,diffusion" if args.tiny else "smolvla,pi05")).split(",")
    workdir = Path(tempfile.mkdtemp(prefix="bench-lerobot-"))
    rows = [bench_family(f, args, workdir) for f in families]
    n = args.robots
    lines = [
        f"# LeRobot policies: this server vs LeRobot's own inference ({args.device}, "
        f"{'tiny' if args.tiny else 'published'} sizes{', compile=' + args.compile if args.compile else ', eager'})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores"
        f"{'; ' + torch.cuda.get_device_name(0) if args.device == 'cuda' else ''}; torch {torch.__version__}. "
        f"Random weights written offline, the same for both sides; p50 of {args.reps} after warm-up; one run. "
        f"1 robot: one request, preprocessor to postprocessor. {n} robots: ours = one batch of {n}, LeRobot = one at "
        "a time (1 / its p50).",
        "",
        "| family | params (M) | steps | chunk | 1 robot p50 ms: ours | LeRobot eager | LeRobot compiled | ours / "
        f"LeRobot eager | {n} robots req/s: ours | LeRobot one at a time | ratio | max abs diff vs LeRobot |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours_rps, lerobot_rps = n / r["ours_8"] * 1e3, 1e3 / r["lerobot_1"]
        compiled = f"{r['lerobot_compiled_1']:.2f}" if "lerobot_compiled_1" in r else "-"
        lines.append(
            f"| {r['family']} | {r['params_m']:.1f} | {r['steps']} | {r['chunk'][0]}x{r['chunk'][1]} | "
            f"{r['ours_1']:.2f} | {r['lerobot_1']:.2f} | {compiled} | {r['ours_1'] / r['lerobot_1']:.2f} | "
            f"{ours_rps:.1f} | {lerobot_rps:.1f} | {ours_rps / lerobot_rps:.2f} | {r['diff']:.1e} |"
        )
    lines += [
        "",
        "Targets (issue 22): 1 robot <= 0.6x LeRobot's eager p50; 8 robots >= 4x LeRobot one at a time.",
        "",
        f"Reproduce: `python bench/lerobot_vs_server.py --device {args.device}{' --tiny' if args.tiny else ''}"
        f"{' --compile ' + args.compile if args.compile else ''}"
        f"{' --lerobot-compile' if args.lerobot_compile else ''} --families {','.join(families)}`",
        "",
    ]
    tag = f"{args.device}{'-tiny' if args.tiny else ''}"
    publish(lines, args.out or REPO / "bench" / "results" / f"lerobot-{tag}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
