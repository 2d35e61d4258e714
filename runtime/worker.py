"""The torchrun program: one process per rank of a ``cfgp x dp`` pod.

Global rank 0 hosts the ingress (WebSocket server + router) and drives replica
0; the drivers of replicas >= 1 wait for work from rank 0; cfg peers wait for
their driver.  Start-up order is chosen so a pod is observable at once: rank 0
binds the port first (``/healthz`` 200, ``/readyz`` 503 listing every rank as
loading), then rank 0 alone resolves (and if needed downloads) the checkpoint
while the others wait on the gloo control group, then every rank loads and
each replica warms itself up.

Run as ``torchrun --nproc-per-node=C*D -m policy_operator.runtime.worker
<serve flags>``; ``policyserver serve`` does exactly that, or runs this module
in-process when the layout has a single rank.

A replica whose communicator failed (``ReplicaFailed``) ends the pod: its
ranks publish ``failed`` and exit with ``ServeExit.REPLICA_FAILED``; rank 0
stops accepting, drains the other replicas and exits with the same code, so
torchrun stops and Kubernetes restarts the pod (docs/runtime.md).
"""

from __future__ import annotations

import argparse
import asyncio
import errno
import logging
import math
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote, urlsplit

from policy_operator import serve_flags
from policy_operator.builtin_policies import (
    LEROBOT,
    check_family,
    check_unconditional,
    checkpoint_type,
    launch_has_unconditional,
)
from policy_operator.exit_codes import ServeExit
from policy_operator.fetch_progress import FetchProgress
from policy_operator.layout import LayoutError, ParallelLayout
from policy_operator.readyz import RankState
from policy_operator.runtime.serving import heap
from policy_operator.runtime.serving.event_loop import event_loop_factory

if TYPE_CHECKING:  # torch: imported once the layout is known to be valid
    from policy_operator.runtime.compile_cache import CompileCache
    from policy_operator.runtime.engine.core import Engine
    from policy_operator.runtime.lifecycle import Lifecycle
    from policy_operator.runtime.parallel.dispatch import Lane, Replica
    from policy_operator.runtime.rank0_front import Front
    from policy_operator.runtime.serving.lerobot_grpc import LeRobotGrpcFront
    from policy_operator.runtime.serving.server import ServerConfig

log = logging.getLogger("policy_operator.runtime.worker")


def _setup_logging(level: str, rank: int) -> None:
    logging.basicConfig(
        level=level.upper(), stream=sys.stderr, format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s"
    )


def validate_layout(opts: serve_flags.ServeOptions) -> ParallelLayout:
    """Fail before any download or model load; the message is one line."""
    world = int(os.environ.get("WORLD_SIZE", opts.cfgp * opts.dp))
    layout = ParallelLayout(opts.cfgp, opts.dp, world_size=world)
    guidance = opts.guidance
    # a plug-in's traits, and a LeRobot checkpoint's still to fetch, are checked when it loads (Replica); a local
    # LeRobot checkpoint of another type than --lerobot-family is refused here
    has_unconditional = launch_has_unconditional(opts.policy, opts.checkpoint, opts.lerobot_family)
    if has_unconditional is not None:
        guidance = serve_flags.policy_guidance(opts.guidance, has_unconditional)
        check_unconditional(opts.policy, has_unconditional, cfgp=opts.cfgp, guidance=guidance)
    if guidance is not None:
        layout.check_guidance(guidance)
    if opts.steps is not None and opts.steps < 1:
        raise LayoutError(f"--steps must be >= 1, got {opts.steps}")
    return layout


def check_port(host: str, port: int, flag: str = "--port") -> None:
    """Bind ``host:port`` once as the server will (SO_REUSEADDR), so a taken port fails before any rank starts;
    ``flag``: the port's flag, named in the error."""
    if port == 0:
        return
    try:
        addresses = {
            info[4][:2]: info[0]
            for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
        }
    except socket.gaierror as exc:
        raise ValueError(f"--host {host}: cannot resolve ({exc.strerror})") from None
    for address, family in addresses.items():
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    raise ValueError(f"{flag} {port}: {host}:{port} is already in use") from None
                raise ValueError(f"--host {host} {flag} {port}: cannot bind ({exc.strerror})") from None


