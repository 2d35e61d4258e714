"""GPU benchmark of one replica: each single-GPU optimisation as a ratio, measured in one run.

Rows (same checkpoint, same observation, same seed, 10 steps by default):
fp32 sequential CFG (baseline), fp32 batched CFG, bf16 sequential, bf16
batched, bf16 batched + torch.compile, bf16 batched + torch.compile
"reduce-overhead" (CUDA graphs).  Each row is timed with CUDA events around
the whole request (prepare -> actions on the host), after warm-up.  Also
checks the accuracy cost of bf16 against fp32.

    python bench/gpu.py --size base --out bench/results/h200-inprocess.md
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="base")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n", type=int, default=30)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--out", default=str(REPO / "bench" / "results" / "h200-inprocess.md"))
    p.add_argument("--skip-compile", action="store_true")
    args = p.parse_args()

    import torch

    from policy_operator.runtime.policy.reference import ReferencePolicy, init_checkpoint
    from policy_operator.runtime.policy.sampler import sample_actions

    assert torch.cuda.is_available(), "needs a GPU"
    torch.backends.cuda.matmul.allow_tf32 = False
    ckpt = args.checkpoint or str(init_checkpoint(Path(tempfile.mkdtemp()) / args.size, args.size))
    device = torch.device("cuda")
    # (label, dtype, cfg mode, compile mode, pinned host memory)
    configs = [
        ("fp32, sequential CFG", torch.float32, "sequential", None, True),
        ("fp32, batched CFG", torch.float32, "batched", None, True),
        ("bf16, sequential CFG", torch.bfloat16, "sequential", None, True),
        ("bf16, batched CFG", torch.bfloat16, "batched", None, True),
    ]
    if not args.skip_compile:
        configs += [
            ("bf16, batched CFG, torch.compile", torch.bfloat16, "batched", "default", True),
            (
                "bf16, batched CFG, compile reduce-overhead (CUDA graphs)",
                torch.bfloat16,
                "batched",
                "reduce-overhead",
                True,
            ),
            ("same, pageable (not pinned) host memory", torch.bfloat16, "batched", "reduce-overhead", False),
        ]
    results = []
    reference = None
    for label, dtype, mode, compile_mode, pinned in configs:
        policy = ReferencePolicy.load(ckpt, device=device, dtype=dtype)
        policy.pin_memory = pinned
        if compile_mode:
            policy.compile(compile_mode)
        obs = policy.example_observation(0)

        def once(seed: int, policy=policy, obs=obs, mode=mode):
            x = sample_actions(policy, policy.prepare(obs), [seed], steps=args.steps, guidance=3.0, mode=mode)
            return policy.postprocess(x)  # .cpu() inside: the one sync, at the end

        t_compile = time.perf_counter()
        for i in range(5):
            once(i)
        warm_s = time.perf_counter() - t_compile
        times = []
        for i in range(args.n):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            once(100 + i)
            times.append((time.perf_counter() - t0) * 1e3)
        actions = once(7)
        if reference is None:
            reference = actions
        err = float(abs(actions - reference).max())
        p50 = statistics.median(times)
        results.append((label, p50, min(times), err, warm_s))
        print(
            f"{label:<60} p50 {p50:8.3f} ms  min {min(times):8.3f} ms  max|err| vs fp32 seq {err:.2e}  "
            f"warm-up {warm_s:.1f}s",
            flush=True,
        )
        del policy
        torch.cuda.empty_cache()
    cfg = ReferencePolicy.load(ckpt, device=torch.device("cpu")).cfg
    params = sum(
        v.numel()
        for v in __import__("safetensors.torch", fromlist=["load_file"])
        .load_file(str(Path(ckpt) / "model.safetensors"))
        .values()
    )
    base = results[0][1]
    lines = [
        f"# One GPU, in-process: {torch.cuda.get_device_name(0)}",
        "",
        f"Model `{args.size}`: width {cfg.width}, depth {cfg.depth}, heads {cfg.heads}, action chunk "
        f"{cfg.horizon}x{cfg.action_dim}, {cfg.context_tokens} conditioning tokens, {params / 1e6:.0f}M parameters; "
        f"{args.steps} Euler steps, guidance 3.0, torch {torch.__version__}. p50 of {args.n} requests "
        f"(prepare -> actions on the host), after warm-up.",
        "",
        "| configuration | p50 ms | min ms | ratio vs fp32 sequential | max abs diff vs fp32 sequential |",
        "|---|---:|---:|---:|---:|",
        *[f"| {label} | {p50:.3f} | {mn:.3f} | {p50 / base:.3f} | {err:.1e} |" for label, p50, mn, err, _ in results],
        "",
        f"Reproduce: `python bench/gpu.py --size {args.size} --steps {args.steps} --n {args.n}`",
        "",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
