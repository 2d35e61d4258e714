"""The flags of ``policyserver serve``, the torchrun line that runs them, and the ones the operator sets.

One definition for three readers: ``serve`` and the torchrun worker parse
these flags, ``serve`` forwards them to ``torchrun -m
policy_operator.runtime.worker``, and the operator writes the same launch line
into pod specs, setting the ``MANAGED`` flags from the PolicyServer's spec
(``runtime.extraArgs`` may add others, never these: the CRD generator and the
spec model read ``MANAGED_FLAGS``).  No torch import here: ``--help`` stays
instant and the operator image has no torch.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Final

from policy_operator.builtin_policies import BUILTIN_POLICIES, LEROBOT, LEROBOT_FAMILIES, REFERENCE
from policy_operator.constants import DEFAULT_GUIDANCE, DEFAULT_PORT, DEFAULT_STEPS, ENV_HOST
from policy_operator.constants import policy_guidance as policy_guidance  # the rule serve and the operator apply
from policy_operator.tokens import read_token_file

DEFAULT_DRAIN_GRACE_S: Final = 20.0
DEFAULT_CACHE_DIR: Final = ".cache/checkpoints"
DEFAULT_MAX_MESSAGE_BYTES: Final = 16 << 20
DEFAULT_MAX_BATCH: Final = 8
DEFAULT_BATCH_WINDOW_MS: Final = 2.0
MAX_BATCH_WINDOW_MS: Final = 1000.0  # a window is a latency budget; a second is already far beyond any control loop's
MAX_MAX_BATCH: Final = 256  # a batch is one forward pass: far beyond what any GPU runs at once for one policy
DEFAULT_MAX_CONNECTIONS: Final = 512
MAX_MAX_CONNECTIONS: Final = 65536
DEFAULT_MAX_BUFFERED_BYTES: Final = 256 << 20  # unfinished frames across all connections
DEFAULT_FRAME_READ_TIMEOUT_S: Final = 15.0
# A robot sends its next frame within a control period (20 ms to 2 s; a slow chunked policy's chunk, 10 s at most):
# a session silent three times the longest of them holds a --max-connections slot for nobody.
DEFAULT_SESSION_IDLE_TIMEOUT_S: Final = 30.0
MAX_SESSION_IDLE_TIMEOUT_S: Final = 86_400
MIN_LATENCY_BUDGET_MS: Final = 0.001
MAX_LATENCY_BUDGET_MS: Final = 60_000.0
DEFAULT_GIL_SWITCH_MS: Final = 5.0  # Python's own sys.getswitchinterval()
MAX_GIL_SWITCH_MS: Final = 100.0
FRONTENDS: Final = ("inline", "process")  # --frontend; runtime/serving/frontend.py is the second
DEFAULT_FRONTEND: Final = "inline"
# --frontend-processes: each is an interpreter with torch (~280 MB) and a busy core under load; at the default
# bounds every one still gets a ring slot (256 MiB of --max-buffered-bytes over 16 MiB messages)
MAX_FRONTEND_PROCESSES: Final = DEFAULT_MAX_BUFFERED_BYTES // DEFAULT_MAX_MESSAGE_BYTES
RTC_MODES: Final = ("off", "inpaint", "guided")  # --rtc; runtime/policy/rtc.py implements them
MAX_RTC_DELAY: Final = 1000  # control steps; far beyond any action horizon served
DEFAULT_POLICY: Final = REFERENCE
WORKER_MODULE: Final = "policy_operator.runtime.worker"  # the torchrun program, one process per rank
LEROBOT_GRPC_PORT_FLAG: Final = "--lerobot-grpc-port"  # runtime/serving/lerobot_grpc.py; spec.service.lerobotGrpcPort
SERVE_COMMAND: Final = ("policyserver", "serve")
TRUST_REMOTE_CODE_FLAG: Final = "--trust-remote-code"
LEROBOT_FAMILY_FLAG: Final = "--lerobot-family"  # spec.policy.family
COMPILE_KEY_FLAG: Final = "--compile-key-file"
#: The flags a LeRobot policy (``spec.policy.type: lerobot``) is served with on a GPU unless extraArgs set them
#: (issue 37, measured in docs/benchmarks.md): each family in LeRobot's own bfloat16 mode, and CUDA graphs per
#: batch bucket (1, 2, 4 ... maxBatch, default DEFAULT_MAX_BATCH) for the step loop and, for pi0 / pi0.5, the
#: VLM prefix.  extraArgs ``--dtype=float32`` (LeRobot's fp32 answers within 1e-5), ``--compile=default`` or
#: ``--compile=none`` (eager: no compile, no buckets) replace either.
LEROBOT_GPU_DEFAULTS: Final = (("--dtype", "bfloat16"), ("--compile", "reduce-overhead"))
COMPILE_FLAG: Final = "--compile"
#: ``--compile MODE``: torch.compile's own modes (its ``mode=``), the only ones serve passes to it.
COMPILE_MODES: Final = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: ``--compile=none``: eager, as without the flag; the one way extraArgs turn LEROBOT_GPU_DEFAULTS' compile off.
COMPILE_OFF: Final = "none"


@dataclass(frozen=True)
class ServeOptions:
    checkpoint: str
    revision: str | None
    cache_dir: str
    policy: str
    lerobot_family: str | None  # the LeRobot type the checkpoint must be (spec.policy.family); None: any served
    host: str
    port: int
    lerobot_grpc_port: int | None
    device: str
    dtype: str
    cfgp: int
    dp: int
    guidance: float | None  # None: the policy's own (policy_guidance)
    steps: int | None  # None: the policy's own (Policy.integrator)
    cfg_mode: str
    rtc: str
    rtc_max_delay: int | None
    max_batch: int
    batch_buckets: str | None  # None: 1, 2, 4 ... max_batch (bucket_sizes)
    batch_window_ms: float
    latency_budget_ms: float | None
    event_loop: str
    frontend: str
    frontend_processes: int
    gil_switch_ms: float
    max_message_bytes: int
    max_connections: int
    max_buffered_bytes: int
    frame_read_timeout_s: float
    session_idle_timeout_s: float
    error_format: str
    auth_token_file: str | None
    heartbeat_s: float
    drain_grace_s: float
    pg_timeout_s: float
    backend: str
    share_gpu: bool
    threads: int | None
    compile: str | None
    compile_cache_dir: str | None
    compile_key_file: str | None
    trust_remote_code: bool
    log_level: str

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> ServeOptions:
        return cls(**{name: getattr(args, name) for name in cls.__dataclass_fields__})


def add_arguments(p: argparse.ArgumentParser) -> None:
    """Every ``serve`` flag, by group (``--help`` shows them so); ``to_argv`` writes them back."""
    _model_flags(p.add_argument_group("model"))
    _layout_flags(p.add_argument_group("layout and sampling"))
    _batching_flags(p.add_argument_group("batching"))
    _server_flags(p.add_argument_group("server"))
    _lifecycle_flags(p.add_argument_group("health and lifecycle"))


def _model_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--checkpoint",
        required=True,
        help="checkpoint directory, or a source (hf://org/repo[@rev], http(s)://, s3://, file://) that "
        "global rank 0 downloads once into --cache-dir",
    )
    g.add_argument("--revision", default=None, help="revision of a hf:// source")
    g.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR, help="where a source is downloaded (default %(default)s)")
    g.add_argument(
        "--policy",
        default=DEFAULT_POLICY,
        help=f"a built-in policy ({', '.join(BUILTIN_POLICIES)}) or a Policy class as pkg.module:Class "
        "(default %(default)s)",
    )
    g.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="auto = cuda when available")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default %(default)s)")
    add_compile_flag(g)
    g.add_argument(
        "--compile-cache-dir",
        default=None,
        metavar="DIR",
        help="with --compile: load torch's compile artifacts for this spec from DIR before warm-up, and "
        "write them there after (a later server of the same spec skips compiling); off when unset",
    )
    g.add_argument(
        COMPILE_KEY_FLAG,
        default=None,
        metavar="PATH",
        help="a secret key (this PolicyServer's own): artifacts in --compile-cache-dir are written with an "
        "HMAC-SHA256 tag under it and loaded only when theirs verifies; without it they are used only in a "
        "directory private to this user (docs/runtime.md, compile cache)",
    )
    g.add_argument(
        LEROBOT_FAMILY_FLAG,
        choices=tuple(LEROBOT_FAMILIES),
        default=None,
        metavar="TYPE",
        help=f"with --policy {LEROBOT}: the type the checkpoint's config.json must name "
        f"({', '.join(LEROBOT_FAMILIES)}); another type is refused before loading. Unset: any served type",
    )
    add_trust_remote_code(g)
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch intra-op threads of every thread of a rank (model, event loop, prepare); default: "
        "OMP_NUM_THREADS when set, else 1 on a GPU (as torchrun sets for several ranks), else torch's own",
    )


def _compile_mode(value: str) -> str | None:
    """``--compile``'s word as ServeOptions holds it: ``none`` is None (eager), so every ``if opts.compile`` reads it
    as no flag; any other word is kept for ``check_compile`` to accept or refuse in one line."""
    return None if value == COMPILE_OFF else value


def add_compile_flag(g: argparse._ActionsContainer) -> None:
    """``--compile [MODE]``: ``serve``'s parser and the operator's check of extraArgs (``check_compile_args``)."""
    g.add_argument(
        COMPILE_FLAG,
        nargs="?",
        const="default",
        default=None,
        type=_compile_mode,
        metavar="MODE",
        help=f"torch.compile the denoiser; MODE {' | '.join(COMPILE_MODES)} (torch.compile's modes; "
        f"reduce-overhead: CUDA graphs) or {COMPILE_OFF} (eager, as without the flag: what turns off the "
        f"compile a LeRobot policy on a GPU gets from the operator); bare: default",
    )


def add_trust_remote_code(g: argparse._ActionsContainer) -> None:
    """``--trust-remote-code``: ``serve`` and ``checkpoint verify`` take the same opt-in."""
    g.add_argument(
        TRUST_REMOTE_CODE_FLAG,
        action="store_true",
        help="let a LeRobot checkpoint run its own Python code (a tokenizer or config with auto_map, "
        "trust_remote_code of its processor steps), as transformers' trust_remote_code; off: such a checkpoint "
        "is refused, naming the file or step (import paths in its processor steps are refused either way)",
    )


def _layout_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--cfgp", type=int, default=1, help="classifier-free-guidance parallel degree, 1 or 2")
    g.add_argument("--dp", type=int, default=1, help="data-parallel replicas in this pod (outermost rank axis)")
    g.add_argument(
        "--guidance",
        type=float,
        default=None,
        help=f"CFG scale g (default: {DEFAULT_GUIDANCE:g} for a policy with an unconditional branch, "
        "1.0 = no guidance for one without)",
    )
    g.add_argument(
        "--steps",
        type=int,
        default=None,
        help=f"denoising steps (default: the policy's own, e.g. a LeRobot config's; {DEFAULT_STEPS} for the "
        "reference policy)",
    )
    g.add_argument(
        "--cfg-mode",
        choices=["auto", "sequential", "batched"],
        default="auto",
        help="how cfgp=1 runs both branches; auto = batched on cuda, sequential on cpu",
    )
    g.add_argument(
        "--rtc",
        choices=RTC_MODES,
        default="off",
        help="real-time chunking of requests that carry an 'rtc' entry (docs/protocol.md): inpaint = "
        "frozen prefix + guidance without gradients (keeps CUDA graphs), guided = the published "
        "VJP guidance (a backward pass per step); off refuses them (default %(default)s)",
    )
    g.add_argument(
        "--rtc-max-delay",
        type=int,
        default=None,
        metavar="STEPS",
        help="largest rtc.inference_delay a request may ask for, in control steps (default: the action horizon - 1)",
    )


def _batching_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--max-batch",
        type=int,
        default=DEFAULT_MAX_BATCH,
        help="most requests of different sessions a replica runs as one batch; 1 = one request at a "
        "time (default %(default)s)",
    )
    g.add_argument(
        "--batch-buckets",
        default=None,
        metavar="SIZES",
        help="under --compile, the batch sizes captured as graphs at warm-up, ascending, comma-separated, the "
        "last one --max-batch; a batch runs padded to the next one (default: 1, 2, 4 ... --max-batch). Fewer "
        "buckets: a shorter warm-up, more padding",
    )
    g.add_argument(
        "--batch-window-ms",
        type=float,
        default=DEFAULT_BATCH_WINDOW_MS,
        help="how long a batch with room waits for the next request of a recently active session "
        "(counted from the latest request that joined it); a lone session never waits (default "
        "%(default)s)",
    )
    g.add_argument(
        "--latency-budget-ms",
        type=float,
        default=None,
        help="a robot's control period: warm-up measures every batch size (bucket) and no batch is formed "
        "whose measured time exceeds it (default: no budget, batches up to --max-batch)",
    )


def _server_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument(
        "--host",
        default=os.environ.get(ENV_HOST) or "0.0.0.0",
        help=f"bind address (default ${ENV_HOST} if set, else 0.0.0.0)",
    )
    g.add_argument("--port", type=int, default=DEFAULT_PORT)
    g.add_argument(
        LEROBOT_GRPC_PORT_FLAG,
        type=int,
        default=None,
        metavar="PORT",
        help="also serve LeRobot's AsyncInference gRPC service (lerobot.async_inference.robot_client, unchanged) "
        "on PORT (0: any free port), with --policy lerobot; off when unset (docs/protocol.md, gRPC)",
    )
    g.add_argument(
        "--max-message-bytes",
        type=int,
        default=DEFAULT_MAX_MESSAGE_BYTES,
        help="larger frames are refused with close code 1009 (default %(default)s)",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help="WebSocket connections accepted at once; more get HTTP 503 before the upgrade (default %(default)s)",
    )
    g.add_argument(
        "--max-buffered-bytes",
        type=int,
        default=DEFAULT_MAX_BUFFERED_BYTES,
        help="bytes of unfinished frames held across all connections; the connection whose frame "
        "would exceed it is closed with 1009 (default %(default)s)",
    )
    g.add_argument(
        "--frame-read-timeout-s",
        type=float,
        default=DEFAULT_FRAME_READ_TIMEOUT_S,
        help="a frame still unfinished this long after its first byte closes its connection with "
        "1008 (default %(default)s)",
    )
    g.add_argument(
        "--session-idle-timeout-s",
        type=float,
        default=DEFAULT_SESSION_IDLE_TIMEOUT_S,
        help="a session that sends no frame this long after its last reply (or its connect) is closed with 1001, "
        "so idle sockets cannot hold --max-connections; 0 = never (default %(default)s)",
    )
    g.add_argument(
        "--error-format",
        choices=["text", "dict"],
        default="text",
        help="text = openpi's text frame + close 1011; dict = {'type': 'error'} reply, connection kept",
    )
    g.add_argument("--auth-token-file", default=None, help="require 'Authorization: Bearer|Api-Key <token>'")
    g.add_argument(
        "--event-loop",
        choices=["auto", "asyncio", "uvloop"],
        default="auto",
        help="rank 0's event loop; auto = uvloop when installed (default %(default)s)",
    )
    g.add_argument(
        "--frontend",
        choices=FRONTENDS,
        default=DEFAULT_FRONTEND,
        help="where WebSocket I/O, msgpack decoding and prepare run: inline = in the model process (rank 0), "
        "process = in a child process that hands prepared tensors to the model process through shared "
        "memory (default %(default)s)",
    )
    g.add_argument(
        "--frontend-processes",
        type=int,
        default=1,
        help="with --frontend process: how many front-end processes share the port (SO_REUSEPORT; the kernel "
        "spreads connections over them), each with its share of --max-buffered-bytes; --max-connections bounds "
        "their sessions together (default %(default)s)",
    )
    g.add_argument(
        "--gil-switch-ms",
        type=float,
        default=DEFAULT_GIL_SWITCH_MS,
        help="how long a thread may hold the GIL while another waits (sys.setswitchinterval): rank 0's "
        "event loop and its model thread share one interpreter (default %(default)s)",
    )


def _lifecycle_flags(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--heartbeat-s", type=float, default=1.0, help="rank heartbeat period (default %(default)s)")
    g.add_argument(
        "--drain-grace-s",
        type=float,
        default=DEFAULT_DRAIN_GRACE_S,
        help="on SIGTERM, how long in-flight requests may finish (default %(default)s)",
    )
    g.add_argument(
        "--pg-timeout-s",
        type=float,
        default=1800.0,
        help="timeout of the per-request collectives; idle waits never use it (default %(default)s)",
    )
    g.add_argument(
        "--backend",
        choices=["auto", "nccl", "gloo"],
        default="auto",
        help="per-step collective backend; auto = nccl on cuda, gloo on cpu",
    )
    g.add_argument(
        "--share-gpu",
        action="store_true",
        help="let ranks outnumber visible GPUs (rank i on GPU i mod count): functional checks only",
    )
    g.add_argument("--log-level", default="INFO")


def check_values(opts: ServeOptions) -> None:
    """Refuse flag values no server can run with, before anything starts: ValueError, one line naming the flag.

    A zero heartbeat period would spin every rank's heartbeat thread and never
    let ``/readyz`` turn ready; a port out of range would fail only after every
    rank loaded the model.
    """
    _check_times(opts)
    _check_connections(opts)
    _check_batching(opts)
    _check_lerobot_grpc_port(opts)
    _check_lerobot_family(opts)
    check_compile(opts.compile)
    if opts.threads is not None and opts.threads < 1:
        raise ValueError(f"--threads must be at least 1, got {opts.threads}")
    if opts.rtc_max_delay is not None and not 0 <= opts.rtc_max_delay <= MAX_RTC_DELAY:
        raise ValueError(f"--rtc-max-delay must be in 0..{MAX_RTC_DELAY} control steps, got {opts.rtc_max_delay}")
    if opts.trust_remote_code and opts.policy == REFERENCE:
        raise ValueError(
            f"{TRUST_REMOTE_CODE_FLAG} lets a LeRobot checkpoint (or a plug-in's) run its own code; "
            f"--policy {REFERENCE} loads none"
        )


def _check_times(opts: ServeOptions) -> None:
    """Periods, deadlines and grace times: finite, and positive where zero would spin or never fire."""
    for name in ("heartbeat_s", "pg_timeout_s"):
        value = getattr(opts, name)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{flag_of(name)} must be a positive number of seconds, got {value}")
    if not (math.isfinite(opts.drain_grace_s) and opts.drain_grace_s >= 0):
        raise ValueError(f"--drain-grace-s must be 0 or more seconds, got {opts.drain_grace_s}")
    if not (0 <= opts.session_idle_timeout_s <= MAX_SESSION_IDLE_TIMEOUT_S):  # NaN fails too
        raise ValueError(
            f"--session-idle-timeout-s must be in 0..{MAX_SESSION_IDLE_TIMEOUT_S} seconds (0: never), "
            f"got {opts.session_idle_timeout_s}"
        )
    if not (math.isfinite(opts.frame_read_timeout_s) and opts.frame_read_timeout_s > 0):
        raise ValueError(
            f"--frame-read-timeout-s must be a positive number of seconds, got {opts.frame_read_timeout_s}"
        )


def _check_connections(opts: ServeOptions) -> None:
    """The port, what one message and all connections may hold, and the front-end processes sharing it."""
    if not 0 <= opts.port <= 65535:
        raise ValueError(f"--port must be in 0..65535 (0: any free port), got {opts.port}")
    if opts.max_message_bytes < 1:
        raise ValueError(f"--max-message-bytes must be at least 1, got {opts.max_message_bytes}")
    if not 1 <= opts.max_connections <= MAX_MAX_CONNECTIONS:
        raise ValueError(f"--max-connections must be in 1..{MAX_MAX_CONNECTIONS}, got {opts.max_connections}")
    if not 1 <= opts.frontend_processes <= MAX_FRONTEND_PROCESSES:
        raise ValueError(f"--frontend-processes must be in 1..{MAX_FRONTEND_PROCESSES}, got {opts.frontend_processes}")
    if opts.frontend_processes > 1 and opts.frontend != "process":
        raise ValueError(f"--frontend-processes {opts.frontend_processes} needs --frontend process")
    if opts.max_buffered_bytes < opts.max_message_bytes:
        raise ValueError(
            f"--max-buffered-bytes must be at least --max-message-bytes ({opts.max_message_bytes}), "
            f"got {opts.max_buffered_bytes}"
        )
    if opts.max_buffered_bytes < opts.max_message_bytes * opts.frontend_processes:
        raise ValueError(
            f"--max-buffered-bytes must be at least --max-message-bytes ({opts.max_message_bytes}) times "
            f"--frontend-processes ({opts.frontend_processes}), got {opts.max_buffered_bytes}"
        )


def bucket_sizes(sizes: str | None, max_batch: int) -> tuple[int, ...] | None:
    """``--batch-buckets``' sizes (None: not given), refused unless ascending, positive and ending at
    ``max_batch`` (a batch larger than the last bucket could not be padded to one)."""
    if sizes is None:
        return None
    try:
        buckets = tuple(int(size) for size in sizes.split(","))
    except ValueError:
        raise ValueError(f"--batch-buckets must be comma-separated batch sizes, got {sizes!r}") from None
    if buckets[0] < 1 or any(a >= b for a, b in zip(buckets, buckets[1:], strict=False)):
        raise ValueError(f"--batch-buckets must be ascending sizes of at least 1, got {sizes!r}")
    if buckets[-1] != max_batch:
        raise ValueError(f"--batch-buckets must end at --max-batch ({max_batch}), got {sizes!r}")
    return buckets


def _check_batching(opts: ServeOptions) -> None:
    """The batch size, window and budget a replica batches requests with, and the GIL switch it runs under."""
    if opts.latency_budget_ms is not None and not (
        math.isfinite(opts.latency_budget_ms)
        and MIN_LATENCY_BUDGET_MS <= opts.latency_budget_ms <= MAX_LATENCY_BUDGET_MS
    ):
        raise ValueError(
            f"--latency-budget-ms must be in {MIN_LATENCY_BUDGET_MS:g}..{MAX_LATENCY_BUDGET_MS:g} milliseconds, "
            f"got {opts.latency_budget_ms}"
        )
    if not 1 <= opts.max_batch <= MAX_MAX_BATCH:
        raise ValueError(f"--max-batch must be in 1..{MAX_MAX_BATCH}, got {opts.max_batch}")
    bucket_sizes(opts.batch_buckets, opts.max_batch)
    if not (math.isfinite(opts.batch_window_ms) and 0 <= opts.batch_window_ms <= MAX_BATCH_WINDOW_MS):
        raise ValueError(
            f"--batch-window-ms must be in 0..{MAX_BATCH_WINDOW_MS:g} milliseconds, got {opts.batch_window_ms}"
        )
    if not (math.isfinite(opts.gil_switch_ms) and 0 < opts.gil_switch_ms <= MAX_GIL_SWITCH_MS):
        raise ValueError(
            f"--gil-switch-ms must be in (0, {MAX_GIL_SWITCH_MS:g}] milliseconds, got {opts.gil_switch_ms}"
        )


def check_compile(mode: str | None) -> None:
    """``--compile``'s mode is one torch.compile takes (None: eager); another would fail only deep in warm-up, after
    every rank loaded the model (a crash loop for a pod)."""
    if mode is not None and mode not in COMPILE_MODES:
        raise ValueError(
            f"{COMPILE_FLAG} must be one of {', '.join(COMPILE_MODES)} or {COMPILE_OFF} (eager), got {mode!r}"
        )


def check_compile_args(args: Sequence[str]) -> None:
    """``check_compile`` on the mode ``args`` (a PolicyServer's extraArgs) set, read as serve's parser reads them.

    The CRD's rule sees one word at a time (``--compile=MODE``); ``--compile MODE``
    as two words is checked here, by the operator, before any pod runs it.
    """
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    add_compile_flag(parser)
    check_compile(parser.parse_known_args(list(args))[0].compile)


def _check_lerobot_family(opts: ServeOptions) -> None:
    """``--lerobot-family`` names a LeRobot checkpoint's type: another policy has none."""
    if opts.lerobot_family is not None and opts.policy != LEROBOT:
        raise ValueError(
            f"{LEROBOT_FAMILY_FLAG} names a LeRobot checkpoint's type: it needs --policy {LEROBOT}, "
            f"got --policy {opts.policy}"
        )


def _check_lerobot_grpc_port(opts: ServeOptions) -> None:
    """LeRobot's gRPC service needs a port of its own and a LeRobot policy (its client describes one)."""
    grpc_port = opts.lerobot_grpc_port
    if grpc_port is None:
        return
    if not 0 <= grpc_port <= 65535:
        raise ValueError(f"{LEROBOT_GRPC_PORT_FLAG} must be in 0..65535 (0: any free port), got {grpc_port}")
    if grpc_port and grpc_port == opts.port:
        raise ValueError(f"{LEROBOT_GRPC_PORT_FLAG} must differ from --port ({opts.port}): each is its own listener")
    if opts.policy != LEROBOT:
        raise ValueError(
            f"{LEROBOT_GRPC_PORT_FLAG} serves LeRobot's robot_client, which describes a LeRobot policy: it needs "
            f"--policy {LEROBOT}, got --policy {opts.policy}"
        )


def intra_op_threads(threads: int | None, device_type: str, environ: Mapping[str, str]) -> int | None:
    """The intra-op thread count a rank sets before its first parallel op (None: leave torch's default).

    On a GPU the host's share of a request is small copies and Python; a team of
    host-cores OpenMP threads per thread that touches torch (the model thread,
    the event loop's prepare) only spins against the event loop and the other
    ranks.  On an H200 host at max-batch 8 with 16 robots, the replica's batch
    took 31-35 ms with torch's default against 22-24 ms with one thread
    (bench/results/h200-robots-threads.md).  torchrun already sets
    OMP_NUM_THREADS=1 for several ranks; this makes one rank the same.  A
    user's OMP_NUM_THREADS (or ``--threads``) still decides.
    """
    if threads is not None:
        return threads
    if environ.get("OMP_NUM_THREADS"):
        return None  # torch reads it itself
    return 1 if device_type == "cuda" else None


def read_token(path: str | None) -> str | None:
    """The --auth-token-file token; here, torch-free, so ``serve`` checks it before exec'ing torchrun."""
    return read_token_file(path, "--auth-token-file") if path else None


def flag_of(field: str) -> str:
    """``drain_grace_s`` -> ``--drain-grace-s``: how every ServeOptions field is spelled on a command line."""
    return "--" + field.replace("_", "-")


def argv_of(values: Mapping[str, object]) -> list[str]:
    """Flags for ``{field: value}``: a true bool is a bare flag, False and None are left out."""
    argv: list[str] = []
    for name, value in values.items():
        if isinstance(value, bool):
            argv += [flag_of(name)] if value else []
        elif value is not None:
            argv += [flag_of(name), str(value)]
    return argv


def to_argv(opts: ServeOptions) -> list[str]:
    """The flags that reproduce ``opts``: what ``serve`` hands to the torchrun worker."""
    return argv_of({f.name: getattr(opts, f.name) for f in fields(ServeOptions)})


def serve_argv(worker_args: list[str]) -> list[str]:
    """A server pod's entrypoint: ``serve`` runs the torchrun line as its child, so a drained SIGTERM exits 0.

    torchrun itself, signalled by the kubelet, exits 1 however cleanly its
    ranks drained; ``serve`` passes the signal to the ranks instead
    (``runtime/serve_cli.py``).  A single-rank layout runs in ``serve`` itself.
    """
    return [*SERVE_COMMAND, *worker_args]


def torchrun_argv(nproc: int, worker_args: list[str]) -> list[str]:
    """The launch command of a pod or a multi-rank ``serve``: one worker process per rank, no restarts."""
    return [
        "torchrun",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--max-restarts=0",
        "-m",
        WORKER_MODULE,
        *worker_args,
    ]


# --- what the operator sets -------------------------------------------------------------
# ServeOptions fields the operator writes from a PolicyServer's spec, in this order, before extraArgs.
MANAGED: Final = (
    "checkpoint",
    "policy",
    "lerobot_family",
    "port",
    "lerobot_grpc_port",
    "cfgp",
    "dp",
    "guidance",
    "steps",
    "max_batch",
    "batch_window_ms",
    "latency_budget_ms",
    "max_connections",
    "session_idle_timeout_s",
    "frontend",
    "frontend_processes",
    "device",
    "auth_token_file",
    "drain_grace_s",
    "rtc",
    "rtc_max_delay",
    "trust_remote_code",
)
MANAGED_FLAGS: Final = tuple(flag_of(name) for name in MANAGED)


def managed_argv(
    *,
    checkpoint: str,
    policy: str,
    port: int,
    cfgp: int,
    dp: int,
    guidance: float | None,
    steps: int | None,
    max_batch: int,
    batch_window_ms: float,
    device: str,
    auth_token_file: str | None,
    drain_grace_s: float,
    latency_budget_ms: float | None = None,
    max_connections: int = DEFAULT_MAX_CONNECTIONS,
    session_idle_timeout_s: float | None = None,
    frontend: str | None = None,
    frontend_processes: int | None = None,
    rtc: str | None = None,
    rtc_max_delay: int | None = None,
    lerobot_grpc_port: int | None = None,
    trust_remote_code: bool = False,
    lerobot_family: str | None = None,
) -> list[str]:
    """The worker flags the operator derives from the spec (``auth_token_file`` None: no auth; ``guidance`` or
    ``steps`` None: the policy's own; any other None: the flag's default, left off the command line)."""
    given = locals()
    return argv_of({name: given[name] for name in MANAGED})


def lerobot_gpu_defaults(policy: str, device: str, extra_args: Sequence[str]) -> list[str]:
    """``LEROBOT_GPU_DEFAULTS``' flags a LeRobot policy on CUDA gets, less those ``extra_args`` set itself (as
    ``--flag value`` or ``--flag=value``); nothing for another policy or device."""
    if policy != LEROBOT or device != "cuda":
        return []
    given = {arg.split("=", 1)[0] for arg in extra_args if arg.startswith("--")}
    return [word for flag, value in LEROBOT_GPU_DEFAULTS if flag not in given for word in (flag, value)]
