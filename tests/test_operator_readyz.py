"""The operator's /readyz poller against a real ``policyserver serve`` (the contract, both sides real)."""

from __future__ import annotations

from pathlib import Path

import pytest
from kubernetes.client import V1Pod

from policy_operator.operator import rank_probe
from tests.support.api_objects import api_object
from tests.support.servers import serve_policy

pytestmark = pytest.mark.slow


def test_poller_reads_every_rank_of_a_real_cfgp2_server(tiny_checkpoint: Path) -> None:
    with serve_policy(
        tiny_checkpoint, "--cfgp", "2", "--dp", "1", "--guidance", "3.0", "--steps", "2", "--device", "cpu"
    ) as server:
        pod = {
            "metadata": {"name": "ps-0"},
            "status": {"phase": "Running", "podIP": server.host},
            "spec": {"containers": [{"ports": [{"name": "ws", "containerPort": server.port}]}]},
        }
        result = rank_probe.pod_health(api_object(V1Pod, pod), 1, world_size=2, timeout=5)
        assert (result.ready, result.ranks_ready, result.world_size, result.message) == (True, 2, 2, "")
        assert [(r.rank, r.dp_index, r.cfg_index, r.ready) for r in result.ranks] == [(0, 0, 0, True), (1, 0, 1, True)]
        assert result.as_status()["ranksReady"] == "2/2"


def test_poller_reads_the_batch_times_of_a_real_server_under_a_latency_budget(tiny_checkpoint: Path) -> None:
    """What status.batching is built from: the bucket times and max batch of the pod's own /readyz."""
    with serve_policy(
        tiny_checkpoint, "--steps", "2", "--device", "cpu", "--max-batch", "4", "--latency-budget-ms", "60000"
    ) as server:
        pod = {
            "metadata": {"name": "ps-0", "creationTimestamp": "2026-01-01T00:00:00Z"},
            "status": {"phase": "Running", "podIP": server.host},
            "spec": {"containers": [{"ports": [{"name": "ws", "containerPort": server.port}]}]},
        }
        result = rank_probe.pod_health(api_object(V1Pod, pod), 1, world_size=1, timeout=5)
        assert result.ready and result.batching is not None, result
        assert result.batching.max_batch == 4  # a minute fits every bucket
        assert [size for size, _ in result.batching.buckets_ms] == [1, 2, 4]
        assert all(ms > 0 for _, ms in result.batching.buckets_ms)
        assert result.created == "2026-01-01T00:00:00Z"
