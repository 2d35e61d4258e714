"""Send RoboLab-shaped observations to a policy server and print latency percentiles.

Speaks the same wire protocol as openpi-client (``runtime/serving/wire.py``); with
``--concurrency N`` it opens N connections, one process each (as N robots),
that send in parallel: how a dp>1 pod, or a batching replica, is seen serving
requests concurrently.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import statistics
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import numpy as np

from policy_operator.constants import DEFAULT_PORT
from policy_operator.runtime.robolab import robolab_observation as robolab_observation  # its callers' name


def percentile(values: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(values), q)) if values else float("nan")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default=f"ws://127.0.0.1:{DEFAULT_PORT}", help="server URL (default %(default)s)")
    parser.add_argument("--n", type=int, default=10, help="requests per connection (default %(default)s)")
    parser.add_argument("--concurrency", type=int, default=1, help="parallel connections (default %(default)s)")
    parser.add_argument("--seed", type=int, default=None, help="fixed sampling seed sent with every request")
    parser.add_argument("--token-file", default=None, help="bearer token for a server started with auth")
    parser.add_argument("--json", action="store_true", help="print the summary as JSON")
    g = parser.add_argument_group("real-time chunking (a simulated robot)")
    g.add_argument(
        "--rtc",
        action="store_true",
        help="simulate a robot executing chunks asynchronously at --control-hz, once without and once "
        "with real-time chunking, and print the jumps at chunk switches",
    )
    g.add_argument(
        "--control-hz", type=float, default=15.0, help="the simulated robot's control rate (default %(default)s)"
    )
    g.add_argument(
        "--seconds", type=float, default=10.0, help="how long each simulated run lasts (default %(default)s)"
    )
    g.add_argument(
        "--execution-horizon",
        type=int,
        default=None,
        help="actions executed from each chunk before switching (default: half the action horizon)",
    )
    parser.add_argument("--timeout", type=float, default=60.0)


def _session(
    url: str, n: int, worker: int, seed: int | None, headers: dict[str, str] | None, timeout: float, barrier: Any
) -> dict[str, Any]:
    """One robot: its own connection, sending its next frame as soon as its reply is in.

    With several sessions each runs in a process of its own, as robots do: in one process the
    connections' threads would queue for one GIL, and the benchmark would measure the client.
    """
    from websockets.sync.client import connect

    from policy_operator.runtime.serving import wire

    out: dict[str, Any] = {"meta": None, "records": [], "shapes": [], "errors": [], "start": None, "end": None}
    try:
        with connect(url, additional_headers=headers, max_size=None, open_timeout=timeout, compression=None) as ws:
            meta = out["meta"] = wire.unpackb(ws.recv(timeout=timeout))
            # every frame ready before the first send, as a robot's camera frame is when it sends
            frames = [wire.packb(robolab_observation(meta, worker * 100003 + i, fixed_seed=seed)) for i in range(n)]
            if barrier is not None:  # every session connected and ready: they start together
                barrier.wait(timeout)
            out["start"] = time.monotonic()
            for frame in frames:
                t0 = time.perf_counter()
                ws.send(frame)
                reply = ws.recv(timeout=timeout)
                dt = (time.perf_counter() - t0) * 1e3
                if isinstance(reply, str):
                    raise RuntimeError(f"server error: {reply}")
                msg = wire.unpackb(reply)
                timing = msg["server_timing"]
                out["records"].append(
                    {
                        "sent_at": t0,  # perf_counter: the host's monotonic clock, as the server's stages have it
                        "rtt_ms": dt,
                        "infer_ms": float(timing["infer_ms"]),
                        "total_ms": float(timing.get("total_ms", "nan")),
                        "replica": int(timing.get("replica", 0)),
                        "queue_ms": float(timing.get("queue_ms", "nan")),
                        "prepare_ms": float(timing.get("prepare_ms", "nan")),
                        "decode_ms": float(timing.get("decode_ms", "nan")),
                        "batch_size": int(timing.get("batch_size", 1)),
                    }
                )
                out["shapes"].append(tuple(np.asarray(msg["actions"]).shape))
            out["end"] = time.monotonic()
    except Exception as exc:  # noqa: BLE001 - reported in the summary
        out["errors"].append(f"{type(exc).__name__}: {exc}")
        if barrier is not None:
            barrier.abort()  # the others must not wait for a session that never comes
    return out


def run_client(
    url: str, n: int, concurrency: int = 1, seed: int | None = None, token: str | None = None, timeout: float = 60.0
) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else None
    if concurrency == 1:
        sessions = [_session(url, n, 0, seed, headers, timeout, None)]
    else:
        ctx = multiprocessing.get_context("spawn")  # the caller may hold threads (and torch): no fork
        with ctx.Manager() as manager, ProcessPoolExecutor(concurrency, mp_context=ctx) as pool:
            barrier = manager.Barrier(concurrency)
            futures = [pool.submit(_session, url, n, w, seed, headers, timeout, barrier) for w in range(concurrency)]
            sessions = [f.result() for f in futures]
    records = [r for s in sessions for r in s["records"]]
    errors = [e for s in sessions for e in s["errors"]]
    replicas = Counter(r["replica"] for r in records)
    starts = [s["start"] for s in sessions if s["start"] is not None]
    ends = [s["end"] for s in sessions if s["end"] is not None]
    wall = max(ends) - min(starts) if ends else 0.0
    latencies = [r["rtt_ms"] for r in records]
    return {
        "url": url,
        "metadata": next((s["meta"] for s in sessions if s["meta"] is not None), None),
        "requests": len(latencies),
        "errors": errors,
        "action_shapes": sorted({shape for s in sessions for shape in s["shapes"]}),
        "latency_ms": {
            "p50": percentile(latencies, 50),
            "p90": percentile(latencies, 90),
            "p99": percentile(latencies, 99),
            "mean": statistics.fmean(latencies) if latencies else None,
        },
        "infer_ms_p50": percentile([r["infer_ms"] for r in records], 50),
        # per request: the batch size a request saw, averaged (a batch of 8 counts 8 times)
        "mean_batch_size": statistics.fmean(r["batch_size"] for r in records) if records else None,
        "requests_per_s": len(latencies) / wall if wall > 0 else 0.0,
        "wall_s": wall,
        "replicas": replicas,
        "records": records,
    }


def format_summary(s: dict[str, Any]) -> str:
    meta = s["metadata"] or {}
    lat = s["latency_ms"]
    rows = [
        ("server", f"{meta.get('policy_name', '?')} {meta.get('server_version', '')} layout={meta.get('layout')}"),
        ("requests", f"{s['requests']} ok, {len(s['errors'])} failed"),
        ("action shape", ", ".join("x".join(map(str, sh)) for sh in s["action_shapes"]) or "-"),
        ("latency p50 / p90 / p99", f"{lat['p50']:.1f} / {lat['p90']:.1f} / {lat['p99']:.1f} ms"),
        ("server infer p50", f"{s['infer_ms_p50']:.1f} ms"),
        ("mean batch size", f"{s['mean_batch_size']:.2f}" if s["mean_batch_size"] is not None else "-"),
        ("throughput", f"{s['requests_per_s']:.1f} requests/s"),
        ("replicas used", ", ".join(f"{k}: {v}" for k, v in sorted(s["replicas"].items())) or "-"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = [f"  {k.ljust(width)}  {v}" for k, v in rows]
    lines += [f"  error: {e}" for e in s["errors"][:5]]
    return "\n".join(lines)


def _main_rtc(args: argparse.Namespace, token: str | None) -> int:
    from policy_operator.runtime.chunk_executor import format_comparison, simulate

    headers = {"Authorization": f"Bearer {token}"} if token else None
    rows = []
    for rtc in (False, True):
        try:
            rows.append(
                simulate(
                    args.url,
                    control_hz=args.control_hz,
                    seconds=args.seconds,
                    rtc=rtc,
                    execution_horizon=args.execution_horizon,
                    headers=headers,
                    timeout=args.timeout,
                    seed=args.seed or 0,
                )
            )
        except Exception as exc:  # noqa: BLE001 - reported, exit 1
            print(f"policyserver client: {'with' if rtc else 'without'} rtc: {type(exc).__name__}: {exc}")
            return 1
    print(json.dumps(rows, indent=2) if args.json else format_comparison(rows))
    return 0


def main(args: argparse.Namespace) -> int:
    from policy_operator.tokens import read_token_file

    token = read_token_file(args.token_file, "--token-file") if args.token_file else None
    if args.rtc:
        return _main_rtc(args, token)
    summary = run_client(args.url, args.n, args.concurrency, args.seed, token, args.timeout)
    print(json.dumps(summary, indent=2, default=str) if args.json else format_summary(summary))
    return 0 if summary["requests"] and not summary["errors"] else 1
