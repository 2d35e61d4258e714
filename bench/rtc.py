"""Real-time chunking: what each ``--rtc`` mode costs against plain sampling, in-process, side by side.

For each batch size B: the p50 time of one batch (collate -> sample_actions ->
postprocess_batch, device synchronised) without RTC, with ``inpaint`` and
with ``guided`` (every row constrained: d=4 frozen actions, the previous
chunk's tail of H-6 actions), the modes interleaved within every repetition
so they share the machine's state.  Also per mode: the mean boundary jump
(largest change of an action dimension between the last executed old action
and the first new one) over the batch's rows, the measure the issue's
``policyserver client --rtc`` prints.

    python bench/rtc.py                          # CPU, small model, fp32
    python bench/rtc.py --device cuda --size base --dtype bfloat16 --compile reduce-overhead --sizes 1,8
    python bench/rtc.py --policy lerobot --family smolvla   # a LeRobot policy (tiny, random weights, offline)

A LeRobot policy has no unconditional branch (guidance 1.0, one model call per step) and its chunk may be
short (the tiny SmolVLA's is 8): the delay and the executed prefix shrink to fit (d <= H/4, executed <= H/3).
"""

from __future__ import annotations

import argparse
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
MODES = ("off", "inpaint", "guided")
DELAY = 4
EXECUTED = 6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--policy", default="reference", choices=["reference", "lerobot"])
    p.add_argument("--family", default="smolvla", help="with --policy lerobot: smolvla, pi0 or pi05")
    p.add_argument("--size", default=None, choices=["tiny", "small", "base"], help="default: small (lerobot: tiny)")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--compile", default=None, metavar="MODE")
    p.add_argument("--steps", type=int, default=None, help="default: 10 (lerobot: the policy's own)")
    p.add_argument("--guidance", type=float, default=None, help="default: 3.0 (lerobot: 1.0, no unconditional)")
    p.add_argument("--sizes", default="1,4")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads on the CPU (default: all)")
    p.add_argument("--checkpoint", default=None)
    p.add_argument("--out", default=None)
    p.add_argument(
        "--static-batch",
        action="store_true",
        help="a graph per batch size (dynamo's automatic dynamic shapes off), as the worker compiles under --rtc guided",
    )
    args = p.parse_args()

    import torch
    import torch._dynamo

    from policy_operator.runtime.policy import collate
    from policy_operator.runtime.policy.interface import Policy, parse_dtype
    from policy_operator.runtime.policy.reference import ReferencePolicy, example_observation, init_checkpoint
    from policy_operator.runtime.policy.rtc import RtcConstraint
    from policy_operator.runtime.policy.sampler import sample_actions

    sizes = [int(x) for x in args.sizes.split(",")]
    lerobot = args.policy == "lerobot"
    size = args.size or ("tiny" if lerobot else "small")
    steps = args.steps if args.steps is not None or lerobot else 10
    guidance = args.guidance if args.guidance is not None else (1.0 if lerobot else 3.0)
    if args.device == "cpu" and args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    policy: Policy
    if lerobot:
        from policy_operator.runtime.policy.lerobot import LeRobotPolicy
        from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

        checkpoint = Path(args.checkpoint) if args.checkpoint else Path(tempfile.mkdtemp(prefix="bench-rtc-")) / size
        if not args.checkpoint:
            write_tiny_checkpoint(args.family, checkpoint, size=size)
        policy = LeRobotPolicy.load(str(checkpoint), device=device, dtype=parse_dtype(args.dtype))
        observations = [policy.example_observation(i) for i in range(max(sizes))]
    else:
        checkpoint = (
            Path(args.checkpoint)
            if args.checkpoint
            else init_checkpoint(Path(tempfile.mkdtemp(prefix="bench-rtc-")) / size, size)
        )
        reference = ReferencePolicy.load(str(checkpoint), device=device, dtype=parse_dtype(args.dtype))
        observations = [example_observation(reference.cfg, i) for i in range(max(sizes))]
        policy = reference
    horizon = policy.action_shape[0]
    delay, executed = min(DELAY, horizon // 4), min(EXECUTED, horizon // 3)
    if args.static_batch:
        torch._dynamo.config.automatic_dynamic_shapes = False
    if args.compile:
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 8 * len(sizes) + 8)
        policy.compile(args.compile)
    cfg_mode = "batched" if args.device == "cuda" and guidance != 1.0 else "sequential"
    largest = max(sizes)
    samples = [policy.prepare(obs) for obs in observations]
    seeds = [1000 + i for i in range(largest)]

    def sample(
        b: int, seeds_: list[int], rtc_mode: str = "off", rows: list[RtcConstraint] | None = None
    ) -> list[np.ndarray]:
        x = sample_actions(
            policy,
            collate(samples[:b]),
            seeds_[:b],
            steps=steps,
            guidance=guidance,
            mode=cfg_mode,
            rtc_mode=rtc_mode,
            rtc=rows,
        )  # type: ignore[arg-type]
        out = policy.postprocess_batch(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return out

    previous = sample(largest, [s + 7919 for s in seeds])  # the chunks the robots are executing
    tails = [prev[executed:] for prev in previous]
    constraints = [RtcConstraint(policy.actions_to_model(tail), delay, len(tail)) for tail in tails]

    def run(b: int, mode: str) -> list[np.ndarray]:
        return sample(b, seeds, mode, constraints[:b] if mode != "off" else None)

    started = time.perf_counter()
    for b in sizes:  # compile, warm, record and replay every shape (and the guided backward) before timing
        for mode in MODES:
            for _ in range(3):
                run(b, mode)
    warm_s = time.perf_counter() - started
    rows = []
    for b in sizes:
        times: dict[str, list[float]] = {m: [] for m in MODES}
        jumps: dict[str, float] = {}
        gaps: dict[str, float] = {}
        for rep in range(args.reps):
            for mode in MODES[rep % 3 :] + MODES[: rep % 3]:  # each mode first as often as the others
                t0 = time.perf_counter()
                got = run(b, mode)
                times[mode].append((time.perf_counter() - t0) * 1e3)
                jumps[mode] = float(np.mean([np.abs(got[i][delay] - tails[i][delay - 1]).max() for i in range(b)]))
                gaps[mode] = float(np.mean([np.abs(got[i][delay] - tails[i][delay]).max() for i in range(b)]))
        p50 = {m: statistics.median(times[m]) for m in MODES}
        rows.append((b, p50, jumps, gaps))
        print(
            f"B={b:>3}: "
            + "  ".join(f"{m} {p50[m]:8.2f} ms (jump {jumps[m]:.3f}, vs old plan {gaps[m]:.3f})" for m in MODES),
            flush=True,
        )
    name = f"LeRobot {args.family}" if lerobot else "reference policy"
    cfg = f"{cfg_mode} CFG g={guidance:g}" if guidance != 1.0 else "no CFG"
    lines = [
        f"# Real-time chunking cost, in-process: {name} ({args.device}, size={size}, dtype={args.dtype}, "
        f"steps={policy.integrator(steps).steps}, {cfg}{', compile=' + args.compile if args.compile else ''}"
        f"{', a graph per batch size' if args.static_batch else ''})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores"
        f"{'; ' + torch.cuda.get_device_name(0) if device.type == 'cuda' else ''}; torch {torch.__version__}, "
        f"{torch.get_num_threads()} intra-op threads. p50 of {args.reps} batches per mode, the three modes "
        f"interleaved in every repetition (rotating which goes first), after warm-up ({warm_s:.0f} s). Every row constrained: d={delay}, "
        f"the previous chunk's last {horizon - executed} of {horizon} actions. One run.",
        "",
        "| batch B | plain ms | inpaint ms | × plain | guided ms | × plain | jump plain / inpaint / guided "
        "| vs old plan plain / inpaint / guided |",
        "|---:|---:|---:|---:|---:|---:|---|---|",
        *[
            f"| {b} | {t['off']:.2f} | {t['inpaint']:.2f} | {t['inpaint'] / t['off']:.2f} | {t['guided']:.2f} | "
            f"{t['guided'] / t['off']:.2f} | {j['off']:.3f} / {j['inpaint']:.3f} / {j['guided']:.3f} | "
            f"{g['off']:.3f} / {g['inpaint']:.3f} / {g['guided']:.3f} |"
            for b, t, j, g in rows
        ],
        "",
        "Jump: mean over the batch's rows of the largest change of an action dimension from the last executed old "
        "action to the first new one; vs old plan: the same from the action the old chunk had for that tick (what "
        "the switch itself adds; with random weights the policy's own steps between consecutive actions are as "
        "large as a switch, so the jump cannot fall below them).",
        *(
            [
                "",
                "A LeRobot policy: no unconditional branch, so one model call per step (the reference's CFG makes "
                "two); a small random-weight model on a CPU that other work shares, so the ratios, not the "
                "milliseconds, are the result.",
            ]
            if lerobot
            else []
        ),
        "",
        f"Reproduce: `python bench/rtc.py{' --policy lerobot --family ' + args.family if lerobot else ''} "
        f"--device {args.device} --size {size} --dtype {args.dtype}{' --steps ' + str(steps) if args.steps else ''}"
        f"{' --compile ' + args.compile if args.compile else ''} --sizes {args.sizes} --reps {args.reps}"
        f"{' --threads ' + str(args.threads) if args.threads else ''}{' --static-batch' if args.static_batch else ''}`",
        "",
    ]
    stem = f"rtc-lerobot-{args.family}" if lerobot else "rtc"
    publish(lines, args.out or REPO / "bench" / "results" / f"{stem}-{args.device}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
