"""One robot's round trip while probes and scrapes flood the server's port (issue 40 item 6).

A real ``policyserver serve`` (the tiny reference checkpoint, CPU), one robot in a process of its own
(``runtime/client.py``'s closed loop, RoboLab-shaped frames), and in another process ``--threads`` threads that
each GET one path as fast as the server answers, on a new connection each time as a kubelet or Prometheus does.
Per phase (quiet, then a flood of each path) the robot's p50 / p99 round trip and the flood's answered
requests per second; the target: the robot's p99 under a flood at most 2x its quiet p99.

    python bench/probe_flood.py                                   # 16 threads, /metrics, /healthz, /readyz
    python bench/probe_flood.py --frontend process --out bench/results/probe-flood-cpu-process.md
    python bench/probe_flood.py --serve-variant PYTHONPATH=/tmp/old/pp --serve-variant ''   # another tree first

``--serve-variant`` (repeatable) runs one server per variant, one after the other: its leading NAME=VALUE words
are the server's environment (PYTHONPATH=... serves another tree laid out as the package), the rest more
serve flags.

On the 2-core CPU the flood's own threads compete with the server and the robot for the cores: that is the
attack as it was run, and what the target is measured against.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
from harness import free_port, serve
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

from runtime import frontend_argv, split_variant


def _robot(url: str, n: int, warmup: int, out: Any) -> None:
    from policy_operator.runtime.client import run_client

    run_client(url, warmup, seed=999)
    s = run_client(url, n, seed=0, timeout=600)
    out.put(([r["rtt_ms"] for r in s["records"]], s["errors"][:3]))


def _flood(port: int, path: str, threads: int, stop: Any, counts: Any) -> None:
    request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n".encode()
    answered = [0] * threads
    statuses: dict[str, int] = {}

    def hammer(i: int) -> None:
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                    sock.sendall(request)
                    reply = b""
                    while chunk := sock.recv(65536):
                        reply += chunk
                status = reply[9:12].decode(errors="replace") or "none"
            except OSError:
                status = "error"
            statuses[status] = statuses.get(status, 0) + 1
            answered[i] += 1

    workers = [threading.Thread(target=hammer, args=(i,), daemon=True) for i in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    counts.put((sum(answered), statuses))


def phase(url: str, port: int, path: str | None, args: argparse.Namespace) -> dict[str, Any]:
    """The robot's round trips with ``path`` flooded by ``args.threads`` threads (None: quiet)."""
    ctx = multiprocessing.get_context("spawn")
    stop, counts, out = ctx.Event(), ctx.Queue(), ctx.Queue()
    flood = None
    if path is not None:
        flood = ctx.Process(target=_flood, args=(port, path, args.threads, stop, counts))
        flood.start()
        time.sleep(1.0)  # the flood at full rate before the robot starts (a benchmark's pacing, not a sync)
    started = time.monotonic()
    robot = ctx.Process(target=_robot, args=(url, args.n, args.warmup, out))
    robot.start()
    rtt, errors = out.get(timeout=900)
    robot.join()
    elapsed = time.monotonic() - started
    answered, statuses = 0, {}
    if flood is not None:
        stop.set()
        answered, statuses = counts.get(timeout=120)
        flood.join()
    if errors:
        raise RuntimeError(f"robot requests failed: {errors}")
    return {
        "path": path or "quiet",
        "p50": float(np.percentile(rtt, 50)),
        "p99": float(np.percentile(rtt, 99)),
        "max": float(np.max(rtt)),
        "flood_rps": answered / elapsed if flood is not None else 0.0,
        "statuses": statuses,
    }


def serve_phases(
    checkpoint: str, args: argparse.Namespace, env: dict[str, str], flags: list[str], tmp: Path
) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """One server: the quiet phase, then a flood of each path; the rows and each phase's new log lines."""
    port = free_port()
    log_path = tmp / f"server-{port}.log"
    rows, log_lines = [], {}
    options = {"steps": args.steps, "threads": 1}
    extra = [*frontend_argv(args.frontend), *shlex.split(args.serve_args), *flags]
    with serve(checkpoint, port=port, env=env, log=log_path, flags=extra, **options) as server:
        for path in [None, *args.paths.split(",")]:
            before = len(log_path.read_text().splitlines())
            rows.append(phase(server.url, port, path, args))
            log_lines[rows[-1]["path"]] = len(log_path.read_text().splitlines()) - before
    return rows, log_lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory (default: a tiny one made here)")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--n", type=int, default=300, help="robot requests per phase")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--threads", type=int, default=16, help="flooding threads")
    p.add_argument("--paths", default="/metrics,/healthz,/readyz")
    p.add_argument("--frontend", default="inline")
    p.add_argument("--serve-args", default="", help="more serve flags")
    p.add_argument("--serve-variant", action="append", default=None, help="NAME=VALUE words and flags (repeatable)")
    p.add_argument("--out", default="bench/results/probe-flood-cpu.md")
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        checkpoint = args.checkpoint
        if checkpoint is None:
            checkpoint = str(Path(tmp, "ckpt"))
            subprocess.run(
                [sys.executable, "-m", "policy_operator.cli", "checkpoint", "init", checkpoint, "--size", "tiny"],
                check=True,
                stdout=subprocess.DEVNULL,
            )
        results = []
        for variant in args.serve_variant or [""]:
            env, flags = split_variant(variant)
            results.append((variant, serve_phases(checkpoint, args, env, flags, Path(tmp))))

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    lines = [
        f"<!-- code of {commit}; {platform.machine()}, {os.cpu_count()} cores -->",
        f"# One robot under a probe flood ({platform.machine()}, {os.cpu_count()} cores, --frontend {args.frontend})",
        "",
        f"One robot (closed loop, {args.n} requests per phase, tiny checkpoint, --steps {args.steps}); a flood is "
        f"{args.threads} threads each GETting the path on a new connection as fast as it is answered.",
        "",
        "| server | phase | robot p50 ms | robot p99 ms | max ms | p99 / quiet p99 | flood answered/s "
        "| flood statuses | log lines |",
        "|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for variant, (rows, log_lines) in results:
        quiet = rows[0]["p99"]
        for r in rows:
            statuses = ", ".join(f"{k}: {v}" for k, v in sorted(r["statuses"].items())) or "--"
            lines.append(
                f"| {variant or 'this tree'} | {r['path']} | {r['p50']:.2f} | {r['p99']:.2f} | {r['max']:.2f} "
                f"| {r['p99'] / quiet:.2f} | {r['flood_rps']:.0f} | {statuses} | {log_lines.get(r['path'], 0)} |"
            )
    lines += [
        "",
        "log lines: what the server wrote to its log during that phase.",
        "",
        "Reproduce: `python bench/probe_flood.py " + " ".join(shlex.quote(a) for a in sys.argv[1:]) + "`",
        "",
    ]
    publish(lines, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