# An absolute path of two or more parts in an error text: a "/" that starts a word (not one inside a URL, a
# relative path or a "<checkpoint>/..." already replaced), up to a space, a quote or a bracket.  One part
# ("/readyz") is a name, not a place.
_ABSOLUTE_PATH = re.compile(r"(?<![\w:/.<>~-])/[^\s'\"()\[\]{},;/]+/[^\s'\"()\[\]{},;]+")


def public_reason(text: str, opts: serve_flags.ServeOptions) -> str:
    """``text`` for /readyz, which anyone may read: the checkpoint's and cache's paths replaced by names."""
    found = set()
    for name, value in (("<checkpoint>", opts.checkpoint), ("<cache-dir>", opts.cache_dir)):
        if value.startswith("file://"):  # the URL as given, and the path it names (errors print either)
            found.add((value, name))
            value = unquote(urlsplit(value).path)
        if value and "://" not in value and len(value) > 1:
            found |= {(str(Path(value)), name), (str(Path(value).absolute()), name), (str(Path(value).resolve()), name)}
    for path, name in sorted(found, key=lambda p: -len(p[0])):  # longest first: a path before its own prefix
        text = text.replace(path, name)
    # any other absolute path (one a checkpoint's config names, where a link led): the reason stays, not the place
    return _ABSOLUTE_PATH.sub("<path>", text)


def resolve_checkpoint(
    opts: serve_flags.ServeOptions, on_progress: Callable[[FetchProgress], None] | None = None
) -> str:
    """A local directory as is; a source is fetched once (file lock + completion marker), reporting to ``on_progress``."""
    from policy_operator.runtime.checkpoint.format import check_links_stay_inside

    if Path(opts.checkpoint).is_dir():
        check_links_stay_inside(opts.checkpoint)  # a policy's load() follows links: none may lead out
        return opts.checkpoint
    if "://" not in opts.checkpoint:
        raise FileNotFoundError(f"checkpoint directory {opts.checkpoint} does not exist")
    from policy_operator.runtime.checkpoint.fetch import fetch

    return str(fetch(opts.checkpoint, opts.cache_dir, revision=opts.revision, on_progress=on_progress))


