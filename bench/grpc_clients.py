"""LeRobot's robot_client protocol against one server: N clients at once vs one (issue 41's target: 8 >= 4x one).

Starts ``policyserver serve --policy lerobot --lerobot-grpc-port PORT`` on a
tiny SmolVLA written offline (``--checkpoint`` for another), then runs each
client count for ``--seconds``: every client is a process of its own with its own gRPC
connection, driving LeRobot's stub exactly as ``RobotClient`` does (Ready,
pickled ``RemotePolicyConfig``, then a loop of ``SendObservations`` with a
must-go ``TimedObservation`` in LeRobot's chunks and ``GetActions``).  A
request is one observation answered with its chunk.  LeRobot's own
``policy_server`` serves one client at a time (each ``Ready`` resets it), so
its N-client rate is its one-client rate at best; here the clients' requests
share the replica's batches (``--max-batch``).

Per row it also reads where the CPU went: the server's (its process group's
CPU time from /proc over the row, per request), the clients' (each client
process's own CPU time, per request) and the mean batch the replica ran
(``policy_batch_size`` from /metrics).  ``--tree LABEL=PATH`` (repeatable)
serves another tree (a git archive, through ``harness.import_root``; an empty
PATH is this one), ``--rounds`` interleaves the trees so a shared machine's
drift falls on all of them.  Writes a markdown table to ``--out`` (default
bench/results/grpc-clients-<device>.md).

    python bench/grpc_clients.py --clients 1,8 --seconds 20
    git archive 0b37693 | tar -x -C /tmp/before
    python bench/grpc_clients.py --tree before=/tmp/before --tree after= --rounds 3 --seconds 10
    python bench/grpc_clients.py --device cuda --clients 1,8,16 --seconds 20   # a GPU host
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import pickle
import platform
import queue
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
from harness import free_port, import_root, serve  # noqa: E402
from report import publish  # noqa: E402

TICK_S = 1.0 / os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 0.01


def group_cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` and every process under it, all their threads (/proc)."""
    total, todo = 0.0, [pid]
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) * TICK_S
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue  # it ended meanwhile
    return total


