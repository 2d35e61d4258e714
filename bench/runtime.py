"""Runtime benchmark: CFG strategies, CFG-parallel, data-parallel and server overhead, side by side.

Every row comes from the same run on the same machine, so ratios compare like
with like.  Servers are real ``policyserver serve`` processes (torchrun for
multi-rank layouts); latency is the server's own ``infer_ms`` unless marked as
a WebSocket round trip.

    python bench/runtime.py                       # CPU, tiny model, 1 thread per rank
    python bench/runtime.py --device cuda --size base --dtype bfloat16   # on the GPU
    python bench/runtime.py --tables batching --max-batch 1,8,16 --batch-clients 1,4,8,16,32
    python bench/runtime.py --tables robots        # issue 24's table: robots x max-batch, and in-process batches
    python bench/runtime.py --tables robots --frontend inline,process   # the same, both front-ends side by side

The batching table starts one server per ``--max-batch`` value and drives each
with 1, 4, 8, ... closed-loop clients (every client sends its next request when
its reply arrives, as a robot does): p50/p99 round trip, requests/s and the
mean batch size a request ran in, all servers in one run.

The robots table is issue 24's: one server per ``--robot-max-batch`` (1, 8, 32),
each driven by 1, 4, 8, 16, 32 robots, one process per robot, closed loop,
``--robot-warmup`` requests per robot (all robots at once) before
``--robot-n`` measured ones; then the same model in-process
(``bench/batching.py``: one sampler call on B requests, no server) for the
batch sizes the targets compare with, and the targets as ratios of this run.

CPU caveat (2 cores here): cfgp=2 is compared with a 1-thread single rank, the
fair baseline when each rank owns one core; a GPU run compares one GPU per rank.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import numpy as np
from harness import free_port as free_port  # the scripts that still take these from here
from harness import serve  # bench/ is sys.path[0] when a benchmark runs as a script
from harness import stop_group as stop_group
from harness import wait_ready as wait_ready
from prometheus_client.parser import text_string_to_metric_families
from report import publish

REPO = Path(__file__).resolve().parents[1]


def split_variant(variant: str) -> tuple[dict[str, str], list[str]]:
    """A ``--serve-variant``: its leading NAME=VALUE words as the server's environment (``os.environ`` with them;
    PYTHONPATH=... runs another tree), the rest as more serve flags."""
    words = shlex.split(variant)
    env = dict(os.environ)
    while words and "=" in words[0] and not words[0].startswith("-"):
        name, _, value = words.pop(0).partition("=")
        env[name] = value
    return env, words


def frontend_argv(frontend: str) -> list[str]:
    """``inline``, ``process`` or ``process:N`` (N front-end processes) as serve flags."""
    mode, _, processes = frontend.partition(":")
    return ["--frontend", mode, *(["--frontend-processes", processes] if processes else [])]


class Server:
    def __init__(
        self,
        checkpoint: Path,
        args: argparse.Namespace,
        cfgp: int,
        dp: int,
        cfg_mode: str,
        max_batch: int = 1,
        event_loop: str = "auto",
        frontend: str = "inline",
    ) -> None:
        started = time.monotonic()
        port = free_port()
        # --server-log: the server's INFO log (its start phases) in a file; else its last words, should it fail
        self.log = Path(args.server_log) / f"server-{port}.log" if args.server_log else None
        if self.log is not None:
            self.log.parent.mkdir(parents=True, exist_ok=True)
        log = self.log or Path(tempfile.mkdtemp(prefix="bench-server-")) / "server.log"
        self._stack = contextlib.ExitStack()
        served = self._stack.enter_context(
            serve(
                checkpoint,
                port=port,
                log=log,
                flags=[*frontend_argv(frontend), *shlex.split(args.serve_args)],
                cfgp=cfgp,
                dp=dp,
                steps=args.steps,
                guidance=3.0,
                device=args.device,
                dtype=args.dtype,
                cfg_mode=cfg_mode,
                log_level="INFO" if args.server_log else "WARNING",
                max_batch=max_batch,
                batch_window_ms=args.batch_window_ms,
                event_loop=event_loop,
                threads=1 if args.device == "cpu" else None,
                compile=args.compile,
                backend=None if args.backend == "auto" else args.backend,
                share_gpu=args.share_gpu,
            )
        )
        self.proc, self.port = served.proc, served.port
        self.ready_s = time.monotonic() - started  # process start to /readyz ready: load, compile, warm-up
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            families = text_string_to_metric_families(r.read().decode())
            gauges = {s.name: s.value for family in families for s in family.samples if not s.labels}
        self.load_s = gauges.get("policy_load_seconds", math.nan)  # onto the device (and compiled, lazily)
        self.warmup_s = gauges.get("policy_warmup_seconds", math.nan)  # every bucket compiled or loaded, captured
        self.url = f"ws://127.0.0.1:{self.port}"
        # the start's phases as the server logs them (runtime/worker.py: "warmed up ... after its process started")
        self.start_line = next(
            (
                line.split("warmed up ", 1)[1]
                for line in (self.log.read_text() if self.log else "").splitlines()
                if "warmed up" in line
            ),
            "",
        )

    def close(self) -> None:
        self._stack.close()  # the harness stops the server's process group


def fixed_seed_actions(url: str) -> np.ndarray:
    from websockets.sync.client import connect

    from policy_operator.runtime.client import robolab_observation
    from policy_operator.runtime.serving import wire

    with connect(url, compression=None, max_size=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=60))
        ws.send(wire.packb(robolab_observation(meta, 5, fixed_seed=1234)))
        return np.array(wire.unpackb(ws.recv(timeout=600))["actions"])


def measure(url: str, n: int, concurrency: int = 1, warmup: int = 3) -> dict[str, float]:
    """``policyserver client``'s own loop (runtime/client.py), after a warm-up session."""
    from policy_operator.runtime.client import run_client

    run_client(url, warmup, seed=999)
    s = run_client(url, n, concurrency, seed=0, timeout=600)
    if s["errors"]:
        raise RuntimeError(f"benchmark requests failed: {s['errors'][:3]}")
    rtt, infer, total, queue = (
        np.array([r[k] for r in s["records"]]) for k in ("rtt_ms", "infer_ms", "total_ms", "queue_ms")
    )
    return {
        "rtt_p50": float(np.percentile(rtt, 50)),
        "rtt_p99": float(np.percentile(rtt, 99)),
        "infer_p50": float(np.percentile(infer, 50)),
        "wall_s": s["wall_s"],
        "n": len(rtt),
        "rps": s["requests_per_s"],
        "overhead_p50": float(np.percentile(rtt - infer, 50)),
        "server_overhead_p50": float(np.percentile(total - infer, 50)),
        "queue_p50": float(np.percentile(queue, 50)),
        "mean_batch": s["mean_batch_size"],
        "prepare_p50": float(np.percentile([r["prepare_ms"] for r in s["records"]], 50)),
        "decode_p50": float(np.percentile([r["decode_ms"] for r in s["records"]], 50)),
        # what is left of total_ms: routing, the lane's wake-up and the hop back to the event loop
        "return_p50": float(
            np.percentile(
                [
                    r["total_ms"] - r["infer_ms"] - r["queue_ms"] - r["prepare_ms"] - r["decode_ms"]
                    for r in s["records"]
                ],
                50,
            )
        ),
    }


