"""Where a closed loop's turnaround goes: one batch's end to the next one's start, stage by stage.

At max-batch 32 with 32 robots the replica idles between batches while the replies go out and the robots'
next frames come back (issue 24: the server's req/s against the in-process batch rate).  This times that gap
from the inside.  A real ``policyserver serve`` runs with a ``sitecustomize`` on its PYTHONPATH that wraps a
few functions of the runtime in every process it starts (the model process, each front-end process) and
records one monotonic timestamp per call -- no call tracer, so the server runs at its own speed:

- the lane's thread: the replica's call begins / returns (the batch's start and end on the device side);
- rank 0's loop: ``Lane._finish`` (the batch's replies reach the loop), ``Lane.submit`` (a request queued),
  ``Lane._start`` (a batch handed to the lane's thread); with front-end processes also ``FrontendLink._on_message``
  (its Request branch: a request read from the ring) and ``FrontendLink._answered`` (an answer queued for its front-end);
- the front-end (inline: the same loop): ``infer`` called (a frame decoded by ``websockets``) and the reply
  written (``PolicyWebSocketServer._reply``); with front-end processes also the answer's arrival;
- the robots: each request's send and its reply's arrival (``runtime/client.py`` records both on the same
  clock, ``time.perf_counter``: CLOCK_MONOTONIC, one per host).

Every full batch whose successor is full too is one cycle; each stage's first and last timestamp in the cycle
is taken relative to the batch's end, and the table gives their medians over the cycles.

    python bench/cycle_trace.py --checkpoint /tmp/ckpt --serve-args "--steps 4" --max-batch 8 --robots 8 \\
        --frontend inline,process:2                                    # CPU, small model
    python bench/cycle_trace.py --checkpoint /tmp/base --max-batch 32 --robots 32 --frontend inline,process:4 \\
        --serve-args "--device cuda --dtype bfloat16 --compile reduce-overhead --steps 10"   # the H200
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from harness import serve
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

from runtime import frontend_argv, split_variant

ENV_DIR = "POLICY_CYCLE_TRACE_DIR"

# Installed as ``sitecustomize`` in every process of the traced server: wraps, records, writes on request.
SITECUSTOMIZE = r"""
import os
DIR = os.environ.get("POLICY_CYCLE_TRACE_DIR")
if DIR:
    import functools, json, sys, threading, time
    events = []
    clock = time.perf_counter

    def mark(name, n=0):
        events.append((name, clock(), n))

    def dump_when_asked():
        trigger = os.path.join(DIR, "dump")
        while not os.path.exists(trigger):
            time.sleep(0.2)
        path = os.path.join(DIR, f"events-{os.getpid()}.json")
        with open(path + ".part", "w") as f:  # renamed when whole: the reader globs for the finished name only
            json.dump({"pid": os.getpid(), "argv": sys.argv, "events": events}, f)
        os.replace(path + ".part", path)

    def wrap(cls, name, event, sync=True, after=False):
        original = getattr(cls, name)
        if sync:
            @functools.wraps(original)
            def wrapped(*args, **kwargs):
                if not after:
                    mark(event)
                result = original(*args, **kwargs)
                if after:
                    mark(event)
                return result
        else:
            @functools.wraps(original)
            async def wrapped(*args, **kwargs):
                mark(event)
                try:
                    return await original(*args, **kwargs)
                finally:
                    mark(event + "-out")
        setattr(cls, name, wrapped)

    try:
        from policy_operator.runtime.parallel import dispatch
        from policy_operator.runtime import ipc
        from policy_operator.runtime.engine import core, link
        from policy_operator.runtime.serving import server, wire
    except Exception:  # a process of the launcher that cannot import the runtime: nothing to trace there
        pass
    else:
        threading.Thread(target=dump_when_asked, daemon=True).start()
        lane_init = dispatch.Lane.__init__

        def init(self, index, executor, call, stop, **kwargs):
            def timed(batch):
                mark("call", len(batch.requests))
                try:
                    return call(batch)
                finally:
                    mark("call-out", len(batch.requests))
            lane_init(self, index, executor, timed, stop, **kwargs)

        dispatch.Lane.__init__ = init
        wrap(dispatch.Lane, "submit", "submit")
        wrap(dispatch.Lane, "_finish", "finish")
        wrap(dispatch.Lane, "_start", "start")
        on_message = link.FrontendLink._on_message  # a request is read from the ring in its Request branch

        def model_message(self, message):
            if isinstance(message, ipc.Request):
                mark("model-request")
            on_message(self, message)

        link.FrontendLink._on_message = model_message
        wrap(link.FrontendLink, "_answered", "model-answer")
        # the front-end process runs frontend.py as __main__, a module of its own: only what it calls through
        # another module's attributes can be wrapped here
        wrap(server.Sessions, "request", "frame")
        wrap(wire, "decode_observation", "decode")
        # the prepared request into the ring (``write_request``; ``write_sample`` in a tree from before it)
        wrap(ipc.SlotRing, "write_request" if hasattr(ipc.SlotRing, "write_request") else "write_sample", "ring-write")
        wrap(ipc.SlotRing, "write_object", "ring-write")
        # the reply written (``_reply``; ``_send`` in a tree from before it)
        writes = "_reply" if hasattr(server.PolicyWebSocketServer, "_reply") else "_send"
        wrap(server.PolicyWebSocketServer, writes, "sent", sync=False)
        wrap(core.Engine, "_lane_answered", "lane-answered")
        wrap(wire, "packb", "packb")
        listen = ipc.Channel.listen

        def listening(self, loop, on_message, on_closed):
            def marked(message):
                if isinstance(message, ipc.Answer):
                    mark("fe-answer")
                on_message(message)
            listen(self, loop, marked, on_closed)

        ipc.Channel.listen = listening
