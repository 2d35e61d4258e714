"""Prometheus metrics of one server, in a registry of its own (several servers per test process).

Under ``--frontend process`` every front-end process keeps its series in
prometheus_client's multiprocess files (``multiprocess_dir``) and answers
``/metrics`` for all of them: counters and histograms add up across the
processes, a gauge says how (``multiprocess_mode``: each process's share
summed, the largest, or the value its most recent writer set).

The chart's Grafana dashboard (charts/policy-operator/dashboards/) and the
autoscaling rules of docs/autoscaling.md read these names; tests/test_dashboard.py
and tests/test_autoscaling.py fail when a query names one that is not here.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.multiprocess import MultiProcessCollector

from policy_operator.fetch_progress import FetchProgress
from policy_operator.layout import ParallelLayout
from policy_operator.runtime.result import Result

BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the serve flag --max-batch is at most 256
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
STAGE_BUCKETS = (0.0001, 0.00025, 0.0005, *LATENCY_BUCKETS[:-2])  # decode and prepare take tens of microseconds


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, layout: ParallelLayout, max_connections: int = 0, multiprocess_dir: str | None = None) -> None:
        """``multiprocess_dir``: this process's ``PROMETHEUS_MULTIPROC_DIR`` (set before prometheus_client was
        imported), whose files ``render`` reads; None: this registry alone."""
        self.registry = CollectorRegistry()
        self._multiprocess_dir = multiprocess_dir
        self._replicas: list[tuple[Counter, Histogram, Histogram]] = []  # per replica: its labelled series
        self._request_series()
        self._connection_series()
        self._replica_series()
        self._download_series()
        self.max_connections.set(max_connections)
        for reason in ("max_connections", "buffer_full", "frame_timeout", "idle_timeout"):
            self.connections_closed.labels(reason)
        self.world_size.set(layout.world_size)
        self.dp_replicas.set(layout.dp)
        # A multiprocess gauge that keeps its most recent writer's value has no sample until some process sets
        # it: 0 here, as a registry of its own reads before the first set, so the dashboard sees 0 in both modes
        for gauge in (self.ranks_ready, self.load_seconds, self.warmup_seconds, self.download_done, self.download_size):
            gauge.set(0)
        # every replica's series exists from the first scrape: rate() and the dashboard read 0, not "no data",
        # before a replica's first batch; kept, so a request does not look its labels up again
        self._replicas = [
            (self.requests.labels(k), self.infer.labels(k), self.batch_size.labels(k))
            for k in map(str, range(layout.dp))
        ]

    def _request_series(self) -> None:
        """Requests: their latency, queueing, batches, errors and the robots' network round trip."""
        self.latency = Histogram(
            "policy_request_latency_seconds",
            "Receive-to-reply time of a successful request",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.infer = Histogram(
            "policy_infer_seconds",
            "Time a replica spent computing one request",
            ["replica"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.queue = Histogram(
            "policy_queue_seconds",
            "Time a request waited for its replica (queue and batch window)",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "policy_batch_size",
            "Requests per batch a replica ran (one sampler call)",
            ["replica"],
            buckets=BATCH_SIZE_BUCKETS,
            registry=self.registry,
        )
        self.stages = Histogram(
            "policy_stage_seconds",
            "Where an answered request's time went, by stage: decode and prepare (its own), prefix, denoise and "
            "postprocess (its batch's compute, as the policy splits it), reply (writing its answer)",
            ["stage"],
            buckets=STAGE_BUCKETS,
            registry=self.registry,
        )
        self.errors = Counter("policy_request_errors", "Failed requests by kind", ["kind"], registry=self.registry)
        self.requests = Counter(
            "policy_requests", "Requests answered with actions", ["replica"], registry=self.registry
        )
        self.in_flight = Gauge(
            "policy_requests_in_flight",
            "Requests received and not yet answered",
            multiprocess_mode="livesum",
            registry=self.registry,
        )
        # what the client sees on top of policy_request_latency_seconds: the WebSocket keepalive's round trip
        # on the robots' own connections, sampled with every request
        self.network_rtt = Histogram(
            "policy_network_rtt_seconds",
            "Round trip of the WebSocket keepalive ping of the connection a request came on",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )

    def _connection_series(self) -> None:
        """WebSocket connections: how many, the bound on them, what closed them, the bytes of unfinished frames."""
        self.connections = Gauge(
            "policy_connections", "Open WebSocket connections", multiprocess_mode="livesum", registry=self.registry
        )
        self.max_connections = Gauge(
            "policy_max_connections",
            "WebSocket connections this server accepts at once (--max-connections)",
            multiprocess_mode="max",  # every front-end process bounds the pod's sessions: each sets the same limit
            registry=self.registry,
        )
        self.connections_full = Gauge(
            "policy_connections_full",
            "1 while every --max-connections slot is taken (a new robot gets HTTP 503), else 0",
            multiprocess_mode="max",
            registry=self.registry,
        )
        self.connections_closed = Counter(
            "policy_connections_closed",
            "Connections refused or closed by a bound: max_connections (HTTP 503 before the upgrade), buffer_full "
            "(1009: unfinished frames past --max-buffered-bytes), frame_timeout (1008: a frame unfinished past "
            "--frame-read-timeout-s), idle_timeout (1001: no frame for --session-idle-timeout-s)",
            ["reason"],
            registry=self.registry,
        )
        self.buffered_bytes = Gauge(
            "policy_buffered_bytes",
            "Bytes of unfinished WebSocket frames held across all connections",
            multiprocess_mode="livesum",
            registry=self.registry,
        )

    def _replica_series(self) -> None:
        """The pod's ranks and replicas: its layout, readiness, load and warm-up times, warm-up's batch times."""
        self.bucket_seconds = Gauge(
            "policy_batch_bucket_seconds",
            "Measured time of one batch of each padded size (bucket) at warm-up: what "
            "--latency-budget-ms compares against",
            ["replica", "bucket"],
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.ranks_ready = Gauge(
            "policy_ranks_ready", "Ranks alive and warm", multiprocess_mode="mostrecent", registry=self.registry
        )
        self.world_size = Gauge(
            "policy_world_size", "Ranks this pod runs (cfgp x dp)", multiprocess_mode="max", registry=self.registry
        )
        self.dp_replicas = Gauge(
            "policy_dp_replicas",
            "Data-parallel replicas in this pod (dp): requests it computes at once",
            multiprocess_mode="max",
            registry=self.registry,
        )
        self.load_seconds = Gauge(
            "policy_load_seconds",
            "Seconds rank 0 spent loading the policy onto its device (download excluded)",
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.warmup_seconds = Gauge(
            "policy_warmup_seconds",
            "Seconds the warm-up request of replica 0 took",
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )

    def _download_series(self) -> None:
        """The checkpoint a server downloads itself (serve --checkpoint URL)."""
        self.download_done = Gauge(
            "policy_checkpoint_downloaded_bytes",
            "Bytes of the checkpoint this server is downloading itself (serve --checkpoint URL)",
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )
        self.download_size = Gauge(
            "policy_checkpoint_size_bytes",
            "Size of the checkpoint this server is downloading itself; 0 when unknown",
            multiprocess_mode="mostrecent",
            registry=self.registry,
        )

    def observe_answer(self, answer: Result, written: tuple[float, float] | None, network_rtt: float) -> None:
        """A request answered with actions, on the event loop once per request: its replica's count, compute time
        and wait; once its reply was written (``written``: receive-to-reply-written seconds, the write's seconds;
        None when the connection closed first), its stages and round trip, and its connection's keepalive round
        trip (``network_rtt``, websockets' ``latency``: 0 until the first ping came back)."""
        requests, infer, _ = self._replicas[answer.replica]
        requests.inc()
        infer.observe(answer.infer_ms / 1e3)
        self.queue.observe(answer.queue_ms / 1e3)
        if written is None:
            return
        total_s, reply_s = written
        stages = {"decode": answer.decode_ms / 1e3, "prepare": answer.prepare_ms / 1e3, **dict(answer.stages)}
        stages["reply"] = reply_s
        for stage, value in stages.items():
            self.stages.labels(stage).observe(value)
        self.latency.observe(total_s)
        if network_rtt > 0:
            self.network_rtt.observe(network_rtt)

    def observe_batch(self, replica: int, size: int) -> None:
        self._replicas[replica][2].observe(size)

    def observe_buckets(self, replica: int, seconds: dict[int, float]) -> None:
        """Warm-up's measured time of each bucket of ``replica``."""
        for bucket, value in seconds.items():
            self.bucket_seconds.labels(str(replica), str(bucket)).set(value)

    def observe_download(self, progress: FetchProgress) -> None:
        """Called by the fetch's progress reporter, from its own thread, every few seconds while it downloads."""
        self.download_done.set(progress.done)
        self.download_size.set(progress.total or 0)

    def render(self) -> bytes:
        if self._multiprocess_dir is None:
            return generate_latest(self.registry)
        every_process = CollectorRegistry()
        MultiProcessCollector(every_process, path=self._multiprocess_dir)
        return generate_latest(every_process)
