"""Two-GPU checks for cfgp=2 / dp=2 over NCCL (the 2-GPU issue), runnable on CPU too.

On `nvidia-h200-x2` (NCCL_NVLS_ENABLE=0 stays set):

    python bench/two_gpu.py --device cuda --pg-timeout-s 60 --idle-s 75
    python bench/runtime.py --device cuda --size base --dtype bfloat16 --compile reduce-overhead \
        --checkpoint /tmp/base --n 30 --clients 1,8 --out bench/results/h200x2.md

This script checks, with real servers: a request succeeds after idling longer than the
NCCL process-group timeout (TORCH_NCCL_ASYNC_ERROR_HANDLING=1), and a bad request and a
request that fails inside one rank's compute leave both cfgp=2 ranks alive.  On CPU
(`--device cpu --pg-timeout-s 2 --idle-s 4`) it exercises the same code over gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import numpy as np
from harness import serve  # bench/ is sys.path[0] when a benchmark runs as a script

REPO = Path(__file__).resolve().parents[1]


def readyz(port: int) -> tuple[int | None, dict | None]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())
    except OSError:
        return None, None


def request(port: int, prompt: str = "pick up the cup", seed: int = 3):
    from websockets.sync.client import connect

    from policy_operator.runtime.client import robolab_observation
    from policy_operator.runtime.serving import wire

    with connect(f"ws://127.0.0.1:{port}", compression=None, max_size=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=60))
        obs = robolab_observation(meta, 1, fixed_seed=seed)
        obs["prompt"] = prompt
        ws.send(wire.packb(obs))
        reply = ws.recv(timeout=300)
        return reply if isinstance(reply, str) else wire.unpackb(reply)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="small")
    p.add_argument("--pg-timeout-s", type=float, default=60.0)
    p.add_argument("--idle-s", type=float, default=75.0)
    p.add_argument("--port", type=int, default=18300)
    args = p.parse_args()

    from policy_operator.runtime.policy.reference import init_checkpoint

    ckpt = init_checkpoint(Path(tempfile.mkdtemp()) / args.size, args.size)
    env = dict(
        os.environ,
        TORCH_NCCL_ASYNC_ERROR_HANDLING="1",
        NCCL_NVLS_ENABLE="0",
        PYTHONPATH=str(REPO / "tests" / "support"),
    )  # the planted-failure policy
    results: list[tuple[str, bool, str]] = []
    with contextlib.ExitStack() as stack:
        try:
            server = stack.enter_context(
                serve(
                    ckpt,
                    port=args.port,
                    env=env,
                    ready_timeout_s=300,
                    cfgp=2,
                    device=args.device,
                    pg_timeout_s=args.pg_timeout_s,
                    policy="faulty_policy:FaultyPolicy",
                    log_level="WARNING",
                )
            )
        except (RuntimeError, TimeoutError) as exc:
            print(f"server did not become ready: {exc}", file=sys.stderr)
            return 1
        proc = server.proc
        sys.path.insert(0, str(REPO))
        from tests.support.servers import rank_pids  # /readyz publishes no PIDs: read them from the processes

        pids = rank_pids(proc.pid)
        first = request(args.port)
        results.append(("first request", isinstance(first, dict), ""))
        time.sleep(args.idle_s)
        after = request(args.port)
        same = isinstance(after, dict) and np.array_equal(np.asarray(after["actions"]), np.asarray(first["actions"]))
        results.append((f"request after {args.idle_s:.0f}s idle (PG timeout {args.pg_timeout_s:.0f}s)", same, ""))
        for prompt in (123, "explode:cond", "explode:uncond"):
            reply = request(args.port, prompt=prompt)
            results.append(
                (f"bad request prompt={prompt!r} answered with an error", isinstance(reply, str), str(reply)[:80])
            )
        again = request(args.port)
        ok = isinstance(again, dict) and np.array_equal(np.asarray(again["actions"]), np.asarray(first["actions"]))
        results.append(("good request after the bad ones", ok, ""))
        status, _ = readyz(args.port)
        alive = status == 200 and rank_pids(proc.pid) == pids
        results.append(("both ranks alive, same pids, /readyz 200", alive, str(pids)))
    print(f"\n| check ({args.device}, cfgp=2) | result | detail |\n|---|---|---|")
    for name, ok, detail in results:
        print(f"| {name} | {'pass' if ok else 'FAIL'} | {detail} |")
    return 0 if all(ok for _, ok, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