"""

# (stage, where it happens): the rows of the table, in the order a cycle passes them
STAGES = (
    ("finish", "rank 0's loop takes the batch's replies (Lane._finish)"),
    ("lane-answered", "a request's answer is in (Engine._lane_answered)"),
    ("model-answer", "an answer queued for its front-end (FrontendLink._answered)"),
    ("fe-answer", "a front-end process reads an answer"),
    ("packb", "a reply's msgpack encode begins"),
    ("sent", "its write begins (websockets' send)"),
    ("sent-out", "the write's await returns"),
    ("robot-recv", "a robot has its reply"),
    ("robot-send", "a robot sends its next frame"),
    ("frame", "the front-end's loop has the frame (whole, from websockets)"),
    ("decode", "its msgpack decode begins"),
    ("ring-write", "a front-end process writes the prepared request to the ring"),
    ("model-request", "rank 0 reads a request from the ring (FrontendLink._on_message)"),
    ("submit", "a request queued on the lane"),
    ("start", "the next batch handed to the lane's thread"),
    ("call", "the next batch's call begins on the lane's thread"),
)


def trace(checkpoint: str, args: argparse.Namespace, server: str, robots: list[int]) -> dict[str, Any]:
    """One server (``FRONTEND[ NAME=VALUE...][ FLAGS...]``): for each robot count, warm it and run the robots;
    then every process's events."""
    from policy_operator.runtime.client import run_client

    with tempfile.TemporaryDirectory(prefix="cycle-trace-") as tmp:
        site = Path(tmp, "site")
        site.mkdir()
        (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
        events_dir = Path(tmp, "events")
        events_dir.mkdir()
        frontend, _, variant = server.partition(" ")
        env, words = split_variant(variant)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(site), env.get("PYTHONPATH", "")) if p)
        env[ENV_DIR] = str(events_dir)
        runs: dict[int, dict[str, Any]] = {}
        with serve(
            checkpoint,
            env=env,
            log=Path(tmp, "server.log"),
            flags=[*frontend_argv(frontend), *shlex.split(args.serve_args), *words],
            log_level="WARNING",
            max_batch=args.max_batch,
            batch_window_ms=args.batch_window_ms,
        ) as server_:
            url = server_.url
            for count in robots:
                run_client(url, args.warmup, count, timeout=600)
                s = run_client(url, args.n, count, timeout=600)
                if s["errors"]:
                    raise RuntimeError(f"{frontend}, {count} robots: {s['errors'][:3]}")
                runs[count] = {"records": s["records"], "rps": s["requests_per_s"]}
            (events_dir / "dump").touch()
            expected = 1 + (int(frontend.partition(":")[2] or 1) if frontend.startswith("process") else 0)
            deadline = time.monotonic() + 60
            while len(list(events_dir.glob("events-*.json"))) < expected and time.monotonic() < deadline:
                time.sleep(0.2)  # every traced process writes its events within a poll period
            time.sleep(0.5)
            processes = [json.loads(p.read_text()) for p in events_dir.glob("events-*.json")]
    return {"runs": runs, "processes": processes}


