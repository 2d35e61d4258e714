"""LeRobot's robot_client protocol against one server: N clients at once vs one (issue 41's target: 8 >= 4x one).

Starts ``policyserver serve --policy lerobot --lerobot-grpc-port 0`` on a
tiny SmolVLA written offline (``--checkpoint`` for another), then runs each
client count for ``--seconds``: every client is a process of its own with its own gRPC
connection, driving LeRobot's stub exactly as ``RobotClient`` does (Ready,
pickled ``RemotePolicyConfig``, then a loop of ``SendObservations`` with a
must-go ``TimedObservation`` in LeRobot's chunks and ``GetActions``).  A
request is one observation answered with its chunk.  LeRobot's own
``policy_server`` serves one client at a time (each ``Ready`` resets it), so
its N-client rate is its one-client rate at best; here the clients' requests
share the replica's batches (``--max-batch``).  Writes a markdown table to
``--out`` (default bench/results/grpc-clients-<device>.md).

    python bench/grpc_clients.py --clients 1,8 --seconds 20
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from harness import free_port, serve  # noqa: E402


class Client:
    """One robot: LeRobot's stub on its own connection, as RobotClient drives it."""

    def __init__(self, address: str, features: dict[str, Any], raw: dict[str, Any], chunk: int) -> None:
        import grpc
        from lerobot.async_inference.helpers import RemotePolicyConfig
        from lerobot.transport import services_pb2, services_pb2_grpc
        from lerobot.transport.utils import grpc_channel_options

        self.pb = services_pb2
        options = [*grpc_channel_options(), ("grpc.use_local_subchannel_pool", 1)]  # a connection per robot
        self.channel = grpc.insecure_channel(address, options)
        self.stub = services_pb2_grpc.AsyncInferenceStub(self.channel)
        self.stub.Ready(services_pb2.Empty())
        config = RemotePolicyConfig("smolvla", "lerobot/smolvla_base", features, chunk)
        self.stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(config)))
        self.raw = raw
        self.latencies: list[float] = []

    def one(self, step: int) -> None:
        from lerobot.async_inference.helpers import TimedObservation
        from lerobot.transport.utils import send_bytes_in_chunks

        started = time.perf_counter()
        obs = TimedObservation(timestamp=time.time(), timestep=step, observation=self.raw, must_go=True)
        self.stub.SendObservations(send_bytes_in_chunks(pickle.dumps(obs), self.pb.Observation))
        reply = self.stub.GetActions(self.pb.Empty(), timeout=120)
        if not reply.data or not pickle.loads(reply.data):
            raise RuntimeError("GetActions answered empty")
        self.latencies.append(time.perf_counter() - started)


def _robot_process(
    address: str, seconds: float, features: dict[str, Any], raw: dict[str, Any], chunk: int, barrier: Any, out: Any
) -> None:
    """One robot_client in a process of its own (as LeRobot runs one per robot): connect, one warm-up request, wait
    for the others, then a closed loop for ``seconds``; its latencies go back through ``out``."""
    try:
        robot = Client(address, features, raw, chunk)
        robot.one(0)
        robot.latencies.clear()
        barrier.wait(timeout=300)
        stop = time.monotonic() + seconds
        step = 1
        while time.monotonic() < stop:
            robot.one(step)
            step += 1
        robot.channel.close()
        out.put(robot.latencies)
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put(repr(exc))


