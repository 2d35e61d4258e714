"""Where a traced request's device time goes between its kernels: the device idle a CUDA graph can and cannot remove.

Reads the chrome traces ``bench/lerobot_kernels.py`` writes beside its table
(one served request per bucket, and with ``--one-graph`` one replay of the
whole-request graph) and prints, per trace: the kernels and memory copies,
their summed time against the span from the first kernel's start to the last
one's end, the median gap between consecutive kernels, and the sum of the
gaps over ``--long-us`` (the host late with the next launch: between graph
replays, guards, copies into a graph's inputs).  What is left under that
bound is the launch-to-launch gap of the kernels themselves, which only fewer
kernels remove.

    python bench/trace_gaps.py /tmp/out/one-graph-pi05.b1.*.trace.json
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def gaps(path: Path, long_us: float) -> str:
    data = json.loads(path.read_text())
    events = data["traceEvents"] if isinstance(data, dict) else data
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    copies = sum(1 for e in events if e.get("cat") in ("gpu_memcpy", "gpu_memset"))
    if len(kernels) < 2:
        return f"| {path.name} | {len(kernels)} | {copies} | | | | |"
    busy = sum(e["dur"] for e in kernels) / 1e3
    span = (max(e["ts"] + e["dur"] for e in kernels) - kernels[0]["ts"]) / 1e3
    between = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(kernels, kernels[1:], strict=False)]
    long = sum(g for g in between if g > long_us) / 1e3
    return (
        f"| {path.name} | {len(kernels)} | {copies} | {busy:.2f} / {span:.2f} | {statistics.median(between):.2f} | "
        f"{long:.2f} | {max(between):.0f} |"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("traces", nargs="+", type=Path)
    p.add_argument("--long-us", type=float, default=20.0)
    args = p.parse_args()
    print(
        f"| trace | kernels | copies and sets | busy / span ms | median gap µs | gaps over {args.long_us:g} µs, ms | "
        "longest gap µs |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for path in args.traces:
        print(gaps(path, args.long_us))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
