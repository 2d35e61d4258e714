"""The front-end process of ``--frontend process``: WebSocket I/O, decoding and ``prepare`` beside the model's.

They run out of the interpreter that launches the model.  Rank 0 starts it (``serving/engine_link.py``) before
it loads the model -- or several, each with its own listening socket on the port (``--frontend-processes``;
``rank0_front.ProcessFront``) -- and it serves the port from then on: connections, sessions, auth, connection
bounds, ``/healthz`` ``/readyz`` ``/metrics``, admission and draining are the
inline server's own code (``server.py``, ``admission.py``); only the engine
client differs (``mp_client.MPClient``), and ``--max-connections`` counts the
sessions of every front-end of the pod (``ipc.SessionCounts``).  Admission
decodes each frame, checks its ``rtc`` entry against the connection's memory
and prepares it with the policy's ``Preprocessor`` when it has one (else the
model process prepares the decoded observation); the client writes the bytes
into the shared-memory ring and sends the request's small description; the
Result comes back over the same socket.  The model process's event loop thus only routes, batches and answers,
and its model thread starts the next batch while this process is still
sending the last one's replies and decoding the next frames.

It answers to rank 0 only: SIGTERM and SIGINT are ignored (rank 0 gets them
and sends ``Drain``), and when rank 0 is gone -- its socket closed -- it exits
non-zero at once, so a pod never keeps a port open with no model behind it.
``/readyz`` is 503 whenever rank 0's last readiness snapshot is older than
``stale_after`` (a frozen model process).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import sys

import torch

from policy_operator.constants import ENV_PROMETHEUS_MULTIPROC_DIR
from policy_operator.runtime import ipc
from policy_operator.runtime.serving import heap
from policy_operator.runtime.serving.admission import FrontEnd
from policy_operator.runtime.serving.event_loop import event_loop_factory
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.mp_client import MPClient
from policy_operator.runtime.serving.server import PolicyWebSocketServer, Sessions, drain_sessions

log = logging.getLogger(__name__)

EXIT_ENGINE_GONE = 1  # the model process closed its socket without a drain


async def serve(config: ipc.FrontendConfig, channel: ipc.Channel, ring: ipc.SlotRing, counts: ipc.SessionCounts) -> int:
    """Serve the port until rank 0 says drain (exit 0) or goes away (``EXIT_ENGINE_GONE``); ``counts``: the open
    sessions of every front-end of the pod, which ``--max-connections`` bounds."""
    loop = asyncio.get_running_loop()
    metrics = ServerMetrics(
        config.layout, config.server.max_connections, multiprocess_dir=os.environ.get(ENV_PROMETHEUS_MULTIPROC_DIR)
    )
    sessions = Sessions(counts)
    client = MPClient(channel, ring, config, metrics, sessions.recent)
    # one intra-op thread on the admission thread too (``main`` sets this thread's; the setting is per thread)
    front = FrontEnd(client, scope=str(config.index), thread_init=lambda: torch.set_num_threads(1))
    server = PolicyWebSocketServer(front, config.server, metrics, sessions)
    done: asyncio.Future[int] = loop.create_future()

    async def drain(command: ipc.Drain) -> None:
        drained = await drain_sessions(server, front, grace_s=command.grace_s, heartbeat_s=command.heartbeat_s)
        channel.send(ipc.Drained(drained))
        if not done.done():
            done.set_result(0)

    def engine_gone() -> None:
        if done.done():
            return
        if client.draining:  # rank 0 stopped mid-drain (its own deadline): nothing left to serve
            done.set_result(0)
            return
        log.error("the model process is gone; the front-end exits %d", EXIT_ENGINE_GONE)
        done.set_result(EXIT_ENGINE_GONE)

    drains: set[asyncio.Task[None]] = set()

    def start_drain(command: ipc.Drain) -> None:
        task = asyncio.ensure_future(drain(command))
        drains.add(task)

    client.on_drain = start_drain
    await server.start()
    reporter = asyncio.ensure_future(client.report_recent_sessions())
    channel.listen(loop, client.on_message, engine_gone)
    channel.send(ipc.Listening(server.port))
    code = await done
    reporter.cancel()
    channel.finish()
    return code


def main(argv: list[str]) -> int:
    """``python -m policy_operator.runtime.serving.frontend SOCKET_FD RING_FD``, started by rank 0 only."""
    for sig in (signal.SIGTERM, signal.SIGINT):  # rank 0 decides when this process drains
        signal.signal(sig, signal.SIG_IGN)
    sock_fd, ring_fd = int(argv[0]), int(argv[1])
    channel = ipc.Channel(socket.socket(fileno=sock_fd))
    config: ipc.FrontendConfig = channel.recv()
    logging.basicConfig(
        level=config.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s frontend {config.index} %(levelname)s %(name)s: %(message)s",
    )
    sys.setswitchinterval(config.gil_switch_ms / 1e3)
    heap.keep_freed_blocks()  # every frame and prepared image is a block of the same few sizes
    # Nothing here is worth parallelizing, and an intra-op parallel op (a ``Preprocessor``'s resize or copy) would
    # wake a team of as many threads as the host has cores that spin on after it, against the model process.
    torch.set_num_threads(1)
    ring = ipc.SlotRing(ring_fd, config.slots, config.slot_bytes)
    os.close(ring_fd)  # mapped: the descriptor is no longer needed
    counts_fd = channel.recv_fd()  # rank 0 sends it after the configuration (``rank0_front.spawn_link``)
    counts = ipc.SessionCounts(counts_fd, config.processes, config.index)
    os.close(counts_fd)
    with asyncio.Runner(loop_factory=event_loop_factory(config.event_loop)) as runner:
        code = runner.run(serve(config, channel, ring, counts))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
