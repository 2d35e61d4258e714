"""In-process batch cost and batch-vs-alone agreement: what one sampler call on B requests costs, no server.

For each batch size B: the p50 time of one batch (collate -> sample_actions ->
postprocess_batch, device synchronised), the time per request, and the largest
difference between a request's actions in the batch and the same request run
alone (B=1).  Every request has its own observation and seed.  The agreement
columns are what docs/runtime.md quotes for bf16 on a GPU.

    python bench/batching.py --device cuda --size base --dtype bfloat16 --compile reduce-overhead
    python bench/batching.py                    # CPU, tiny, fp32: the tested 1e-5 bound, measured
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", default=None, metavar="MODE")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--sizes", default="1,2,4,8,16,32")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--json", default=None, metavar="PATH", help="also write {batch size: p50 ms} as JSON (bench/runtime.py)"
    )
    args = p.parse_args()

    import torch
    import torch._dynamo

    from policy_operator.runtime.policy import collate
    from policy_operator.runtime.policy.interface import parse_dtype
    from policy_operator.runtime.policy.reference import ReferencePolicy, example_observation, init_checkpoint
    from policy_operator.runtime.policy.sampler import sample_actions

    sizes = [int(x) for x in args.sizes.split(",")]
    checkpoint = (
        Path(args.checkpoint)
        if args.checkpoint
        else init_checkpoint(Path(tempfile.mkdtemp(prefix="bench-batching-")) / args.size, args.size)
    )
    torch.set_num_threads(1)  # as the servers beside it run: bench/runtime.py's on a CPU, every rank's on a GPU
    device = torch.device(args.device)
    policy = ReferencePolicy.load(str(checkpoint), device=device, dtype=parse_dtype(args.dtype))
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 4 * len(sizes) + 8)
        policy.compile(args.compile)
    mode = "batched" if args.device == "cuda" else "sequential"
    largest = max(sizes)
    samples = [policy.prepare(example_observation(policy.cfg, i)) for i in range(largest)]
    seeds = [1000 + i for i in range(largest)]

    def run(b: int) -> list[np.ndarray]:
        x = sample_actions(policy, collate(samples[:b]), seeds[:b], steps=args.steps, guidance=3.0, mode=mode)  # type: ignore[arg-type]
        out = policy.postprocess_batch(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    started = time.perf_counter()
    for b in sizes:  # compile, warm, record and replay every shape (CUDA graph trees) before timing anything
        for _ in range(4):
            run(b)
    warm_s = time.perf_counter() - started
    alone = [run(1)[0]]
    for i in range(1, largest):  # each request alone: batch of one, its own sample and seed
        x = sample_actions(policy, collate([samples[i]]), [seeds[i]], steps=args.steps, guidance=3.0, mode=mode)  # type: ignore[arg-type]
        alone.append(policy.postprocess_batch(x)[0])
    rows = []
    for b in sizes:
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            got = run(b)
            times.append((time.perf_counter() - t0) * 1e3)
        diff = max(float(np.abs(got[i] - alone[i]).max()) for i in range(b))
        scale = max(float(np.abs(alone[i]).max()) for i in range(b))
        rows.append((b, statistics.median(times), diff, scale))
        print(
            f"B={b:>3}: p50 {rows[-1][1]:8.2f} ms  per request {rows[-1][1] / b:7.2f} ms  max |batch - alone| {diff:.2e}",
            flush=True,
        )
    base = rows[0][1]
    lines = [
        f"# Batch cost, in-process ({args.device}, size={args.size}, dtype={args.dtype}, steps={args.steps}, "
        f"{mode} CFG{', compile=' + args.compile if args.compile else ''})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores"
        f"{'; ' + torch.cuda.get_device_name(0) if device.type == 'cuda' else ''}; torch {torch.__version__}. "
        f"p50 of {args.reps} batches after warm-up ({warm_s:.0f} s to compile and warm every size). One run.",
        "",
        "| batch B | p50 ms per batch | vs B=1 | ms per request | max abs diff, a request in the batch vs alone "
        "| largest abs action |",
        "|---:|---:|---:|---:|---:|---:|",
        *[f"| {b} | {ms:.2f} | {ms / base:.2f} | {ms / b:.2f} | {d:.1e} | {s:.2f} |" for b, ms, d, s in rows],
        "",
        f"Reproduce: `python bench/batching.py --device {args.device} --size {args.size} --dtype {args.dtype}"
        f"{' --compile ' + args.compile if args.compile else ''} --sizes {args.sizes}`",
        "",
    ]
    publish(lines, args.out or REPO / "bench" / "results" / f"batching-{args.device}.md")
    if args.json:
        Path(args.json).write_text(json.dumps({str(b): ms for b, ms, _, _ in rows}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
