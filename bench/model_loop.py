"""CPU of ``--frontend process``'s model-process event loop per request, in bursts of robots, without a model.

Under many robots on one large batch the model process's loop is what is left
of the closed loop's turnaround (bench/results/h200-frontends.md): between
two batches it takes every front-end request (unpickle, copy out of the ring,
route, queue at the lane) and sends every answer back.  This runs that loop
as the server does -- ``FrontendLink`` over a socket pair, the shared-memory
ring, ``Ingress`` and a ``Lane`` whose replica answers at once on its own
thread -- against a forked stand-in front-end that writes prepared requests
into the ring and sends them in bursts of ``--burst`` (robots answered
together come back together) and waits for every answer before the next
burst.  Reported: the loop thread's CPU time per request, and the wall time
per request of the whole cycle.  To compare two trees side by side, run it
once per tree from outside the checkout with ``PYTHONPATH`` pointing at a
copy of the other tree laid out as the ``policy_operator`` package, rounds
interleaved (``--trees``).

    python bench/model_loop.py CHECKPOINT_DIR
    python bench/model_loop.py CHECKPOINT_DIR --trees /tmp/old/pp, --rounds 3 --out bench/results/model-loop-cpu.md
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pickle
import platform
import socket
import statistics
import struct
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WARMUP_BURSTS = 30


def run_once(checkpoint: Path, burst: int, bursts: int) -> dict[str, float]:
    """One measurement in this process (and a forked front-end); the policy_operator on sys.path is measured."""
    import numpy as np
    import uvloop

    from policy_operator.layout import ParallelLayout
    from policy_operator.readyz import RankReadiness, RankState
    from policy_operator.runtime import ipc
    from policy_operator.runtime.client import robolab_observation
    from policy_operator.runtime.engine.core import Engine
    from policy_operator.runtime.engine.history import SessionHistory
    from policy_operator.runtime.engine.link import FrontendLink
    from policy_operator.runtime.engine_api import PreparedRequest
    from policy_operator.runtime.parallel.dispatch import Batch, Lane, Outcome
    from policy_operator.runtime.policy.reference import PolicyConfig, ReferencePreprocessor
    from policy_operator.runtime.policy.sampler import SamplerSettings

    def encode(message: object) -> bytes:
        """One frame of the channel's stream (``ipc.Channel.send``'s format; ``ipc.frame`` where a tree has it)."""
        if hasattr(ipc, "frame"):
            return ipc.frame(message)
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        return struct.pack("!Q", len(data)) + data

    try:  # the heap as the model process tunes it once loaded (runtime/serving/heap.py), where the tree has it
        from policy_operator.runtime.serving import heap

        heap.keep_freed_blocks()
    except ImportError:
        pass
    cfg = PolicyConfig(**json.loads((checkpoint / "config.json").read_text()))
    preprocessor = ReferencePreprocessor(cfg)
    actions = np.zeros((cfg.horizon, cfg.action_dim), np.float32)
    slots, slot_bytes = burst, ipc.ring_geometry(1 << 20, 1 << 20)[1]
    ring_fd = ipc.create_ring_fd(slots, slot_bytes)
    ours, theirs = socket.socketpair()
    pid = os.fork()
    if pid == 0:  # the stand-in front-end: bursts of prepared requests, each waits for all its answers
        code = 0
        try:
            ours.close()
            ring, channel = ipc.SlotRing(ring_fd, slots, slot_bytes), ipc.Channel(theirs)
            observations = [robolab_observation({"joint_dim": 7, "gripper_dim": 1}, i) for i in range(burst)]
            ids = 0
            for _ in range(bursts + WARMUP_BURSTS):
                frames = []
                for slot, obs in enumerate(observations):
                    prepared = PreparedRequest(preprocessor.prepare(obs), None, None, f"robot-{slot}")
                    request = (
                        ring.write_request(ids, slot, prepared, burst)
                        if hasattr(ring, "write_request")
                        else ipc.request_of(ids, slot, ring, prepared, burst)  # a tree from before write_request
                    )
                    ids += 1
                    frames.append(encode(request))
                theirs.sendall(b"".join(frames))
                answered = 0
                while answered < burst:
                    if isinstance(channel.recv(), ipc.Answer):
                        answered += 1
        except BaseException:  # noqa: BLE001 - reported, and the parent sees the channel close
            import traceback

            traceback.print_exc()
            code = 1
        os._exit(code)
    theirs.close()

    class Board:
        def snapshot(self) -> list[RankReadiness]:
            return [RankReadiness(rank=0, dp_index=0, cfg_index=0, state=RankState.WARM, age_s=0.1, ready=True)]

    batches: list[int] = []

    def call(batch: Batch) -> list[Outcome]:
        batches.append(len(batch.requests))
        return [Outcome(r.request_id, 1.0, actions) for r in batch.requests]

    async def main() -> dict[str, float]:
        link = FrontendLink(ipc.Channel(ours), ipc.SlotRing(ring_fd, slots, slot_bytes), None, 1.0)
        ingress = Engine(
            ParallelLayout(),
            SamplerSettings(1, 3.0, "sequential"),
            Board(),
            request_timeout_s=60.0,
            recent_sessions=lambda: link.recent_sessions,
        )
        lane = Lane(
            0, ThreadPoolExecutor(1), call, lambda: None, max_batch=burst, window_s=0.002, expected=ingress.expected
        )
        ingress.lanes, ingress.policy, ingress.history = [lane], object(), SessionHistory(None)
        gone = asyncio.get_running_loop().create_future()
        start: list[float] = []
        answers = 0
        send = link.send

        def counting_send(message: object) -> None:
            nonlocal answers
            if isinstance(message, ipc.Answer):
                answers += 1
                if answers == WARMUP_BURSTS * burst:
                    start[:] = [time.perf_counter(), time.thread_time()]
            send(message)

        link.send = counting_send

        def on_gone() -> None:
            if not gone.done():
                gone.set_result(None)

        link.start(ingress, on_gone)
        await gone
        wall, cpu = time.perf_counter() - start[0], time.thread_time() - start[1]
        n = answers - WARMUP_BURSTS * burst
        if n != bursts * burst:
            raise SystemExit(f"the front-end stopped after {answers} answers")
        return {
            "loop_cpu_us": cpu / n * 1e6,
            "wall_us": wall / n * 1e6,
            "mean_batch": statistics.fmean(batches[WARMUP_BURSTS:]),
        }

    try:
        return uvloop.run(main())
    finally:
        os.waitpid(pid, 0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("checkpoint", type=Path, help="a reference checkpoint (its config sizes the requests)")
    p.add_argument("--burst", type=int, default=32, help="robots per burst, and the lane's max batch")
    p.add_argument("--bursts", type=int, default=300)
    p.add_argument("--rounds", type=int, default=1, help="rounds; each runs every tree once, interleaved")
    p.add_argument(
        "--trees",
        default="",
        help="comma-separated PYTHONPATH entries to compare, '' for the installed tree (e.g. '/tmp/old/pp,')",
    )
    p.add_argument("--labels", default="", help="comma-separated names of the trees in the table (default: the paths)")
    p.add_argument("--json", action="store_true", help="one measurement in this process, printed as JSON")
    p.add_argument("--out", default=None, help="markdown file (default: print only)")
    args = p.parse_args()
    if args.json:
        print(json.dumps(run_once(args.checkpoint.resolve(), args.burst, args.bursts)))
        return 0
    trees = args.trees.split(",")
    results: dict[str, list[dict[str, float]]] = {tree: [] for tree in trees}
    for _ in range(args.rounds):
        for tree in trees:
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            if tree:
                env["PYTHONPATH"] = tree
            out = subprocess.run(
                [sys.executable, str(Path(__file__).resolve()), str(args.checkpoint.resolve()), "--json",
                 "--burst", str(args.burst), "--bursts", str(args.bursts)],
                env=env, cwd="/", check=True, capture_output=True, text=True,
            )  # fmt: skip
            results[tree].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(tree or "(installed)", results[tree][-1], flush=True)
    lines = [
        f"# The model process's loop under --frontend process (bursts of {args.burst}, no model)",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores. {args.bursts} bursts per run after "
        f"{WARMUP_BURSTS} warm-up bursts, {args.rounds} round(s), trees interleaved; cells: each run.",
        "",
        "| tree | loop CPU us / request | wall us / request | mean batch |",
        "|---|---|---|---|",
    ]
    labels = args.labels.split(",") if args.labels else [tree or "(installed)" for tree in trees]
    for label, runs in zip(labels, results.values(), strict=True):
        lines.append(
            f"| {label} | {', '.join(f'{r["loop_cpu_us"]:.0f}' for r in runs)} | "
            f"{', '.join(f'{r["wall_us"]:.0f}' for r in runs)} | {', '.join(f'{r["mean_batch"]:.1f}' for r in runs)} |"
        )
    lines += ["", f"Reproduce: `python bench/model_loop.py CHECKPOINT --burst {args.burst} --bursts {args.bursts} "
              f"--rounds {args.rounds} --trees '{args.trees}'` (a tree other than the installed one: "
              "`git archive REV | tar -x -C /tmp/src`, then lay it out as the package: `/tmp/pp/policy_operator` from "
              "`policy_operator/`, with `runtime/` and `operator/` inside it)", ""]  # fmt: skip
    text = "\n".join(lines)
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