def run(
    address: str, clients: int, seconds: float, features: dict[str, Any], raw: dict[str, Any], chunk: int
) -> dict[str, float]:
    """``clients`` robot_clients at once, each in its own process (threads of one process would share its GIL, and
    the clients' pickling would bound the rate, not the server)."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(clients), ctx.Queue()
    procs = [
        ctx.Process(target=_robot_process, args=(address, seconds, features, raw, chunk, barrier, out))
        for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    for proc in procs:
        proc.join(timeout=60)
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"a robot_client failed: {errors[0]}")
    lat = [x for per in results for x in per]
    return {
        "requests": len(lat),
        "req_s": len(lat) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat, 99)) * 1e3,
    }


def run_websocket(url: str, clients: int, seconds: float) -> dict[str, float]:
    """The same load from openpi WebSocket clients (the robots of the other protocol), for comparison on the same
    server and machine: one ``infer`` per request, each client its own connection and session."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from policy_operator.runtime.robolab import robolab_observation

    robots = [WebsocketClientPolicy(url) for _ in range(clients)]
    obs = robolab_observation(robots[0].get_server_metadata(), 0)
    for robot in robots:
        robot.infer(obs)
    latencies: list[list[float]] = [[] for _ in robots]
    stop = time.monotonic() + seconds

    def loop(k: int) -> None:
        while time.monotonic() < stop:
            started = time.perf_counter()
            robots[k].infer(obs)
            latencies[k].append(time.perf_counter() - started)

    threads = [threading.Thread(target=loop, args=(k,)) for k in range(clients)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    lat = [x for per in latencies for x in per]
    return {
        "requests": len(lat),
        "req_s": len(lat) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat, 99)) * 1e3,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="a LeRobot SmolVLA directory (default: a tiny one written here)")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--serve-args", default="--threads 1", help="more serve flags, e.g. '--dtype bfloat16 --compile'")
    p.add_argument("--websocket", action="store_true", help="also the same client counts over the WebSocket port")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="grpc-clients-"))
    os.chdir(work)  # LeRobot's async_inference modules open log files under ./logs
    from lerobot.utils.feature_utils import hw_to_dataset_features

    from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint

    checkpoint = Path(args.checkpoint) if args.checkpoint else write_tiny_checkpoint("smolvla", work / "ckpt", seed=1)
    config = __import__("json").loads((checkpoint / "config.json").read_text())
    inputs = config["input_features"]
    state_dim = inputs["observation.state"]["shape"][0]
    cameras = {k.removeprefix("observation.images."): v["shape"] for k, v in inputs.items() if "images" in k}
    chunk = int(config.get("n_action_steps") or config["chunk_size"])
    motors = [f"joint{i}.pos" for i in range(state_dim)]
    hw: dict[str, Any] = {**dict.fromkeys(motors, float), **{k: (s[1], s[2], s[0]) for k, s in cameras.items()}}
    features = hw_to_dataset_features(hw, "observation")
    rng = np.random.default_rng(0)
    raw: dict[str, Any] = {m: float(v) for m, v in zip(motors, rng.standard_normal(state_dim), strict=True)}
    raw.update({k: rng.integers(0, 256, (s[1], s[2], s[0]), dtype=np.uint8) for k, s in cameras.items()})
    raw["task"] = "pick up the cube"

    grpc_port = free_port()
    options = {"policy": "lerobot", "lerobot_grpc_port": grpc_port, "device": args.device, "max_batch": args.max_batch}
    rows = []
    with serve(checkpoint, log=work / "server.log", flags=args.serve_args.split(), **options) as server:
        ws_port = server.port
        for n in [int(c) for c in args.clients.split(",")]:
            for protocol in ("gRPC (LeRobot)", "WebSocket (openpi)") if args.websocket else ("gRPC (LeRobot)",):
                if protocol.startswith("gRPC"):
                    result = run(f"127.0.0.1:{grpc_port}", n, args.seconds, features, raw, chunk)
                else:
                    result = run_websocket(f"ws://127.0.0.1:{ws_port}", n, args.seconds)
                rows.append((protocol, n, result))
                print(protocol, n, {k: round(v, 2) for k, v in result.items()}, flush=True)
    base = {protocol: r["req_s"] for protocol, n, r in reversed(rows)}  # each protocol's first (fewest clients) row
    lines = [
        "# LeRobot's robot_client protocol (gRPC AsyncInference): N clients at once vs one",
        "",
        f"Machine: {platform.machine()}, {os.cpu_count()} cores; device {args.device}; checkpoint "
        f"{'a tiny SmolVLA written offline' if not args.checkpoint else args.checkpoint}; --max-batch {args.max_batch} "
        f"{args.serve_args}; {args.seconds:g} s per row; each client its own gRPC connection, one observation "
        "(must_go) then GetActions per request, as RobotClient sends them, one process per client. LeRobot's own policy_server serves one "
        "client at a time (every Ready resets it).",
        "",
        "| protocol | clients | requests | req/s | x one client | p50 ms | p99 ms |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for protocol, n, r in rows:
        lines.append(
            f"| {protocol} | {n} | {r['requests']:.0f} | {r['req_s']:.1f} | {r['req_s'] / base[protocol]:.2f} | "
            f"{r['p50_ms']:.1f} | {r['p99_ms']:.1f} |"
        )
    lines += [
        "",
        "Target (issue 41): 8 clients >= 4x one client's req/s.",
        "",
        f"Reproduce: `python bench/grpc_clients.py --clients {args.clients} --seconds {args.seconds:g}`",
    ]
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"grpc-clients-{args.device}.md"
    out.write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