def cycles(
    records: list[dict[str, Any]], processes: list[dict[str, Any]], full: int
) -> tuple[dict[str, tuple[float, float]], int, float, float]:
    """({stage: (median first, median last) ms after the batch's end}, cycles, median batch ms, median gap ms):
    cycles from a batch of ``full`` requests to the next such batch, within the robots' run."""
    sends = sorted(r["sent_at"] for r in records)
    received = sorted(r["sent_at"] + r["rtt_ms"] / 1e3 for r in records)
    window = (sends[0], received[-1])
    by: dict[str, list[float]] = {"robot-send": sends, "robot-recv": received}
    for process in processes:
        for name, t, n in process["events"]:
            if not window[0] <= t <= window[1]:
                continue
            key = name if name not in ("call", "call-out") or n == full else f"{name}-partial"
            by.setdefault(key, []).append(t)
    for times in by.values():
        times.sort()
    starts, ends, partial = by.get("call", []), by.get("call-out", []), by.get("call-partial", [])
    rows: dict[str, list[tuple[float, float]]] = {}
    batch_ms, gaps = [], []
    for end in ends:
        nxt = next((t for t in starts if t > end), None)
        if nxt is None or any(end < t < nxt for t in partial):
            continue  # the run's last batch, or a partial batch ran in between: not a full-to-full cycle
        gaps.append((nxt - end) * 1e3)
        ran_from = max((t for t in starts if t < end), default=None)
        if ran_from is not None:
            batch_ms.append((end - ran_from) * 1e3)
        for stage, _ in STAGES:
            inside = [t for t in by.get(stage, []) if end < t <= nxt]
            if inside:
                rows.setdefault(stage, []).append(((inside[0] - end) * 1e3, (inside[-1] - end) * 1e3))
    table = {
        stage: (statistics.median(f for f, _ in pairs), statistics.median(last for _, last in pairs))
        for stage, pairs in rows.items()
    }
    nan = float("nan")
    return table, len(gaps), statistics.median(batch_ms) if batch_ms else nan, statistics.median(gaps) if gaps else nan


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--serve-args", default="", help="more flags for every server (device, dtype, compile, steps)")
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--batch-window-ms", type=float, default=2.0)
    p.add_argument("--robots", default="1,32", help="robot counts, comma-separated, each run on every server")
    p.add_argument("--n", type=int, default=30, help="measured requests per robot")
    p.add_argument("--warmup", type=int, default=5, help="warm-up requests per robot")
    p.add_argument("--frontend", default="inline,process:4", help="comma-separated, as bench/runtime.py takes it")
    p.add_argument(
        "--serve-variant",
        action="append",
        default=None,
        help="each front-end also as this variant: NAME=VALUE environment words (PYTHONPATH=... for another tree), "
        "then more flags; repeatable, an empty one is the plain server",
    )
    p.add_argument("--out", default="bench/results/cycle-trace.md")
    args = p.parse_args()

    robots = [int(x) for x in args.robots.split(",")]
    servers = [f"{fe} {v}".strip() for fe in args.frontend.split(",") for v in (args.serve_variant or [""])]
    results = {fe: trace(args.checkpoint, args, fe, robots) for fe in servers}
    columns = [(fe, count) for count in robots for fe in results]
    summaries = {
        (fe, count): cycles(results[fe]["runs"][count]["records"], results[fe]["processes"], min(count, args.max_batch))
        for fe, count in columns
    }
    lines = [
        f"# A closed loop's turnaround, stage by stage ({platform.machine()}, {os.cpu_count()} cores)",
        "",
        f"Robots: one process each, closed loop, {args.warmup} warm-up and {args.n} measured requests each; "
        f"--max-batch {args.max_batch}, --batch-window-ms {args.batch_window_ms:g}. Milliseconds after a full "
        "batch's end (the replica's call returned on the lane's thread; full: every robot in it): the median "
        "over cycles of each stage's first and last timestamp before the next full batch's call begins.",
        "",
        "| stage | " + " | ".join(f"{fe}, {count} robots: first | last" for fe, count in columns) + " |",
        "|---|" + "---:|---:|" * len(columns),
    ]
    for stage, what in STAGES:
        cells = []
        for column in columns:
            first_last = summaries[column][0].get(stage)
            cells += [f"{first_last[0]:.2f}", f"{first_last[1]:.2f}"] if first_last else ["-", "-"]
        lines.append(f"| {what} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| front-end | robots | cycles | batch ms (median) | gap ms (median): batch end to the next call | req/s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (fe, count), (_, n_cycles, batch, gap) in summaries.items():
        rps = results[fe]["runs"][count]["rps"]
        lines.append(f"| {fe} | {count} | {n_cycles} | {batch:.2f} | {gap:.2f} | {rps:.0f} |")
    lines += ["", f"Reproduce: `python bench/cycle_trace.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`", ""]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
