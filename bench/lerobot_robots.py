"""A LeRobot checkpoint served as a pod serves it, driven over the openpi WebSocket by robots, one process each.

One ``policyserver serve --policy lerobot`` per ``--variant`` (its serve
flags); for each: process start to /readyz ready (load, compile, capture),
then 1 and N robots in a closed loop (each sends its next frame when its
reply is in), every robot a process of its own with its own connection,
observations built from the server's metadata (``observation_keys``: uint8
camera frames, float state, the task string).  Per row: p50 / p99 round
trip, requests/s, mean batch, and the server's own split of a request
(decode, prepare, queue, infer) from each reply's ``server_timing``.

    python bench/lerobot_robots.py --checkpoint CKPT --robots 1,8 \\
        --variant 'bf16 graphs=--dtype bfloat16 --compile reduce-overhead --max-batch 8'
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shlex
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from harness import serve
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]
STAGES = ("decode_ms", "prepare_ms", "queue_ms", "infer_ms")


def observation(keys: dict[str, Any], seed: int) -> dict[str, Any]:
    """A frame of the metadata's ``observation_keys``: uint8 HWC cameras, float vectors, the task."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {}
    for key, spec in keys.items():
        if spec.get("dtype") == "str":
            obs[key] = "pick up the cube and put it in the bowl"
        elif spec["dtype"] == "uint8":
            obs[key] = rng.integers(0, 256, size=tuple(spec["shape"]), dtype=np.uint8)
        else:
            obs[key] = rng.standard_normal(tuple(spec["shape"])).astype(np.float32)
    return obs


def robot(url: str, n: int, warmup: int, worker: int, barrier: Any) -> dict[str, Any]:
    from websockets.sync.client import connect

    from policy_operator.runtime.serving import wire

    records: list[dict[str, float]] = []
    with connect(url, max_size=None, open_timeout=600, compression=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=600))
        frames = [wire.packb(observation(meta["observation_keys"], worker * 1009 + i)) for i in range(warmup + n)]
        for frame in frames[:warmup]:
            ws.send(frame)
            ws.recv(timeout=600)
        if barrier is not None:
            barrier.wait(600)
        start = time.monotonic()
        for frame in frames[warmup:]:
            t0 = time.perf_counter()
            ws.send(frame)
            reply = ws.recv(timeout=600)
            rtt = (time.perf_counter() - t0) * 1e3
            if isinstance(reply, str):
                raise RuntimeError(f"server error: {reply}")
            timing = wire.unpackb(reply)["server_timing"]
            records.append(
                {"rtt_ms": rtt, "batch": float(timing.get("batch_size", 1))}
                | {k: float(timing.get(k) or "nan") for k in (*STAGES, "total_ms")}
            )
        end = time.monotonic()
    return {"records": records, "start": start, "end": end}


def drive(url: str, robots: int, n: int, warmup: int) -> dict[str, float]:
    ctx = multiprocessing.get_context("spawn")
    with ctx.Manager() as manager, ProcessPoolExecutor(robots, mp_context=ctx) as pool:
        barrier = manager.Barrier(robots) if robots > 1 else None
        sessions = [f.result() for f in [pool.submit(robot, url, n, warmup, w, barrier) for w in range(robots)]]
    records = [r for s in sessions for r in s["records"]]
    wall = max(s["end"] for s in sessions) - min(s["start"] for s in sessions)
    row = {
        "p50": float(np.percentile([r["rtt_ms"] for r in records], 50)),
        "p99": float(np.percentile([r["rtt_ms"] for r in records], 99)),
        "rps": len(records) / wall,
        "batch": float(np.mean([r["batch"] for r in records])),
    }
    for k in (*STAGES, "total_ms"):
        row[k] = float(np.nanpercentile([r[k] for r in records], 50))
    row["outside_ms"] = float(np.percentile([r["rtt_ms"] - r["total_ms"] for r in records], 50))
    return row


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--variant", action="append", required=True, help="'NAME=serve flags', once per server")
    p.add_argument("--robots", default="1,8")
    p.add_argument("--n", type=int, default=30, help="measured requests per robot")
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--logs", default="/tmp", help="each server's log goes here")
    p.add_argument("--label", default="", help="what the checkpoint is, for the table's title")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    robots = [int(r) for r in args.robots.split(",")]
    rows: list[dict[str, Any]] = []
    gpu = gpu_name()
    out = args.out or REPO / "bench" / "results" / "lerobot-robots.md"
    for index, variant in enumerate(args.variant):
        name, _, flags = variant.partition("=")
        log = Path(args.logs) / f"serve-{index}.log"
        started = time.monotonic()
        with serve(
            args.checkpoint, policy="lerobot", log_level="INFO", flags=shlex.split(flags), log=log, ready_timeout_s=1200
        ) as served:
            ready_s = time.monotonic() - started
            for r in robots:
                row = drive(served.url, r, args.n, args.warmup) | {"variant": name, "robots": r, "ready_s": ready_s}
                rows.append(row)
                print(row, flush=True)
                publish(table(rows, args, gpu), out)  # a call cut short still leaves the rows it measured
        start = [line.split("warmed up ", 1)[1] for line in log.read_text().splitlines() if "warmed up" in line]
        rows[-1]["start_line"] = start[0] if start else ""
        publish(table(rows, args, gpu), out)
    return 0


def gpu_name() -> str:
    gpu = ""
    try:
        gpu = subprocess.run(
            ["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        pass
    return gpu


def table(rows: list[dict[str, Any]], args: argparse.Namespace, gpu: str) -> list[str]:
    lines = [
        f"# {args.label or args.checkpoint}: over the WebSocket, one process per robot, closed loop",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores{'; ' + gpu if gpu else ''}. {args.warmup} warm-up "
        f"requests per robot, then {args.n} each; one run. Ready: process start to /readyz. Server split (p50 of "
        "each reply's server_timing): decode, prepare (LeRobot's preprocessor minus the cameras), queue, infer "
        "(prefix + denoise + postprocess, the batch's); outside: round trip minus the server's receive-to-reply.",
        "",
        "| variant | robots | p50 ms | p99 ms | req/s | mean batch | decode | prepare | queue | infer | outside | "
        "ready s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['variant']} | {r['robots']} | {r['p50']:.1f} | {r['p99']:.1f} | {r['rps']:.1f} | {r['batch']:.2f} "
            f"| {r['decode_ms']:.2f} | {r['prepare_ms']:.2f} | {r['queue_ms']:.2f} | {r['infer_ms']:.1f} | "
            f"{r['outside_ms']:.2f} | {r['ready_s']:.0f} |"
        )
    lines += ["", *(f"- {r['variant']} start: {r['start_line']}" for r in rows if r.get("start_line"))]
    variants = " ".join(f"--variant {shlex.quote(v)}" for v in args.variant)
    lines += [
        "",
        f"Reproduce: `python bench/lerobot_robots.py --checkpoint CKPT --robots {args.robots} --n {args.n} {variants}`",
        "",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