class Runtime:
    """Everything one rank builds, shared by the rank-0 and other-rank paths."""

    def __init__(self, opts: serve_flags.ServeOptions, layout: ParallelLayout) -> None:
        import torch

        from policy_operator.runtime.parallel.groups import init_distributed, select_device
        from policy_operator.runtime.parallel.heartbeat import KV, Board, BoardWatcher, Heartbeat, MemoryKV, StoreKV

        self.opts = opts
        self.layout = layout
        device_name = opts.device if opts.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = select_device(device_name, share=opts.share_gpu)
        threads = serve_flags.intra_op_threads(opts.threads, self.device.type, os.environ)
        if threads is not None:
            # before this rank's first parallel op: every thread started later (the model thread, the prepare
            # thread) takes torch's global count on its own first parallel op, and so does this one
            torch.set_num_threads(threads)
        self.groups = init_distributed(layout, self.device, timedelta(seconds=opts.pg_timeout_s), opts.backend)
        self.rank = self.groups.rank
        self.kv_factory: Callable[[], KV]
        if layout.world_size > 1:
            self.kv_factory = StoreKV.from_env
        else:
            memory = MemoryKV()
            self.kv_factory = lambda: memory
        self.heartbeat = Heartbeat(self.kv_factory, self.rank, opts.heartbeat_s).start()
        self.board_factory = lambda: Board(self.kv_factory(), layout, opts.heartbeat_s)
        # What the ingress reads: under torchrun a copy refreshed by a thread (the store may block); in one
        # process the board itself (a dict in memory never blocks, and the copy would only lag).
        self.ingress_board: Callable[[], Board | BoardWatcher] = (
            (lambda: BoardWatcher(self.board_factory, layout, opts.heartbeat_s).start())
            if layout.world_size > 1
            else self.board_factory
        )
        cfg_mode = (
            opts.cfg_mode if opts.cfg_mode != "auto" else ("batched" if self.device.type == "cuda" else "sequential")
        )
        from policy_operator.runtime.policy.sampler import SamplerSettings, batch_buckets

        # A compiled denoiser gets one graph per shape: pad every batch to a bucket, all captured at warm-up.
        # Eager, a batch runs at its own size (padding would only add work).
        chosen = serve_flags.bucket_sizes(opts.batch_buckets, opts.max_batch)
        buckets = (chosen or batch_buckets(opts.max_batch)) if opts.compile else ()
        self.settings = SamplerSettings(
            opts.steps,
            opts.guidance,
            cfg_mode,  # type: ignore[arg-type]
            buckets,
            opts.rtc,  # type: ignore[arg-type]
            opts.rtc_max_delay,
        )
        self.load_s = self.warmup_s = 0.0  # set by load()
        self.compile_cache: CompileCache | None = None  # set by load() under --compile --compile-cache-dir
        self.bucket_ms: dict[int, float] = {}  # set by load() under --latency-budget-ms: replica 0's batch times

    def load(self, on_progress: Callable[[FetchProgress], None] | None = None) -> Replica:
        """Checkpoint path from rank 0, model on this rank, warm-up by the replica's driver.

        Sets ``load_s`` (model onto the device, download excluded) and ``warmup_s`` (the replica's warm-up
        request; 0 on a cfg peer, whose driver times it), which rank 0 exports as metrics.
        """
        import torch
        import torch.distributed as dist

        from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest, Replica
        from policy_operator.runtime.policy.interface import load_policy_class, parse_dtype
        from policy_operator.runtime.policy.rtc import warmup_constraint

        path = None
        if self.rank == 0:
            self.heartbeat.set_state(RankState.LOADING, "resolving checkpoint")
            path = resolve_checkpoint(self.opts, on_progress)
            if self.opts.policy == LEROBOT:  # a source serve fetched itself: its type is known only now
                check_family(self.opts.lerobot_family, checkpoint_type(path))
        if self.layout.world_size > 1:
            box = [path]
            dist.broadcast_object_list(box, src=0, group=self.groups.world_ctrl)
            path = box[0]
        assert path is not None, "rank 0 resolves the checkpoint or raises"
        self.heartbeat.set_state(RankState.LOADING, "loading the policy")  # /readyz is public: no path
        before_load_s = process_age_s()
        started = time.perf_counter()
        cls = load_policy_class(self.opts.policy)
        cls.import_dependencies()
        imports_s = time.perf_counter() - started
        # --trust-remote-code reaches a policy only when given: a plug-in's load() need not know the keyword
        opt_in = {"trust_remote_code": True} if self.opts.trust_remote_code else {}
        policy = cls.load(path, device=self.device, dtype=parse_dtype(self.opts.dtype), **opt_in)
        weights_s = time.perf_counter() - started - imports_s
        cache_s = 0.0
        if self.opts.compile:
            import torch._dynamo

            # one graph per bucket and CFG width (B or 2B rows): more shapes than dynamo's default limit of 8
            limit = 4 * len(self.settings.buckets) + 8
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
            # A policy compiled with dynamic=None traces one graph over a symbolic batch for the larger buckets.
            # Under --rtc guided it keeps a graph per bucket: its guided rows' step ran 5.1x / 3.7x the plain
            # step at batch 1 / 8 that way on the H200, against 3.1x / 2.9x with a graph per bucket (two calls,
            # not side by side: bench/results/rtc-h200-dynamic.md).
            torch._dynamo.config.automatic_dynamic_shapes = self.settings.rtc != "guided"
            cache_started = time.perf_counter()
            self.compile_cache = open_compile_cache(self, path)
            cache_s = time.perf_counter() - cache_started
            policy.compile(self.opts.compile)
        replica = Replica(policy, self.groups, self.settings, self.heartbeat)
        self.load_s = time.perf_counter() - started
        if self.groups.cfg_index == 0:
            started = time.perf_counter()
            # a session's request, as serving builds it: a policy with a history (Diffusion Policy's n_obs_steps)
            # takes its last observations stacked, a first request's padded with the one it has
            warm = policy.stack_history([policy.prepare(policy.example_observation(0))] * policy.history)
            rtc = warmup_constraint(policy, self.settings.rtc)  # constrained rows: a compiled guided backward too
            per_bucket: dict[int, float] = {}
            for size in self.settings.buckets or (1,):  # every shape serving will run: no compile after /readyz
                bucket_started = time.perf_counter()
                replica.execute(Batch(tuple(InferenceRequest(f"warmup-{size}-{i}", warm, i) for i in range(size))))
                if rtc is not None:
                    replica.execute(
                        Batch(tuple(InferenceRequest(f"warmup-rtc-{size}-{i}", warm, i, rtc) for i in range(size)))
                    )
                per_bucket[size] = round(time.perf_counter() - bucket_started, 1)
            if self.opts.latency_budget_ms is not None:
                self.bucket_ms = measure_buckets(
                    replica, warm, self.settings.buckets or batch_sizes(self.opts.max_batch)
                )
            self.warmup_s = time.perf_counter() - started
            saved_s = 0.0
            if self.rank == 0 and self.compile_cache is not None:
                saved_started = time.perf_counter()
                self.compile_cache.finish()  # every shape is compiled now
                saved_s = time.perf_counter() - saved_started
            # where a start's time goes (a second pod's target is seconds): process start to here, the load's
            # weights and compile-cache parts, each bucket's compile-or-load and CUDA-graph capture
            log.info(
                "replica %d warmed up %.1fs after its process started (%.1fs before the load; load %.1fs: imports "
                "%.1fs, weights %.1fs, compile cache %.1fs, setup %.1fs; warm-up %.1fs, seconds per batch bucket %s; "
                "artifacts saved in %.1fs)",
                self.groups.dp_index,
                process_age_s(),
                before_load_s,
                self.load_s,
                imports_s,
                weights_s,
                cache_s,
                self.load_s - imports_s - weights_s - cache_s,
                self.warmup_s,
                per_bucket,
                saved_s,
            )
        heap.keep_freed_blocks()  # loaded: from here on the heap keeps what one batch frees for the next
        return replica