def batches(port: int) -> tuple[float, float]:
    """The replica's ``policy_batch_size`` histogram (count, sum) from the server's /metrics."""
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:  # noqa: S310 - loopback
        text = r.read().decode()
    count = total = 0.0
    for line in text.splitlines():
        if line.startswith("policy_batch_size_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("policy_batch_size_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


PATTERNS = {
    # RobotClient's own: its receive_actions thread keeps a GetActions pending; the control loop sends observations
    "robot-client": "gRPC (LeRobot), GetActions pending",
    # one RPC after the other on one thread: SendObservations, then GetActions
    "sequential": "gRPC (LeRobot), one RPC after the other",
}


class Client:
    """One robot: LeRobot's stub on its own connection, as RobotClient drives it.  ``pattern`` ``robot-client``:
    a thread keeps a GetActions pending, as RobotClient's ``receive_actions`` thread does, while the caller sends
    the observations (RobotClient's control loop); ``sequential``: SendObservations then GetActions, one thread."""

    def __init__(
        self, address: str, features: dict[str, Any], raw: dict[str, Any], chunk: int, pattern: str = "robot-client"
    ) -> None:
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
        self.running = True
        self.answers: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self.receiver: threading.Thread | None = None
        if pattern == "robot-client":
            self.receiver = threading.Thread(target=self._receive, name="receive_actions", daemon=True)
            self.receiver.start()

    def _receive(self) -> None:
        """RobotClient's ``receive_actions``: GetActions again and again; an empty answer (no observation within
        the server's wait) is skipped, a chunk goes to ``answers``."""
        import grpc

        while self.running:
            try:
                reply = self.stub.GetActions(self.pb.Empty(), timeout=120)
            except grpc.RpcError as exc:
                if self.running:
                    self.answers.put(exc)
                return
            if reply.data:
                self.answers.put(pickle.loads(reply.data))

    def one(self, step: int) -> None:
        from lerobot.async_inference.helpers import TimedObservation
        from lerobot.transport.utils import send_bytes_in_chunks

        started = time.perf_counter()
        obs = TimedObservation(timestamp=time.time(), timestep=step, observation=self.raw, must_go=True)
        self.stub.SendObservations(send_bytes_in_chunks(pickle.dumps(obs), self.pb.Observation))
        if self.receiver is None:
            reply = self.stub.GetActions(self.pb.Empty(), timeout=120)
            if not reply.data or not pickle.loads(reply.data):
                raise RuntimeError("GetActions answered empty")
        else:
            while True:  # this observation's chunk (it starts at its timestep)
                answer = self.answers.get(timeout=120)
                if isinstance(answer, Exception):
                    raise answer
                if answer and answer[0].get_timestep() == step:
                    break
        self.latencies.append(time.perf_counter() - started)

    def close(self) -> None:
        self.running = False
        self.channel.close()  # ends the pending GetActions


def _robot_process(
    address: str,
    seconds: float,
    features: dict[str, Any],
    raw: dict[str, Any],
    chunk: int,
    pattern: str,
    barrier: Any,
    out: Any,
) -> None:
    """One robot_client in a process of its own (as LeRobot runs one per robot): connect, one warm-up request, wait
    for the others, then a closed loop for ``seconds``; its latencies and CPU seconds go back through ``out``."""
    try:
        robot = Client(address, features, raw, chunk, pattern)
        robot.one(0)
        robot.latencies.clear()
        barrier.wait(timeout=300)
        cpu = time.process_time()
        stop = time.monotonic() + seconds
        step = 1
        while time.monotonic() < stop:
            robot.one(step)
            step += 1
        cpu = time.process_time() - cpu
        robot.close()
        out.put((robot.latencies, cpu))
    except BaseException as exc:  # noqa: BLE001 - reported by the parent
        out.put(repr(exc))


class Watch:
    """The server's CPU seconds and the replica's batches over one row: ``start()`` when the closed loop starts,
    ``stop(requests)`` when it ends, then per-request CPU and the mean batch."""

    def __init__(self, pid: int, port: int) -> None:
        self.pid, self.port = pid, port

    def start(self) -> None:
        self.cpu, self.batches = group_cpu_s(self.pid), batches(self.port)

    def stop(self, requests: int) -> dict[str, float]:
        cpu, (count, total) = group_cpu_s(self.pid) - self.cpu, batches(self.port)
        count, total = count - self.batches[0], total - self.batches[1]
        return {"server_cpu_ms": cpu / max(requests, 1) * 1e3, "mean_batch": total / count if count else 0.0}


def run(
    address: str,
    clients: int,
    seconds: float,
    features: dict[str, Any],
    raw: dict[str, Any],
    chunk: int,
    watch: Watch,
    pattern: str = "robot-client",
) -> dict[str, float]:
    """``clients`` robot_clients at once, each in its own process (threads of one process would share its GIL, and
    the clients' pickling would bound the rate, not the server); ``watch`` starts at their common start."""
    ctx = multiprocessing.get_context("spawn")
    barrier, out = ctx.Barrier(clients + 1), ctx.Queue()
    procs = [
        ctx.Process(target=_robot_process, args=(address, seconds, features, raw, chunk, pattern, barrier, out))
        for _ in range(clients)
    ]
    for proc in procs:
        proc.start()
    barrier.wait(timeout=300)
    watch.start()
    results = [out.get(timeout=seconds + 600) for _ in procs]
    lat = [x for per, _ in results if not isinstance(per, str) for x in per]
    watched = watch.stop(len(lat))
    for proc in procs:
        proc.join(timeout=60)
    errors = [r for r in results if isinstance(r, str)]
    if errors:
        raise RuntimeError(f"a robot_client failed: {errors[0]}")
    return {
        "requests": len(lat),
        "req_s": len(lat) / seconds,
        "p50_ms": float(np.percentile(lat, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat, 99)) * 1e3,
        "client_cpu_ms": sum(cpu for _, cpu in results) / len(lat) * 1e3,
        **watched,
    }


def run_websocket(url: str, clients: int, seconds: float, watch: Watch) -> dict[str, float]:
    """The same load from openpi WebSocket clients (the robots of the other protocol), for comparison on the same
    server and machine: one ``infer`` per request, each client its own connection and session (threads of this
    process: their CPU is this process's)."""
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
    watch.start()
    cpu, started = time.process_time(), time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed, cpu = time.monotonic() - started, time.process_time() - cpu
    lat = [x for per in latencies for x in per]
    return {
        "requests": len(lat),
        "req_s": len(lat) / elapsed,
        "p50_ms": float(np.percentile(lat, 50)) * 1e3,
        "p99_ms": float(np.percentile(lat, 99)) * 1e3,
        "client_cpu_ms": cpu / len(lat) * 1e3,
        **watch.stop(len(lat)),
    }


def machine(device: str) -> str:
    """The host in words: CPU model and cores, and the GPU when serving on one."""
    model = (
        next(
            (
                line.split(":", 1)[1].strip()
                for line in Path("/proc/cpuinfo").read_text().splitlines()
                if "model name" in line
            ),
            platform.machine(),
        )
        if Path("/proc/cpuinfo").exists()
        else platform.machine()
    )
    words = f"{model}, {os.cpu_count()} cores"
    if device.startswith("cuda"):
        import torch

        words += f"; GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else "; no GPU visible here"
    return words


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--checkpoint", default=None, help="a LeRobot SmolVLA directory (default: a tiny one written here)")
    p.add_argument("--clients", default="1,8")
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--device", default="cpu", help="the server's device: cpu, or cuda on a GPU host")
    p.add_argument("--max-batch", type=int, default=8)
    p.add_argument("--serve-args", default="--threads 1", help="more serve flags, e.g. '--dtype bfloat16 --compile'")
    p.add_argument(
        "--pattern",
        default="robot-client",
        help="comma-separated: robot-client (a GetActions always pending, as RobotClient's receive thread keeps one) "
        "and/or sequential (SendObservations then GetActions on one thread)",
    )
    p.add_argument("--websocket", action="store_true", help="also the same client counts over the WebSocket port")
    p.add_argument(
        "--tree",
        action="append",
        default=[],
        metavar="LABEL=PATH",
        help="serve this tree (a git archive; an empty PATH is this checkout); repeat to compare trees",
    )
    p.add_argument("--rounds", type=int, default=1, help="rounds, each serving every tree in turn")
    p.add_argument("--out", default=None)
    args = p.parse_args()

    work = Path(tempfile.mkdtemp(prefix="grpc-clients-"))
    trees: dict[str, dict[str, str]] = {}
    for spec in args.tree or ["this="]:
        label, _, path = spec.partition("=")
        trees[label] = {"PYTHONPATH": str(import_root(Path(path), work))} if path else {}
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

    counts = [int(c) for c in args.clients.split(",")]
    patterns = {PATTERNS[name]: name for name in args.pattern.split(",")}
    protocols = [*patterns, *(["WebSocket (openpi)"] if args.websocket else [])]
    rows: list[tuple[int, str, str, int, dict[str, float]]] = []
    started_load = os.getloadavg()[0]
    host = machine(args.device)
    out = args.out or REPO / "bench" / "results" / f"grpc-clients-{args.device}.md"
    for round_ in range(args.rounds):
        for label, env in trees.items():
            grpc_port = free_port()
            options = {"lerobot_grpc_port": grpc_port, "device": args.device, "max_batch": args.max_batch}
            log = work / f"server-{label}-{round_}.log"
            with serve(checkpoint, env=env, log=log, flags=args.serve_args.split(), policy="lerobot", **options) as srv:
                watch = Watch(srv.proc.pid, srv.port)
                for n in counts:
                    for protocol in protocols:
                        if protocol in patterns:
                            address = f"127.0.0.1:{grpc_port}"
                            result = run(address, n, args.seconds, features, raw, chunk, watch, patterns[protocol])
                        else:
                            result = run_websocket(f"ws://127.0.0.1:{srv.port}", n, args.seconds, watch)
                        result["load"] = os.getloadavg()[0]
                        rows.append((round_, label, protocol, n, result))
                        print(round_, label, protocol, n, {k: round(v, 2) for k, v in result.items()}, flush=True)
                        publish(report(rows, args, host, started_load), out)  # a call cut short keeps its rows
    return 0


def report(
    rows: list[tuple[int, str, str, int, dict[str, float]]], args: argparse.Namespace, host: str, started_load: float
) -> list[str]:
    """The table, each row against its own round's, tree's and protocol's fewest-clients row, then the medians."""
    base = {(rnd, label, protocol): r["req_s"] for rnd, label, protocol, n, r in reversed(rows)}
    lines = [
        "# LeRobot's robot_client protocol (gRPC AsyncInference): N clients at once vs one",
        "",
        f"Machine: {host}; device {args.device}; checkpoint "
        f"{'a tiny SmolVLA written offline' if not args.checkpoint else args.checkpoint}; --max-batch {args.max_batch} "
        f"{args.serve_args}; {args.seconds:g} s per row; each client a process of its own with its own gRPC "
        "connection; a request is one observation (must_go) answered with its chunk: either with a GetActions kept "
        "pending by a thread of its own, as RobotClient's receive_actions thread keeps one, or SendObservations then "
        "GetActions one after the other. LeRobot's own "
        "policy_server serves one client at a time (every Ready resets it). Server CPU: the server's process group, "
        "per request; client CPU: the clients' own processes (the WebSocket clients: threads of the bench's). "
        f"Load average (1 min) {started_load:.2f} at the start, at each row's end in its column.",
        "",
        "| round | tree | protocol | clients | requests | req/s | x one client | p50 ms | p99 ms | mean batch "
        "| server CPU ms/req | client CPU ms/req | load |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for rnd, label, protocol, n, r in rows:
        lines.append(
            f"| {rnd} | {label} | {protocol} | {n} | {r['requests']:.0f} | {r['req_s']:.1f} | "
            f"{r['req_s'] / base[(rnd, label, protocol)]:.2f} | {r['p50_ms']:.1f} | {r['p99_ms']:.1f} | "
            f"{r['mean_batch']:.2f} | {r['server_cpu_ms']:.2f} | {r['client_cpu_ms']:.2f} | {r['load']:.1f} |"
        )
    lines += [
        "",
        "Medians over the rounds:",
        "",
        "| tree | protocol | clients | req/s | x one client |",
        "|---|---|---:|---:|---:|",
    ]
    for key in dict.fromkeys((label, protocol, n) for _, label, protocol, n, _ in rows):
        picked = [(rnd, r) for rnd, label, protocol, n, r in rows if (label, protocol, n) == key]
        rates = [r["req_s"] for _, r in picked]
        ratios = [r["req_s"] / base[(rnd, key[0], key[1])] for rnd, r in picked]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | {np.median(rates):.1f} | {np.median(ratios):.2f} |")
    lines += [
        "",
        "Target (issue 41): 8 clients >= 4x one client's req/s.",
        "",
        f"Reproduce: `python bench/grpc_clients.py {' '.join(sys.argv[1:])}`",
    ]
    return lines


if __name__ == "__main__":
    sys.exit(main())
