"""Prometheus metrics of one server, in a registry of its own (several servers per test process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.latency = Histogram("policy_request_latency_seconds", "Receive-to-reply time of a successful request",
                                 buckets=LATENCY_BUCKETS, registry=self.registry)
        self.infer = Histogram("policy_infer_seconds", "Time a replica spent computing one request",
                               ["replica"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("policy_queue_seconds", "Time a request waited for its replica",
                               buckets=LATENCY_BUCKETS, registry=self.registry)
        self.errors = Counter("policy_request_errors", "Failed requests by kind", ["kind"], registry=self.registry)
        self.requests = Counter("policy_requests", "Requests answered with actions", ["replica"], registry=self.registry)
        self.in_flight = Gauge("policy_requests_in_flight", "Requests received and not yet answered",
                               registry=self.registry)
        self.connections = Gauge("policy_connections", "Open WebSocket connections", registry=self.registry)
        self.ranks_ready = Gauge("policy_ranks_ready", "Ranks alive and warm", registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
