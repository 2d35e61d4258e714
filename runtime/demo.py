"""Demo: a tiny checkpoint, served on one rank and CFG-parallel on two, same actions from both.

What a newcomer wants to see in a minute: the server speaks the openpi
protocol, the cfgp=2 layout really runs two ranks under torchrun, and the
parallel layout returns bitwise the same actions as the single rank.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import numpy as np

LAYOUTS = [(1, 1), (2, 1)]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dir", default=".cache/demo", help="where the checkpoint goes (default %(default)s)")
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--n", type=int, default=20, help="requests per layout")


def _ready(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return json.loads(r.read())
    except Exception:  # noqa: BLE001 - not up yet
        return None


def _serve(checkpoint: Path, port: int, cfgp: int, dp: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "policy_operator.cli",
        "serve",
        "--checkpoint",
        str(checkpoint),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--cfgp",
        str(cfgp),
        "--dp",
        str(dp),
        "--threads",
        "1",
        "--log-level",
        "WARNING",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)


def _one(url: str, seed: int) -> np.ndarray:
    from websockets.sync.client import connect

    from policy_operator.runtime.client import robolab_observation
    from policy_operator.runtime.serving import wire

    with connect(url, compression=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=30))
        ws.send(wire.packb(robolab_observation(meta, 7, fixed_seed=seed)))
        return np.array(wire.unpackb(ws.recv(timeout=60))["actions"])


def main(args: argparse.Namespace) -> int:
    from policy_operator.runtime.client import run_client
    from policy_operator.runtime.policy.reference import init_checkpoint

    checkpoint = Path(args.dir) / "checkpoint-tiny"
    if not (checkpoint / "manifest.json").exists():
        init_checkpoint(checkpoint, "tiny")
    print(f"checkpoint: {checkpoint} (reference flow-matching policy, tiny)\n")
    rows, actions = [], {}
    for cfgp, dp in LAYOUTS:
        proc = _serve(checkpoint, args.port, cfgp, dp)
        try:
            deadline = time.monotonic() + 120
            while not ((r := _ready(args.port)) and r["ready"]):
                if proc.poll() is not None or time.monotonic() > deadline:
                    print(proc.stderr.read().decode() if proc.stderr else "", file=sys.stderr)
                    print(f"server for cfgp={cfgp},dp={dp} did not become ready", file=sys.stderr)
                    return 1
                time.sleep(0.2)
            url = f"ws://127.0.0.1:{args.port}"
            actions[(cfgp, dp)] = _one(url, seed=42)
            s = run_client(url, args.n)
            rows.append((f"cfgp={cfgp},dp={dp}", r["ranks_ready"], r["world_size"], s))
        finally:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
    print(f"{'layout':<14} {'ranks ready':>11} {'requests':>9} {'p50 ms':>8} {'p99 ms':>8} {'actions':>8}")
    for label, ready, world, s in rows:
        shape = "x".join(map(str, s["action_shapes"][0])) if s["action_shapes"] else "-"
        print(
            f"{label:<14} {f'{ready}/{world}':>11} {s['requests']:>9} {s['latency_ms']['p50']:>8.1f} "
            f"{s['latency_ms']['p99']:>8.1f} {shape:>8}"
        )
    a, b = actions[LAYOUTS[0]], actions[LAYOUTS[1]]
    same = np.array_equal(a, b)
    print(f"\nseed 42, first action: {np.array2string(a[0], precision=3)}")
    print(f"cfgp=2 actions bitwise equal to single rank: {same}")
    return 0 if same and all(s["requests"] == args.n for *_, s in rows) else 1