def in_process_infer(checkpoint: Path, args: argparse.Namespace, n: int) -> float:
    """The same request without any server: prepare + sample + postprocess, one thread."""
    import torch

    from policy_operator.runtime.policy.interface import parse_dtype
    from policy_operator.runtime.policy.reference import ReferencePolicy
    from policy_operator.runtime.policy.sampler import sample_actions

    if args.device == "cpu":
        torch.set_num_threads(1)
    device = torch.device("cuda" if args.device == "cuda" else "cpu")
    policy = ReferencePolicy.load(str(checkpoint), device=device, dtype=parse_dtype(args.dtype))
    if args.compile:
        policy.compile(args.compile)  # the same speed-ups as the servers, so the difference is the server
    obs = policy.example_observation(0)
    mode = "sequential"  # the row it is compared with
    times = []
    for i in range(n + 3):
        t0 = time.perf_counter()
        x = sample_actions(policy, policy.prepare(obs), [i], steps=args.steps, guidance=3.0, mode=mode)
        policy.postprocess(x)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[3:])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="small", choices=["tiny", "small", "base"])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--dtype", default="float32")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n", type=int, default=20, help="requests per client per measurement")
    p.add_argument("--dp", type=int, default=2, help="replicas for the data-parallel rows")
    p.add_argument("--compile", default=None, metavar="MODE", help="torch.compile mode for the servers")
    p.add_argument("--backend", default="auto", help="collective backend of the multi-rank servers")
    p.add_argument("--share-gpu", action="store_true", help="ranks share one GPU (functional check only)")
    p.add_argument("--checkpoint", default=None, help="reuse a checkpoint instead of initialising one")
    p.add_argument(
        "--tables",
        default="layouts,batching",
        help="comma-separated: layouts (CFG strategies, cfgp, dp, overhead; --max-batch 1), batching",
    )
    p.add_argument("--max-batch", default="1,8,16", help="servers of the batching table, one per value")
    p.add_argument("--batch-clients", default="1,4,8,16,32", help="client counts of the batching table")
    p.add_argument("--batch-window-ms", type=float, default=2.0, help="every server's --batch-window-ms")
    p.add_argument(
        "--asyncio-column",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the batching table's 1-client split also on asyncio's own loop (one more server)",
    )
    p.add_argument("--serve-args", default="", help="more flags for every server, e.g. '--gil-switch-ms 0.5'")
    p.add_argument("--robot-max-batch", default="1,8,32", help="servers of the robots table, one per value")
    p.add_argument("--robots", default="1,4,8,16,32", help="robot counts of the robots table")
    p.add_argument("--robot-n", type=int, default=40, help="measured requests per robot in the robots table")
    p.add_argument("--robot-warmup", type=int, default=5, help="warm-up requests per robot before each row")
    p.add_argument(
        "--frontend",
        default="inline",
        help="comma-separated --frontend modes of the robots table's servers (inline,process: side by side); "
        "process:N runs N front-end processes (--frontend-processes N)",
    )
    p.add_argument(
        "--in-process",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the robots table's in-process batch times beside it (bench/batching.py)",
    )
    p.add_argument(
        "--server-log",
        default=None,
        metavar="DIR",
        help="servers log at INFO into DIR/server-PORT.log; the robots table quotes each one's start phases",
    )
    p.add_argument("--out", default=None, help="markdown file (default bench/results/runtime-<device>.md)")
    args = p.parse_args()
    tables = set(args.tables.split(","))

    from policy_operator.runtime.policy.reference import init_checkpoint

    if args.checkpoint:
        checkpoint = Path(args.checkpoint)
    else:
        checkpoint = init_checkpoint(Path(tempfile.mkdtemp(prefix="bench-runtime-")) / args.size, args.size)
    fast = "sequential" if args.device == "cpu" else "batched"
    lines = [
        f"# Runtime benchmark ({args.device}, size={args.size}, steps={args.steps}, dtype={args.dtype}"
        f"{', compile=' + args.compile if args.compile else ''}, backend={args.backend})",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores{'; ' + _gpu_name() if args.device == 'cuda' else ''}. "
        f"{args.n} requests per client per row (the batching table: at least {8 * args.n} per row). "
        "One run, side by side.",
        "",
    ]
    if "layouts" in tables:
        lines += layouts_table(checkpoint, args, fast)
    if "batching" in tables:
        lines += batching_table(checkpoint, args, fast)
    if "robots" in tables:
        lines += robots_table(checkpoint, args, fast)
    lines += [
        f"Reproduce: `python bench/runtime.py --device {args.device} --size {args.size} --steps {args.steps} "
        f"--dtype {args.dtype}{' --compile ' + args.compile if args.compile else ''} --backend {args.backend}"
        f"{' --share-gpu' if args.share_gpu else ''} --n {args.n} --tables {args.tables}"
        f"{' --max-batch ' + args.max_batch + ' --batch-clients ' + args.batch_clients if 'batching' in tables else ''}"
        f"{f' --batch-window-ms {args.batch_window_ms:g}' if 'batching' in tables else ''}"
        f"{' --serve-args ' + shlex.quote(args.serve_args) if args.serve_args else ''}"
        f"{f' --robot-max-batch {args.robot_max_batch} --robots {args.robots} --robot-n {args.robot_n} --robot-warmup {args.robot_warmup} --frontend {args.frontend}' if 'robots' in tables else ''}"
        f"{' --no-in-process' if 'robots' in tables and not args.in_process else ''}"
        f"{' --server-log ' + args.server_log if args.server_log else ''}`",
        "",
    ]
    publish(lines, args.out or REPO / "bench" / "results" / f"runtime-{args.device}.md")
    return 0


