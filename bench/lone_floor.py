"""The floor under issue 24's one-robot target: what a WebSocket round trip adds to a fixed compute time when the
server does nothing else.

Issue 24 asks one robot's p50 round trip to be at most the in-process batch-1 time + 1 ms.  What the robot sees
over the compute is the hops every Python WebSocket server of the openpi protocol has (the frame over loopback,
the server's event loop waking, msgpack both ways, the reply back, the client's own threads waking), plus the
server's own work (validation, prepare, the hop to the model thread and back).  This measures the first part
alone, so the second can be read off beside it: floor servers that decode the frame with the runtime's wire
module, wait ``--compute-ms`` and send a reply of the same shape, on the same event loop (uvloop when installed)
and the same ``websockets`` server, against the same client (``runtime/client.py``, one robot, closed loop):

- ``loop``: the wait on the event loop itself (``asyncio.sleep``): no thread hop at all;
- ``spin``: the wait on a worker thread that spins (GIL released), as one in ``cudaStreamSynchronize`` does, and
  hands the reply back with ``call_soon_threadsafe``: the least a server with a model thread can do;
- ``sleep``: the same with a worker thread that sleeps (its core may go idle, as a CPU model's may not);
- ``spin-awake``: ``spin``, and the event loop wakes every 0.1 ms over the last 1 ms of the wait: does a loop
  kept from deep idle take the reply sooner (what a server could do knowing its warm-up's batch times)?

With ``--checkpoint`` the real server (``policyserver serve``, inline front-end, ``--serve-args``; one per
``--serve-variant``) runs in the same rounds, and its row's "over compute" is round trip minus its own
``infer_ms``.  Rounds interleave the
servers, so the rows compare like with like.

    python bench/lone_floor.py --compute-ms 2 --checkpoint /tmp/ckpt --serve-args "--steps 2"
    python bench/lone_floor.py --compute-ms 14.8 --checkpoint /tmp/base \\
        --serve-args "--device cuda --dtype bfloat16 --compile reduce-overhead --max-batch 8"   # on the H200
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import os
import platform
import shlex
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
from harness import free_port, stop_group
from harness import serve as serve_policy
from report import publish  # bench/ is sys.path[0] when a benchmark runs as a script

from runtime import split_variant

VARIANTS = ("loop", "spin", "sleep", "spin-awake")
AWAKE_MS = 1.0  # spin-awake: the loop ticks every TICK_MS over the last AWAKE_MS of the wait
TICK_MS = 0.1


def serve(variant: str, port: int, compute_ms: float) -> None:
    """A floor server: decode, wait ``compute_ms`` (``variant``), reply with a (50, 8) float32 chunk."""
    from websockets.asyncio.server import serve as ws_serve

    from policy_operator.runtime.serving import wire
    from policy_operator.runtime.serving.event_loop import event_loop_factory

    actions = np.zeros((50, 8), np.float32)
    seconds = compute_ms / 1e3
    pool = ThreadPoolExecutor(1)  # one long-lived model thread, as the inline server's lane has

    block = bytes(16384)

    def spin(loop: asyncio.AbstractEventLoop, future: asyncio.Future[float]) -> None:
        """Busy for ``seconds`` with the GIL mostly released (hashlib drops it for large buffers), as a thread in
        ``cudaStreamSynchronize`` is: the event loop is not kept from the GIL while it waits."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            hashlib.sha256(block)
        loop.call_soon_threadsafe(future.set_result, (time.perf_counter() - t0) * 1e3)

    def nap(loop: asyncio.AbstractEventLoop, future: asyncio.Future[float]) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        loop.call_soon_threadsafe(future.set_result, (time.perf_counter() - t0) * 1e3)

    def tick(future: asyncio.Future[float]) -> None:
        """Wake the loop every TICK_MS until the reply is in, so its core is not deep asleep when it comes."""
        if not future.done():
            asyncio.get_running_loop().call_later(TICK_MS / 1e3, tick, future)

    async def handler(ws) -> None:  # noqa: ANN001 - websockets' ServerConnection
        loop = asyncio.get_running_loop()
        await ws.send(wire.packb({"policy_name": f"floor-{variant}"}))
        async for message in ws:
            started = time.perf_counter()
            wire.unpackb(message)
            if variant == "loop":
                t0 = time.perf_counter()
                await asyncio.sleep(seconds)
                compute = (time.perf_counter() - t0) * 1e3
            else:
                future: asyncio.Future[float] = loop.create_future()
                work = nap if variant == "sleep" else spin
                pool.submit(work, loop, future)
                if variant == "spin-awake":
                    loop.call_later(max(0.0, seconds - AWAKE_MS / 1e3), tick, future)
                compute = await future
            timing = {"infer_ms": compute, "total_ms": (time.perf_counter() - started) * 1e3}
            await ws.send(wire.packb({"actions": actions, "server_timing": timing}))

    async def main() -> None:
        async with ws_serve(handler, "127.0.0.1", port, compression=None, max_size=None):
            print("ready", flush=True)
            await asyncio.Future()

    factory = event_loop_factory("auto")
    if factory is None:
        asyncio.run(main())
    else:
        with asyncio.Runner(loop_factory=factory) as runner:
            runner.run(main())


