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
import collections
import contextlib
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

    from policy_operator.runtime.engine.history import SessionHistory
    from policy_operator.runtime.policy.interface import Branch, collate, parse_dtype
    from policy_operator.runtime.policy.lerobot import LeRobotPolicy
    from policy_operator.runtime.policy.lerobot.loading import load_pretrained
    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

    device = torch.device(args.device)
    size = "tiny" if args.tiny else "base"
    started = time.perf_counter()

    def build(config: Any) -> Any:  # random init on the device: a 3.5B pi0 takes minutes on a host CPU
        from lerobot.policies.factory import get_policy_class

        with torch.device(args.device):
            return get_policy_class(family)(config)

    root = workdir / family
    if not (root / "config.json").exists():
        root = write_tiny_checkpoint(family, root, size=size, seed=0, build=build)
    write_s = time.perf_counter() - started

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize()

    def lerobot_load(path: Path) -> Any:  # LeRobot's own load, built on the device (its inference is unchanged)
        with torch.device(device) if device.type == "cuda" else contextlib.nullcontext():
            return load_pretrained(path, device)

    row: dict[str, Any] = {"family": family, "write_s": write_s}
    robots = args.robots
    seeds = [100 + i for i in range(robots)]
    if not args.lerobot_compile_only:
        LeRobotPolicy.compile_prefix = not args.no_compile_prefix
        t0 = time.perf_counter()
        ours = LeRobotPolicy.load(str(root), device=device, dtype=parse_dtype(args.dtype))
        sync()
        row["load_s"] = time.perf_counter() - t0
        if args.compile:
            import torch._dynamo

            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 32)
            ours.compile(args.compile)
        history = SessionHistory(ours)
        observations = [ours.example_observation(i) for i in range(robots)]
        integ = ours.integrator()

        def serve(indices: list[int], marks: list[tuple[str, Any, float]] | None = None) -> list[np.ndarray]:
            def mark(stage: str) -> None:
                if marks is not None:
                    event = torch.cuda.Event(enable_timing=True) if device.type == "cuda" else None
                    if event is not None:
                        event.record()
                    marks.append((stage, event, time.perf_counter()))

            mark("start")
            batch = collate([history.extend(f"robot-{i}", ours.prepare(observations[i])) for i in indices])
            mark("preprocess")
            with torch.inference_mode():
                x = torch.cat([ours.init_noise(seeds[i]) for i in indices])
                context = ours.condition(batch, Branch.COND)
                mark("prefix")
                for i in range(integ.steps):
                    x = integ.step(x, ours.denoise_step(context, x, integ.time(i, len(indices), x.device)), i)
                mark("denoise")
            out = ours.postprocess_batch(x, batch)
            mark("postprocess")
            return out

        t0 = time.perf_counter()
        for _ in range(3):  # warm (and compile every shape) before timing
            serve([0])
            serve(list(range(robots)))
        sync()
        row["warmup_s"] = time.perf_counter() - t0
        row.update(
            {
                "params_m": sum(p.numel() for p in ours.loaded.policy.parameters()) / 1e6,
                "steps": integ.steps,
                "chunk": list(ours.action_shape),
                "ours_1": p50_ms(lambda: serve([0]), args.reps, sync),
                "ours_8": p50_ms(lambda: serve(list(range(robots))), args.reps, sync),
            }
        )
        for label, indices in (("1", [0]), (str(robots), list(range(robots)))):
            row[f"split_{label}"] = stage_split(lambda m, ix=indices: serve(ix, m), args.reps, sync)
            if device.type == "cuda":
                row[f"busy_{label}"] = busy_share(lambda ix=indices: serve(ix), sync)
    from policy_operator.runtime.policy.lerobot.wire import ObservationSpec

    t0 = time.perf_counter()
    # a second copy: LeRobot's own path, same weights (compile_model=True: its own torch.compile, compile_mode)
    lerobot = load_pretrained_compiled(root, device, lerobot_load) if args.lerobot_compile_only else lerobot_load(root)
    spec = ObservationSpec(lerobot.config.input_features, needs_task=family != "diffusion")
    history_len = int(getattr(lerobot.config, "n_obs_steps", 1)) if family == "diffusion" else 1
    noise_shape = (
        (1, int(lerobot.config.chunk_size), int(lerobot.config.max_action_dim))
        if family != "diffusion"
        else (1, int(lerobot.config.horizon), int(lerobot.config.output_features["action"].shape[0]))
    )

    def lerobot_request(i: int, loaded: Any) -> np.ndarray:
        frame = spec.parse(spec.example(i))
        batch = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in loaded.preprocessor(frame).items()}
        if history_len > 1:
            batch = {
                k: (torch.stack([v] * history_len, dim=1) if isinstance(v, torch.Tensor) else v)
                for k, v in batch.items()
            }
        noise = torch.randn(noise_shape, generator=torch.Generator().manual_seed(seeds[i])).to(device)
        loaded.policy.reset()
        with torch.inference_mode():
            return loaded.postprocessor(loaded.policy.predict_action_chunk(batch, noise=noise))[0].float().numpy()

    if args.lerobot_compile_only:
        for _ in range(3):
            lerobot_request(0, lerobot)
        sync()
        row["lerobot_compile_s"] = time.perf_counter() - t0
        row["lerobot_compiled_1"] = p50_ms(lambda: lerobot_request(0, lerobot), args.reps, sync)
        print(row, flush=True)
        return row
    for _ in range(2):
        lerobot_request(0, lerobot)
    sync()
    row["diff"] = max(float(np.abs(serve([i])[0] - lerobot_request(i, lerobot)).max()) for i in range(robots))
    row["scale"] = max(float(np.abs(lerobot_request(i, lerobot)).max()) for i in range(robots))
    row["lerobot_1"] = p50_ms(lambda: lerobot_request(0, lerobot), args.reps, sync)
    dtypes: collections.Counter[Any] = collections.Counter()
    for param in lerobot.policy.parameters():
        dtypes[param.dtype] += param.numel()
    row["lerobot_dtype"] = str(dtypes.most_common(1)[0][0]).removeprefix("torch.")
    lerobot = None  # its memory back before the next family
    print(row, flush=True)
    return row