def per_client(n: int, clients: int) -> int:
    """Requests per client in a batching row: at least 8n per row, so few clients do not mean few samples."""
    return max(n, -(-8 * n // clients))


def batching_table(checkpoint: Path, args: argparse.Namespace, mode: str) -> list[str]:
    """One server per --max-batch value, each driven by every client count; the issue's targets as ratios."""
    sizes = [int(x) for x in args.max_batch.split(",")]
    clients = [int(x) for x in args.batch_clients.split(",")]
    results: dict[tuple[int, int], dict[str, float]] = {}
    for size in sizes:
        server = Server(checkpoint, args, 1, 1, mode, max_batch=size)
        try:
            for c in clients:
                m = results[(size, c)] = measure(server.url, per_client(args.n, c), c)
                print(
                    f"max-batch {size:>3} clients {c:>3}: p50 {m['rtt_p50']:8.2f} ms  p99 {m['rtt_p99']:8.2f} ms  "
                    f"{m['rps']:8.1f} req/s  batch {m['mean_batch']:5.2f}",
                    flush=True,
                )
        finally:
            server.close()
    lines = [
        f"## Batching across sessions (1 rank, {mode} CFG, --batch-window-ms {args.batch_window_ms:g})",
        "",
        "Closed-loop clients, each on its own connection, each sending max(n, 8n / clients) requests "
        f"(n = {args.n}): every row has at least {8 * args.n}, so the 1-client p50s the ratios divide by are as "
        "solid as the rest. Mean batch: the batch size a request ran in, averaged over requests.",
        "",
        "| clients | " + " | ".join(f"max-batch {s}: p50 ms | p99 ms | req/s | mean batch" for s in sizes) + " |",
        "|---:|" + "---:|---:|---:|---:|" * len(sizes),
    ]
    for c in clients:
        cells = []
        for s in sizes:
            m = results[(s, c)]
            cells.append(f"{m['rtt_p50']:.2f} | {m['rtt_p99']:.2f} | {m['rps']:.1f} | {m['mean_batch']:.2f}")
        lines.append(f"| {c} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| ratio (same run) | " + " | ".join(f"max-batch {s}" for s in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    one = min(clients)
    for c in clients:
        if c == one:
            continue
        lines.append(
            f"| p50 at {c} clients / p50 at {one} client | "
            + " | ".join(f"{results[(s, c)]['rtt_p50'] / results[(s, one)]['rtt_p50']:.2f}" for s in sizes)
            + " |"
        )
    if 1 in sizes:
        for c in clients:
            lines.append(
                f"| req/s at {c} clients / max-batch 1's | "
                + " | ".join(f"{results[(s, c)]['rps'] / results[(1, c)]['rps']:.2f}" for s in sizes)
                + " |"
            )
    columns = [f"max-batch {s}" for s in sizes]
    split = [results[(s, one)] for s in sizes]
    if args.asyncio_column:  # the same 1-client split on asyncio's own loop, beside the default (uvloop if installed)
        plain = Server(checkpoint, args, 1, 1, mode, max_batch=sizes[0], event_loop="asyncio")
        try:
            split.append(measure(plain.url, per_client(args.n, 1), 1))
        finally:
            plain.close()
        columns.append(f"max-batch {sizes[0]}, --event-loop asyncio")
    lines += [
        "",
        f"| server time outside infer, {one} client (p50 ms) | " + " | ".join(columns) + " |",
        "|---|" + "---:|" * len(columns),
    ]
    for key, label in (
        ("server_overhead_p50", "total_ms - infer_ms: everything the server adds"),
        ("decode_p50", "decode_ms (msgpack-numpy)"),
        ("prepare_p50", "prepare_ms (validation, uint8 tensors)"),
        ("queue_p50", "queue_ms (to the lane thread; no wait at 1 client)"),
        ("return_p50", "the rest: routing, the lane thread back to the event loop, reply"),
    ):
        lines.append(f"| {label} | " + " | ".join(f"{m[key]:.2f}" for m in split) + " |")
    return [*lines, ""]


def percentile(values: list[float], q: float = 50) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def in_process_batches(
    checkpoint: Path, args: argparse.Namespace, sizes: list[int]
) -> tuple[dict[int, float], list[str]]:
    """bench/batching.py on the same checkpoint and flags: {B: p50 ms of one batch}, and its table's lines."""
    with tempfile.TemporaryDirectory(prefix="bench-inprocess-") as tmp:
        cmd = [
            sys.executable,
            str(REPO / "bench" / "batching.py"),
            "--device",
            args.device,
            "--size",
            args.size,
            "--dtype",
            args.dtype,
            "--steps",
            str(args.steps),
            "--checkpoint",
            str(checkpoint),
            "--sizes",
            ",".join(map(str, sizes)),
            "--reps",
            "20",
            "--out",
            f"{tmp}/t.md",
            "--json",
            f"{tmp}/t.json",
        ]
        if args.compile:
            cmd += ["--compile", args.compile]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        times = {int(b): ms for b, ms in json.loads(Path(tmp, "t.json").read_text()).items()}
        table = [line for line in Path(tmp, "t.md").read_text().splitlines() if line.startswith("|")]
    return times, table


def robots_table(checkpoint: Path, args: argparse.Namespace, mode: str) -> list[str]:
    """Issue 24's table: robots x max-batch (x --frontend mode), closed loop, one process per robot; in-process
    batches beside it."""
    from policy_operator.runtime.client import run_client

    sizes = [int(x) for x in args.robot_max_batch.split(",")]
    frontends = args.frontend.split(",")
    columns = [(size, fe) for size in sizes for fe in frontends]
    robots = [int(x) for x in args.robots.split(",")]
    results: dict[tuple[int, str, int], dict[str, float]] = {}
    for size, fe in columns:
        server = Server(checkpoint, args, 1, 1, mode, max_batch=size, frontend=fe)
        try:
            for r in robots:
                run_client(server.url, args.robot_warmup, r, timeout=600)  # every robot warm, together
                s = run_client(server.url, args.robot_n, r, timeout=600)
                if s["errors"]:
                    raise RuntimeError(f"benchmark requests failed: {s['errors'][:3]}")
                records = s["records"]
                m = results[(size, fe, r)] = {
                    "p50": s["latency_ms"]["p50"],
                    "p99": s["latency_ms"]["p99"],
                    "rps": s["requests_per_s"],
                    "batch": s["mean_batch_size"],
                    "infer": s["infer_ms_p50"],
                    "server": percentile([r["total_ms"] - r["infer_ms"] for r in records]),
                    # where a request's time goes when robots outnumber max-batch: the replica busy (its
                    # batches' compute over the wall time: each batch's infer_ms counted once), the wait
                    # for it, and the rest (network, decode, prepare, reply) outside the server's total
                    "busy": sum(r["infer_ms"] / r["batch_size"] for r in records) / (1e3 * s["wall_s"]),
                    "queue": percentile([r["queue_ms"] for r in records]),
                    "outside": percentile([r["rtt_ms"] - r["total_ms"] for r in records]),
                    "ready_s": server.ready_s,
                    "start_line": server.start_line,
                    "load_s": server.load_s,
                    "warmup_s": server.warmup_s,
                }
                print(
                    f"max-batch {size:>3} {fe:>7} robots {r:>3}: p50 {m['p50']:8.2f} ms  p99 {m['p99']:8.2f} ms  "
                    f"{m['rps']:8.1f} req/s  batch {m['batch']:5.2f}  infer {m['infer']:6.2f} ms  "
                    f"busy {m['busy']:4.2f}  queue {m['queue']:6.2f} ms  outside {m['outside']:5.2f} ms",
                    flush=True,
                )
        finally:
            server.close()
    batch_sizes = sorted({1, *sizes, *(r for r in robots if r <= max(sizes))})
    inproc, inproc_table = in_process_batches(checkpoint, args, batch_sizes) if args.in_process else ({}, [])
    label = (lambda s, fe: f"max-batch {s}") if len(frontends) == 1 else (lambda s, fe: f"max-batch {s}, {fe}")
    lines = [
        f"## Robots x max-batch (1 rank, {mode} CFG, --batch-window-ms {args.batch_window_ms:g}, "
        f"--frontend {args.frontend})",
        "",
        f"One process per robot, closed loop, {args.robot_warmup} warm-up requests per robot (all robots at once), "
        f"then {args.robot_n} per robot. Cells: p50 ms / req/s (mean batch).",
        "",
        "| robots | " + " | ".join(label(s, fe) for s, fe in columns) + " |",
        "|---:|" + "---:|" * len(columns),
    ]
    for r in robots:
        lines.append(
            f"| {r} | "
            + " | ".join(
                f"{results[(s, fe, r)]['p50']:.2f} / {results[(s, fe, r)]['rps']:.0f} "
                f"({results[(s, fe, r)]['batch']:.1f})"
                for s, fe in columns
            )
            + " |"
        )
    lines += [
        "",
        "Where the time goes (p50 ms; busy: the replica's batches' compute over the row's wall time; outside: the "
        "robot's round trip minus the server's receive-to-reply time). Ready: server start to /readyz ready, of which "
        "load (onto the device) and warm-up (every bucket compiled or loaded from --compile-cache-dir, captured).",
        "",
        "| max-batch, front-end | robots | infer (batch) | busy | queue | server outside infer | outside server "
        "| ready s (load + warm-up) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for s, fe in columns:
        for r in robots:
            m = results[(s, fe, r)]
            lines.append(
                f"| {s}, {fe} | {r} | {m['infer']:.2f} | {m['busy']:.2f} | {m['queue']:.2f} | {m['server']:.2f} "
                f"| {m['outside']:.2f} | {m['ready_s']:.1f} ({m['load_s']:.1f} + {m['warmup_s']:.1f}) |"
            )
    if args.server_log:
        lines += ["", "Each server's start, as it logs it (--server-log):", ""]
        lines += [f"- max-batch {s}, {fe}: {results[(s, fe, robots[0])]['start_line']}" for s, fe in columns]
    if inproc_table:
        lines += ["", "In-process, the same checkpoint and flags, no server (bench/batching.py):", "", *inproc_table]
    lines.append("")
    targets = []
    for fe in frontends:
        tag = f" ({fe})" if len(frontends) > 1 else ""
        if 8 in sizes and 8 in robots:
            for r in (16, 32):
                if r in robots:
                    ratio = results[(8, fe, r)]["rps"] / results[(8, fe, 8)]["rps"]
                    targets.append(f"| max-batch 8{tag}: req/s at {r} robots / at 8 robots | {ratio:.2f} | >= 0.95 |")
        top = max(sizes)
        if top in robots and top in inproc:
            rate = top / (inproc[top] / 1e3)
            m = results[(top, fe, top)]
            targets.append(
                f"| max-batch {top}{tag}, {top} robots: req/s / in-process batch-{top} rate ({rate:.0f}) | "
                f"{m['rps'] / rate:.2f} | >= 0.85 |"
            )
            targets.append(
                f"| max-batch {top}{tag}, {top} robots: p50 / in-process batch-{top} time ({inproc[top]:.2f} ms) | "
                f"{m['p50'] / inproc[top]:.2f} | <= 1.25 |"
            )
        if 1 in robots and 1 in inproc:
            for s in sizes:
                m = results[(s, fe, 1)]
                # where a lone robot's time goes: the replica's compute (infer_ms) or the server around it
                targets.append(
                    f"| 1 robot, max-batch {s}{tag}: p50 - in-process batch-1 time ({inproc[1]:.2f} ms); "
                    f"server infer_ms p50 {m['infer']:.2f}, server outside infer {m['server']:.2f} | "
                    f"{m['p50'] - inproc[1]:+.2f} ms | <= +1 ms |"
                )
    lines += ["| target (issue 24), same run | measured | target |", "|---|---:|---:|", *targets, ""]
    return lines


def layouts_table(checkpoint: Path, args: argparse.Namespace, fast: str) -> list[str]:
    actions: dict[str, np.ndarray] = {}

    def run(label: str, cfgp: int, dp: int, mode: str, concurrency: int = 1) -> dict[str, float]:
        server = Server(checkpoint, args, cfgp, dp, mode)  # --max-batch 1: these rows compare layouts
        try:
            m = measure(server.url, args.n, concurrency)
            actions[label] = fixed_seed_actions(server.url)
        finally:
            server.close()
        print(
            f"{label:<44} infer p50 {m['infer_p50']:8.2f} ms  rtt p50 {m['rtt_p50']:8.2f} ms  wall {m['wall_s']:.2f}s",
            flush=True,
        )
        return m

    seq = run("cfgp=1 sequential CFG (1 rank)", 1, 1, "sequential")
    bat = run("cfgp=1 batched CFG (1 rank)", 1, 1, "batched")
    par = run("cfgp=2 CFG-parallel (2 ranks)", 2, 1, "sequential")
    one = run(f"dp={args.dp}: 1 client", 1, args.dp, fast)
    many = run(f"dp={args.dp}: {args.dp} concurrent clients", 1, args.dp, fast, concurrency=args.dp)
    base = run("dp=1: same clients, serialized", 1, 1, fast, concurrency=args.dp)
    inproc = in_process_infer(checkpoint, args, args.n)
    ref = actions["cfgp=1 sequential CFG (1 rank)"]
    equality = [(label, float(np.abs(a - ref).max()), bool(np.array_equal(a, ref))) for label, a in actions.items()]
    rows = [
        ("sequential CFG, 1 rank", f"{seq['infer_p50']:.2f}", 1.0, "baseline"),
        ("batched CFG, 1 rank", f"{bat['infer_p50']:.2f}", bat["infer_p50"] / seq["infer_p50"], "vs sequential"),
        (
            "cfgp=2, 2 ranks",
            f"{par['infer_p50']:.2f}",
            par["infer_p50"] / seq["infer_p50"],
            "vs sequential (target <= 0.55 when compute-bound)",
        ),
        (
            f"dp={args.dp}, {args.dp} concurrent clients (wall per round of {args.dp})",
            f"{many['wall_s'] / args.n * 1e3:.2f}",
            many["wall_s"] / one["wall_s"],
            f"vs 1 client on dp={args.dp} (target <= 1.1)",
        ),
        (
            f"dp=1, {args.dp} concurrent clients (wall per round of {args.dp})",
            f"{base['wall_s'] / args.n * 1e3:.2f}",
            base["wall_s"] / one["wall_s"],
            "control: serialized on one replica (~dp x)",
        ),
    ]
    overhead = seq["rtt_p50"] - inproc
    return [
        "## Layouts (--max-batch 1; p50 of the server's infer_ms unless stated)",
        "",
        "| configuration | ms | ratio | compared with |",
        "|---|---:|---:|---|",
        *[f"| {a} | {b} | {c:.2f} | {d} |" for a, b, c, d in rows],
        "",
        "| same seed, every server | max abs diff vs sequential 1 rank | bitwise equal |",
        "|---|---:|---|",
        *[f"| {label} | {d:.1e} | {eq} |" for label, d, eq in equality],
        "",
        "| server overhead | ms |",
        "|---|---:|",
        f"| WebSocket round trip p50 (sequential, 1 rank) | {seq['rtt_p50']:.2f} |",
        f"| in-process prepare + sample + postprocess p50 | {inproc:.2f} |",
        f"| overhead = round trip - in-process | {overhead:.2f} |",
        f"| overhead = round trip - server infer_ms (p50 per request) | {seq['overhead_p50']:.2f} |",
        f"| of which inside the server: total_ms - infer_ms (decode, prepare, routing, hops) | "
        f"{seq['server_overhead_p50']:.2f} |",
        "",
    ]


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


if __name__ == "__main__":
    sys.exit(main())