def wait_port(port: int) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {port}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--serve", choices=VARIANTS, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--compute-ms", type=float, default=14.8, help="the floor servers' wait (default %(default)s)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--checkpoint", default=None, help="also the real server on this checkpoint")
    p.add_argument("--serve-args", default="", help="more flags for the real server")
    p.add_argument(
        "--serve-variant",
        action="append",
        help="one real server per use, with these flags on top of --serve-args, after any NAME=VALUE words for "
        "its environment, e.g. 'PYTHONPATH=/tmp/old' for another tree (default: one, with none)",
    )
    p.add_argument("--n", type=int, default=200, help="requests per server per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", default="bench/results/lone-floor.md")
    args = p.parse_args()
    args.serve_variant = args.serve_variant or [""]
    if args.serve:
        serve(args.serve, args.port, args.compute_ms)
        return

    from policy_operator.runtime.client import run_client

    urls: dict[str, str] = {}  # every server, floors and real ones, by name
    floors: list[subprocess.Popen[bytes]] = []
    with contextlib.ExitStack() as real_servers:
        try:
            for variant in args.variants.split(","):
                port = free_port()
                cmd = [
                    sys.executable,
                    __file__,
                    "--serve",
                    variant,
                    "--port",
                    str(port),
                    "--compute-ms",
                    str(args.compute_ms),
                ]
                floors.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, start_new_session=True))
                wait_port(port)
                urls[f"floor, {variant}"] = f"ws://127.0.0.1:{port}"
            for variant in args.serve_variant if args.checkpoint else []:
                env, words = split_variant(variant)
                name = f"policyserver serve {variant}".strip()
                served = real_servers.enter_context(
                    serve_policy(
                        args.checkpoint, env=env, flags=[*shlex.split(args.serve_args), *words], log_level="WARNING"
                    )
                )
                urls[name] = served.url
            over: dict[str, list[float]] = {name: [] for name in urls}
            compute: dict[str, list[float]] = {name: [] for name in urls}
            for url in urls.values():
                run_client(url, 20)  # warm: the connection path, the real server's graphs
            for _ in range(args.rounds):
                for name, url in urls.items():
                    s = run_client(url, args.n)
                    if s["errors"]:
                        raise RuntimeError(f"{name}: {s['errors'][:3]}")
                    over[name] += [r["rtt_ms"] - r["infer_ms"] for r in s["records"]]
                    compute[name] += [r["infer_ms"] for r in s["records"]]
        finally:
            for proc in floors:
                stop_group(proc)
    lines = [
        f"# One robot's round trip over the compute: floor servers against the real server ({platform.machine()}, "
        f"{os.cpu_count()} cores)",
        "",
        f"One robot (runtime/client.py, RoboLab-shaped frames, closed loop), {args.rounds} interleaved rounds of "
        f"{args.n} requests per server. Over compute: round trip minus the server's own compute (the floors' wait, "
        "the real server's infer_ms).",
        "",
        "| server | compute p50 ms | over compute p50 ms | p10 | p90 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in urls:
        o = np.asarray(over[name])
        lines.append(
            f"| {name} | {np.percentile(compute[name], 50):.2f} | {np.percentile(o, 50):.3f} | "
            f"{np.percentile(o, 10):.3f} | {np.percentile(o, 90):.3f} |"
        )
    lines += ["", f"Reproduce: `python bench/lone_floor.py {' '.join(shlex.quote(a) for a in sys.argv[1:])}`", ""]
    publish(lines, args.out)


if __name__ == "__main__":
    main()