def process_age_s() -> float:
    """Seconds since this process started (its interpreter start included), from /proc; nan elsewhere."""
    try:
        start_ticks = int(Path("/proc/self/stat").read_text().rpartition(")")[2].split()[19])
        uptime_s = float(Path("/proc/uptime").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return math.nan
    return uptime_s - start_ticks / os.sysconf("SC_CLK_TCK")


def open_compile_cache(rt: Runtime, checkpoint: str) -> CompileCache | None:
    """This spec's compile artifacts under --compile-cache-dir, loaded into torch's caches when there are good ones."""
    from policy_operator.runtime.compile_cache import open_cache

    return open_cache(
        rt.opts.compile_cache_dir,
        key_file=rt.opts.compile_key_file,
        checkpoint=checkpoint,
        policy=rt.opts.policy,
        dtype=rt.opts.dtype,
        mode=rt.opts.compile or "",
        buckets=rt.settings.buckets,
        layout=rt.layout.label,
        cfg_mode=rt.settings.cfg_mode,
        device=rt.device,
    )


def batch_sizes(max_batch: int) -> tuple[int, ...]:
    """The sizes warm-up times for an eager denoiser (no buckets): the buckets a compiled one would have."""
    from policy_operator.runtime.policy.sampler import batch_buckets

    return batch_buckets(max_batch)


MEASURE_REPS = 3  # timed runs per size after its warm-up run: the median is what the budget compares


def measure_buckets(replica: Replica, sample: Any, sizes: tuple[int, ...]) -> dict[int, float]:
    """Milliseconds one batch of each size takes on this replica, warm (median of ``MEASURE_REPS``)."""
    import statistics

    from policy_operator.runtime.parallel.dispatch import Batch, InferenceRequest

    times: dict[int, float] = {}
    for size in sizes:
        batch = Batch(tuple(InferenceRequest(f"measure-{size}-{i}", sample, i) for i in range(size)))
        replica.execute(batch)  # eager: the first run of a new size pays the allocator
        times[size] = statistics.median(replica.execute(batch)[1] for _ in range(MEASURE_REPS))
    return times


def budget_max_batch(bucket_ms: dict[int, float], budget_ms: float | None, max_batch: int) -> int:
    """The largest batch whose measured time fits ``budget_ms`` (at least 1: a lone request is always served)."""
    if budget_ms is None or not bucket_ms:
        return max_batch
    fitting = [size for size, ms in bucket_ms.items() if ms <= budget_ms and size <= max_batch]
    return max(fitting, default=1)


def build_ingress(
    rt: Runtime, on_replica_failed: Callable[[int, str], None], recent_sessions: Callable[[], int]
) -> Engine:
    """Rank 0's engine: router, lanes' home and readiness; ``recent_sessions``: the front-end's count (the batch
    window)."""
    from policy_operator.runtime.engine.core import Engine

    return Engine(
        rt.layout,
        rt.settings,
        rt.ingress_board(),
        request_timeout_s=rt.opts.pg_timeout_s,
        poll_s=min(0.25, rt.opts.heartbeat_s / 2),
        recent_sessions=recent_sessions,
        on_replica_failed=on_replica_failed,
    )


def server_config(opts: serve_flags.ServeOptions) -> ServerConfig:
    from policy_operator.runtime.serving.server import ServerConfig
    from policy_operator.serve_flags import read_token

    return ServerConfig(
        opts.host,
        opts.port,
        opts.max_message_bytes,
        opts.error_format,  # type: ignore[arg-type]
        read_token(opts.auth_token_file),
        opts.max_connections,
        opts.max_buffered_bytes,
        opts.frame_read_timeout_s,
        session_idle_timeout_s=opts.session_idle_timeout_s,
    )


def build_lanes(
    rt: Runtime,
    replica: Replica,
    model_pool: ThreadPoolExecutor,
    ingress: Engine,
    on_batch: Callable[[int, int], None],
    on_buckets: Callable[[dict[int, float]], None],
) -> list[Lane]:
    """One lane per replica, batching up to --max-batch or what --latency-budget-ms allows (replica 0's
    measured batch times stand for every replica: one pod, one GPU model)."""
    from policy_operator.runtime.parallel.dispatch import local_lane, remote_lane

    opts = rt.opts
    max_batch = budget_max_batch(rt.bucket_ms, opts.latency_budget_ms, opts.max_batch)
    if opts.latency_budget_ms is not None:
        log.info(
            "batch times %s ms; --latency-budget-ms %g: batches of at most %d",
            {k: round(v, 2) for k, v in rt.bucket_ms.items()},
            opts.latency_budget_ms,
            max_batch,
        )
        on_buckets({size: ms / 1e3 for size, ms in rt.bucket_ms.items()})
    batching: dict[str, Any] = {
        "max_batch": max_batch,
        "window_s": opts.batch_window_ms / 1e3,
        "expected": ingress.expected,
        "on_batch": on_batch,
    }
    lanes = [local_lane(replica, model_pool, **batching)]
    for k in range(1, rt.layout.dp):
        executor = ThreadPoolExecutor(1, thread_name_prefix=f"replica{k}")
        lanes.append(remote_lane(k, rt.layout.driver_rank(k), rt.groups.dispatch[k], executor, **batching))
    return lanes


# --- global rank 0 ------------------------------------------------------------------------
def load_failed(rt: Runtime, ingress: Engine, exc: Exception) -> None:
    """A model that did not load: this rank's heartbeat and /readyz say why (paths hidden), the log and stderr
    say it whole; the caller keeps serving /readyz for a heartbeat period, then the pod restarts."""
    error = f"{type(exc).__name__}: {exc}"
    rt.heartbeat.set_state(RankState.FAILED, public_reason(str(exc), rt.opts))
    ingress.load_failed(public_reason(error, rt.opts))
    log.error("loading the policy failed: %s", error)
    print(f"policyserver: error: {error}", file=sys.stderr, flush=True)


def make_front(rt: Runtime, lifecycle: Lifecycle) -> Front:
    """The in-process server, or the front-end process (started now: it imports torch and binds the port while
    rank 0 loads)."""
    from policy_operator.runtime import ipc
    from policy_operator.runtime.rank0_front import InlineFront, ProcessFront
    from policy_operator.runtime.serving.metrics import ServerMetrics

    opts = rt.opts
    if opts.frontend != "process":
        metrics = ServerMetrics(rt.layout, opts.max_connections)
        return InlineFront(server_config(opts), metrics, rt.layout.dp, opts.heartbeat_s)
    config = ipc.FrontendConfig(
        server_config(opts),
        rt.layout,
        opts.heartbeat_s,
        opts.pg_timeout_s,
        opts.event_loop,
        opts.gil_switch_ms,
        opts.log_level,
    )
    return ProcessFront.spawn(config, opts.frontend_processes, rt.heartbeat, lifecycle)


def make_lerobot_grpc(opts: serve_flags.ServeOptions) -> LeRobotGrpcFront | None:
    """LeRobot's AsyncInference service on ``--lerobot-grpc-port`` (started once the policy is loaded), or None."""
    if opts.lerobot_grpc_port is None:
        return None
    from policy_operator.runtime.serving.lerobot_grpc import LeRobotGrpcFront

    return LeRobotGrpcFront(opts.host, opts.lerobot_grpc_port, opts.max_message_bytes)


class Rank0:
    """Global rank 0 from the port's opening to its exit code, the same under either ``--frontend``: serve the
    port, load the model (or report why it did not load), attach the lanes, serve until SIGTERM or a failed
    replica, drain, stop every rank.  ``front`` is where readiness and metrics go and who drains the sessions.

    The drain: sessions drained up to ``--drain-grace-s`` (idle ones closed with 1001 at once, busy ones after
    their reply); at the deadline what still runs fails with ``drain_timeout``.  Drained, ``Shutdown`` goes down
    every lane and each loop ends; not drained, a lane is still inside its batch, which may outlast the pod, so
    no ``Shutdown`` waits behind it and ``STOP_KEY`` tells every rank to exit 0 now, before rank 0 itself leaves
    mid-collective.
    """

    def __init__(self, rt: Runtime, lifecycle: Lifecycle, front: Front) -> None:
        self.rt = rt
        self.lifecycle = lifecycle
        self.front = front
        self.code = ServeExit.OK
        self.stop = asyncio.Event()  # SIGTERM once loaded (Lifecycle.serving), or a failed replica
        self.lerobot_grpc = make_lerobot_grpc(rt.opts)
        grpc = self.lerobot_grpc
        # the batch window waits for the robots of both protocols
        recent = front.recent_sessions if grpc is None else (lambda: front.recent_sessions() + grpc.recent())
        self.ingress = build_ingress(rt, self._replica_failed, recent)

    def _replica_failed(self, index: int, reason: str) -> None:
        if self.lifecycle.stopping.is_set():  # a replica ended by the shutdown itself: no reason to restart the pod
            log.info("replica %d ended during the shutdown: %s", index, reason)
            return
        log.error("replica %d failed, the pod goes down: %s", index, reason)
        self.code = ServeExit.REPLICA_FAILED
        self.rt.heartbeat.set_state(RankState.FAILED, public_reason(f"replica {index}: {reason}", self.rt.opts))
        self.front.push_readiness()
        self.stop.set()

    async def serve(self) -> int:
        from policy_operator.runtime.lifecycle import stop_ranks

        rt, opts, front, ingress = self.rt, self.rt.opts, self.front, self.ingress
        loop = asyncio.get_running_loop()
        await front.open(ingress)
        model_pool = ThreadPoolExecutor(1, thread_name_prefix="model")
        load = loop.run_in_executor(model_pool, rt.load, front.observe_download)
        port = await front.listening()
        print(f"policyserver: listening on ws://{opts.host}:{port} ({rt.layout.label}{front.label})", flush=True)

        stopper = asyncio.ensure_future(self.stop.wait())
        first: set[asyncio.Future[Any]] = {load, stopper}
        await asyncio.wait(first, return_when=asyncio.FIRST_COMPLETED)
        if not load.done():  # stopped while loading: nothing to drain
            await front.close()
            log.info("stopped while loading")
            os._exit(ServeExit.OK)
        try:
            replica = load.result()
            replica.stopping = self.lifecycle.stopping.is_set
        except Exception as exc:  # noqa: BLE001 - a broken checkpoint must restart the pod, with a reason
            load_failed(rt, ingress, exc)
            front.push_readiness()
            await asyncio.sleep(opts.heartbeat_s)  # /readyz answers with the reason for a period, then the pod restarts
            await front.close()
            return ServeExit.LOAD
        lanes = build_lanes(rt, replica, model_pool, ingress, front.observe_batch, front.observe_buckets)
        if self.lerobot_grpc is not None:  # before attach: the metadata every session gets names its port
            from policy_operator.runtime.serving.lerobot_grpc import METADATA_KEY

            grpc_port = await self.lerobot_grpc.start(ingress, replica.policy)
            ingress.extra_metadata[METADATA_KEY] = grpc_port
            print(f"policyserver: LeRobot AsyncInference gRPC on {opts.host}:{grpc_port}", flush=True)
        ingress.attach(replica.policy, lanes, rt.bucket_ms)
        front.attached(replica.policy, rt.load_s, rt.warmup_s)
        print("policyserver: ready", flush=True)
        self.lifecycle.serving(lambda: loop.call_soon_threadsafe(self.stop.set))

        await stopper
        if self.code == ServeExit.OK:
            log.info("SIGTERM: draining up to %.1fs", opts.drain_grace_s)
            rt.heartbeat.set_state(RankState.STOPPING)
        else:
            log.error(
                "a replica failed: draining the others up to %.1fs, then exiting %d", opts.drain_grace_s, self.code
            )
        drained = await front.drain(opts.drain_grace_s)
        if self.lerobot_grpc is not None:  # its requests were refused (draining) or answered by now
            await self.lerobot_grpc.stop()
        await stop_ranks(ingress, drained=drained, kv=rt.kv_factory())
        rt.heartbeat.stop()
        log.info("rank 0 exiting %d (%s)", self.code, "drained" if drained else "grace period over")
        return self.code


async def serve_rank0(rt: Runtime, lifecycle: Lifecycle) -> int:
    return await Rank0(rt, lifecycle, make_front(rt, lifecycle)).serve()


# --- every other rank ------------------------------------------------------------------------
def _watchdog(rt: Runtime, lifecycle: Lifecycle) -> None:
    """Exit when rank 0 stopped the pod (0), or when rank 0 or the launcher is gone, instead of holding a GPU
    forever (``WATCHDOG``, or 0 during a shutdown: then their going is expected)."""
    from policy_operator.runtime.lifecycle import STOP_POLL_S, exit_now, stop_announced

    parent = os.getppid()
    board = rt.board_factory()
    kv = rt.kv_factory()
    limit = max(10 * rt.opts.heartbeat_s, 10.0)
    seen = None
    checked = 0.0
    while True:
        time.sleep(min(STOP_POLL_S, rt.opts.heartbeat_s))
        if stop_announced(kv):
            log.info("rank %d: rank 0 stopped the pod; exiting 0", rt.rank)
            exit_now(ServeExit.OK)
        if time.monotonic() - checked < rt.opts.heartbeat_s:
            continue
        checked = time.monotonic()
        if os.getppid() != parent:
            log.error("launcher exited; rank %d exiting", rt.rank)
            exit_now(lifecycle.exit_code(ServeExit.WATCHDOG, "the launcher exited"))
        status = board.read(0)
        if status.age_s is not None and status.age_s <= board.stale_after:
            seen = time.monotonic()
        elif seen is not None and time.monotonic() - seen > limit:
            log.error("rank 0 silent for %.0fs; rank %d exiting", limit, rt.rank)
            exit_now(lifecycle.exit_code(ServeExit.WATCHDOG, "rank 0 went silent"))


def _serve_other(rt: Runtime, lifecycle: Lifecycle) -> int:
    threading.Thread(target=_watchdog, args=(rt, lifecycle), name="watchdog", daemon=True).start()
    try:
        replica = rt.load()
    except Exception as exc:  # noqa: BLE001 - one line: rank 0 reports the same failure in /readyz
        log.error("rank %d: loading the policy failed: %s: %s", rt.rank, type(exc).__name__, exc)
        return lifecycle.exit_code(ServeExit.LOAD, "loading failed")
    replica.stopping = lifecycle.stopping.is_set
    # serve signals every rank; only rank 0's Shutdown (or STOP_KEY, read by the watchdog) ends this one
    lifecycle.serving(lambda: log.info("rank %d: waiting for rank 0's shutdown", rt.rank))
    try:
        if rt.groups.cfg_index == 0:
            replica.serve_driver()
        else:
            replica.serve_peer()
    except Exception as exc:  # noqa: BLE001 - a receive from rank 0 failed: rank 0 is gone
        if lifecycle.exit_code(ServeExit.WATCHDOG, "rank 0 left") == ServeExit.OK:
            return ServeExit.OK
        # rank 0 exited with its own code (noted first: serve exits with it); this rank's is that it gave up on it
        first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
        log.error("rank %d: rank 0 left (%s); exiting %d", rt.rank, first, ServeExit.WATCHDOG)
        return ServeExit.WATCHDOG
    if replica.broken is not None and lifecycle.exit_code(ServeExit.REPLICA_FAILED, replica.broken) == ServeExit.OK:
        return ServeExit.OK
    if replica.broken is not None:
        time.sleep(rt.opts.heartbeat_s)  # one more beat, so /readyz shows why before torchrun stops the pod
        log.error("rank %d exiting %d: the replica's collective failed", rt.rank, ServeExit.REPLICA_FAILED)
        return ServeExit.REPLICA_FAILED
    rt.heartbeat.stop()
    log.info("rank %d exiting 0", rt.rank)
    return ServeExit.OK


def preflight(opts: serve_flags.ServeOptions) -> ParallelLayout:
    """Every check that needs no torch (flag values, layout, guidance, steps, token file, the port); ValueError, one line.

    ``serve`` runs it before it starts torchrun, and every rank again; only rank 0 binds the port.
    """
    serve_flags.check_values(opts)
    event_loop_factory(opts.event_loop)  # --event-loop uvloop without uvloop: a usage error, before loading
    layout = validate_layout(opts)
    serve_flags.read_token(opts.auth_token_file)  # missing or empty: a usage error, not a traceback after loading
    if int(os.environ.get("RANK", "0")) == 0:
        check_port(opts.host, opts.port)
        if opts.lerobot_grpc_port:
            check_port(opts.host, opts.lerobot_grpc_port, serve_flags.LEROBOT_GRPC_PORT_FLAG)
    return layout


def run(opts: serve_flags.ServeOptions) -> int:
    try:
        layout = preflight(opts)
    except ValueError as exc:  # LayoutError is one
        print(f"policyserver: error: {exc}", file=sys.stderr)
        return ServeExit.LAYOUT
    rank = int(os.environ.get("RANK", "0"))
    from policy_operator.runtime.lifecycle import Lifecycle, exit_now

    lifecycle = Lifecycle(rank, opts.drain_grace_s, opts.heartbeat_s).install()  # before torch starts threads
    _setup_logging(opts.log_level, rank)
    sys.setswitchinterval(opts.gil_switch_ms / 1e3)
    rt = Runtime(opts, layout)
    if rt.rank == 0:
        with asyncio.Runner(loop_factory=event_loop_factory(opts.event_loop)) as runner:
            code = runner.run(serve_rank0(rt, lifecycle))
    else:
        code = _serve_other(rt, lifecycle)
    exit_now(code)  # skip interpreter teardown: process groups and pools hold no state worth flushing


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="policy_operator.runtime.worker", description=__doc__.splitlines()[0])
    serve_flags.add_arguments(parser)
    return run(serve_flags.ServeOptions.from_args(parser.parse_args(argv)))


if __name__ == "__main__":
    sys.exit(main())