def stage_split(run: Callable[[list[tuple[str, Any, float]]], Any], reps: int, sync: Callable[[], None]) -> dict:
    """Median milliseconds of each stage (device events where there are, else the host clock)."""
    per: dict[str, list[float]] = {}
    for _ in range(reps):
        marks: list[tuple[str, Any, float]] = []
        run(marks)
        sync()
        for (_, e0, h0), (stage, e1, h1) in zip(marks, marks[1:], strict=False):
            per.setdefault(stage, []).append(e0.elapsed_time(e1) if e0 is not None else (h1 - h0) * 1e3)
    return {k: statistics.median(v) for k, v in per.items()}


def busy_share(run: Callable[[], Any], sync: Callable[[], None], reps: int = 5) -> float:
    """The device's busy share of a request's wall time: its kernels' and copies' time over the wall (profiler)."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            run()
        sync()
        wall_us = (time.perf_counter() - t0) * 1e6
    busy_us = sum(
        e.device_time_total for e in prof.events() if e.device_type.name == "CUDA" and e.device_time_total > 0
    )
    return min(1.0, busy_us / wall_us)


def load_pretrained_compiled(root: Path, device: Any, load: Callable[[Path], Any]) -> Any:
    """LeRobot's own compile option (``compile_model``: torch.compile of sample_actions, its compile_mode)."""
    import json

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
    return load(compiled_root)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--families", default=None, help="comma-separated; default smolvla,pi05 (--tiny: smolvla,diffusion)")
    p.add_argument("--tiny", action="store_true", help="tiny configs (CPU-sized) instead of the published sizes")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32", help="this server's --dtype (LeRobot runs its config's)")
    p.add_argument(
        "--compile", default=None, metavar="MODE", help="this server's --compile (reduce-overhead: CUDA graphs)"
    )
    p.add_argument("--no-compile-prefix", action="store_true", help="compile the denoiser only, as before issue 37")
    p.add_argument(
        "--lerobot-compile-only",
        action="store_true",
        help="time LeRobot with its compile_model option alone (its compile_mode), nothing else",
    )
    p.add_argument("--workdir", default=None, help="checkpoints are written here once and reused")
    p.add_argument("--robots", type=int, default=8)
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default=None)
    args = p.parse_args()

    import torch

    if args.device == "cpu":
        torch.set_num_threads(1)
    families = (args.families or ("smolvla,diffusion" if args.tiny else "smolvla,pi05")).split(",")
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench-lerobot-"))
    rows = [bench_family(f, args, workdir) for f in families]
    n = args.robots
    gpu = f"; {torch.cuda.get_device_name(0)}" if args.device == "cuda" else ""
    reproduce = (
        f"Reproduce: `python bench/lerobot_vs_server.py --device {args.device}{' --tiny' if args.tiny else ''}"
        f" --dtype {args.dtype}{' --compile ' + args.compile if args.compile else ''}"
        f"{' --no-compile-prefix' if args.no_compile_prefix else ''}"
        f"{' --lerobot-compile-only' if args.lerobot_compile_only else ''} --families {','.join(families)}`"
    )
    if args.lerobot_compile_only:
        lines = [
            f"# LeRobot with compile_model=True ({args.device}{gpu}, {'tiny' if args.tiny else 'published'} sizes)",
            "",
            "| family | 1 robot p50 ms | load + compile + 3 warm-up requests s |",
            "|---|---:|---:|",
            *(f"| {r['family']} | {r['lerobot_compiled_1']:.2f} | {r['lerobot_compile_s']:.0f} |" for r in rows),
            "",
            reproduce,
            "",
        ]
        publish(lines, args.out or REPO / "bench" / "results" / f"lerobot-compiled-{args.device}.md")
        return 0
    lines = [
        f"# LeRobot policies: this server vs LeRobot's own inference ({args.device}, "
        f"{'tiny' if args.tiny else 'published'} sizes, {args.dtype}"
        f"{', compile=' + args.compile if args.compile else ', eager'}"
        f"{', denoiser only' if args.compile and args.no_compile_prefix else ''})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores{gpu}; torch {torch.__version__}. "
        f"Random weights written offline, the same for both sides; p50 of {args.reps} after warm-up; one run, in one "
        f"process (no WebSocket). 1 robot: one request, preprocessor to postprocessor. {n} robots: ours = one batch "
        f"of {n}, LeRobot = one at a time (1 / its p50). LeRobot runs its config's dtype: "
        + ", ".join(f"{r['family']} {r['lerobot_dtype']}" for r in rows)
        + " (most of its weights).",
        "",
        "| family | params (M) | steps | chunk | 1 robot p50 ms: ours | LeRobot eager | ours / LeRobot | "
        f"{n} robots req/s: ours | LeRobot one at a time | max abs diff vs LeRobot (/ action scale) | load s | "
        "warm-up s |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ours_rps, lerobot_rps = n / r["ours_8"] * 1e3, 1e3 / r["lerobot_1"]
        lines.append(
            f"| {r['family']} | {r['params_m']:.1f} | {r['steps']} | {r['chunk'][0]}x{r['chunk'][1]} | "
            f"{r['ours_1']:.2f} | {r['lerobot_1']:.2f} | {r['ours_1'] / r['lerobot_1']:.2f} | "
            f"{ours_rps:.1f} | {lerobot_rps:.1f} | {r['diff']:.1e} ({r['diff'] / r['scale']:.1e}) | "
            f"{r['load_s']:.1f} | {r['warmup_s']:.0f} |"
        )
    lines += [
        "",
        "Where one request and one batch go (ms, p50 per stage: device events; preprocess = the host's prepare of "
        "every row; prefix = cameras staged on the device + vision tower + VLM prefix; denoise = the step loop; "
        "postprocess = unnormalize + copy to the host), and the device's busy share of the wall time (profiler):",
        "",
        "| family | batch | preprocess | prefix | denoise | postprocess | sum | device busy |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        for label in ("1", str(n)):
            sp = r[f"split_{label}"]
            busy = f"{r[f'busy_{label}']:.0%}" if f"busy_{label}" in r else "-"
            lines.append(
                f"| {r['family']} | {label} | {sp['preprocess']:.2f} | {sp['prefix']:.2f} | {sp['denoise']:.2f} | "
                f"{sp['postprocess']:.2f} | {sum(sp.values()):.2f} | {busy} |"
            )
    lines += ["", reproduce, ""]
    tag = f"{args.device}{'-tiny' if args.tiny else ''}"
    publish(lines, args.out or REPO / "bench" / "results" / f"lerobot-{tag}.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
