"""One robot's latency and 32 robots' throughput of two trees, side by side, with both front-end modes.

Each tree's server is started through ``bench/harness.py`` (``--before`` is a
git archive of the older commit, served by putting its import root first on
PYTHONPATH; the other is this tree), one at a time, rounds interleaved so a
busy machine's drift falls on both: per round and per tree and front-end, one
robot in closed loop (p50 / p99 round trip) and 32 robots in closed loop, one
process each (requests/s, p50).  The table goes to ``--out`` with its
reproduce line::

    git archive b826365 | tar -x -C /tmp/before; git archive HEAD | tar -x -C /tmp/after
    python bench/tree_compare.py --before /tmp/before --after /tmp/after --out bench/results/issue38-request-path-cpu.md
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

from harness import import_root, serve  # bench/ is sys.path[0] when a benchmark runs as a script
from report import publish


def measure(url: str, n_one: int, n_many: int, robots: int) -> dict[str, float]:
    from policy_operator.runtime.client import run_client

    run_client(url, 5, 1, timeout=600)  # warm
    one = run_client(url, n_one, 1, timeout=600)
    run_client(url, 3, robots, timeout=600)  # every robot warm, together
    many = run_client(url, n_many, robots, timeout=600)
    for s in (one, many):
        if s["errors"]:
            raise RuntimeError(f"benchmark requests failed: {s['errors'][:3]}")
    return {
        "one_p50": one["latency_ms"]["p50"],
        "one_p99": one["latency_ms"]["p99"],
        "many_rps": many["requests_per_s"],
        "many_p50": many["latency_ms"]["p50"],
        "many_batch": many["mean_batch_size"],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", type=Path, required=True, help="the older tree (a git archive)")
    p.add_argument("--after", type=Path, default=None, help="the newer tree (a git archive; default: this one)")
    p.add_argument("--before-label", default="before")
    p.add_argument("--after-label", default="after")
    p.add_argument("--size", default="tiny", choices=["tiny", "small", "base"])
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--robots", type=int, default=32)
    p.add_argument("--n-one", type=int, default=60, help="requests of the one robot, per round")
    p.add_argument("--n-many", type=int, default=10, help="requests per robot of the 32, per round")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--frontends", default="inline,process")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    from policy_operator.runtime.policy.reference import init_checkpoint

    work = Path(tempfile.mkdtemp(prefix="tree-compare-"))
    checkpoint = init_checkpoint(work / args.size, args.size)
    trees = {
        args.before_label: {"PYTHONPATH": str(import_root(args.before, work))},
        args.after_label: {"PYTHONPATH": str(import_root(args.after, work))} if args.after is not None else {},
    }
    frontends = args.frontends.split(",")
    results: dict[tuple[str, str], list[dict[str, float]]] = {}
    for round_ in range(args.rounds):
        for frontend in frontends:
            for label, env in trees.items():
                with serve(
                    checkpoint,
                    env=env,
                    steps=args.steps,
                    device="cpu",
                    threads=1,
                    max_batch=args.max_batch,
                    frontend=frontend,
                    log_level="WARNING",
                ) as server:
                    m = measure(server.url, args.n_one, args.n_many, args.robots)
                results.setdefault((label, frontend), []).append(m)
                print(f"round {round_} {frontend:>7} {label:>8}: {m}", flush=True)

    def med(label: str, frontend: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(label, frontend)])

    lines = [
        f"# One request path (issue 38): {args.before_label} against {args.after_label}, CPU",
        "",
        f"{args.size} reference policy, {args.steps} steps, 1 thread, --max-batch {args.max_batch}; per round and "
        f"per cell one server, one robot in closed loop ({args.n_one} requests) and {args.robots} robots in closed "
        f"loop, one process each ({args.n_many} requests each); {args.rounds} rounds interleaved, medians of the "
        "rounds. Round trips in ms.",
        "",
        "| front-end | tree | 1 robot p50 | 1 robot p99 | 32 robots req/s | 32 robots p50 | mean batch |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for frontend in frontends:
        for label in trees:
            lines.append(
                f"| {frontend} | {label} | {med(label, frontend, 'one_p50'):.2f} | {med(label, frontend, 'one_p99'):.2f} "
                f"| {med(label, frontend, 'many_rps'):.1f} | {med(label, frontend, 'many_p50'):.1f} "
                f"| {med(label, frontend, 'many_batch'):.1f} |"
            )
    lines += [
        "",
        "Every round: "
        + "; ".join(
            f"{fe} {label} "
            + ", ".join(f"{r['one_p50']:.2f} ms / {r['many_rps']:.0f} req/s" for r in results[(label, fe)])
            for fe in frontends
            for label in trees
        ),
        "",
        f"Reproduce: `git archive {args.before_label} | tar -x -C BEFORE && git archive {args.after_label} | tar -x -C AFTER "
        f"&& python bench/tree_compare.py --before BEFORE --after AFTER "
        f"--before-label {args.before_label} --after-label {args.after_label} --size {args.size} --steps {args.steps} "
        f"--max-batch {args.max_batch} --robots {args.robots} --n-one {args.n_one} --n-many {args.n_many} "
        f"--rounds {args.rounds} --frontends {args.frontends}`",
        "",
    ]
    if args.out is not None:
        publish(lines, args.out)
    else:
        print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
