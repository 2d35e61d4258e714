"""Per-rank readiness of each server pod, read from the pod's own ``/readyz``.

The kubelet's readiness probe gives one bit per pod; a pod of cfgp x dp ranks
can be half-alive (one dp replica wedged, a CFG rank still loading).  The
runtime's ``/readyz`` body lists every rank, so the operator polls it and
reports ``ranksReady`` per pod and in total.

A pod the operator cannot reach (a NetworkPolicy, a service mesh in STRICT
mTLS, an operator outside the pod network) is not a pod that is down: its
readiness falls back to the kubelet's view -- the pod's ``Ready`` condition,
which the kubelet sets from the same ``/readyz`` (200 only when every rank is
ready).  A pod the kubelet calls Ready then counts every rank ready and is
flagged ``ranksKnown: false`` (``RanksUnknown`` in status), never reported as
zero ranks.  One it does not call Ready is starting (every new pod refuses
connections until rank 0 listens): no rank ready, and nothing unknown about it.

A pod that accepts the connection and then says nothing is neither: it is
reachable, and hung (SIGSTOPped, a wedged event loop).  It is reported as not
answering, not ready, whatever the kubelet last said.  A pod whose container
the kubelet keeps restarting is reported by what killed it (``crash_loop``).
"""

from __future__ import annotations

import dataclasses
import http.client
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import V1PersistentVolumeClaim, V1Pod

from policy_operator.constants import LABEL_CONTROLLER_REVISION_HASH, PORT_NAME, READYZ_PATH
from policy_operator.operator.kube_objects import meta_of, rfc3339
from policy_operator.operator.pod_problems import (
    claims_binding,
    container_message,
    crash_loop,
    termination,
    unschedulable_message,
)
from policy_operator.readyz import Readiness

PROBE_TIMEOUT_S = 2.0
MAX_BODY = 1 << 20
MAX_PARALLEL_PROBES = 16


@dataclass(frozen=True)
class RankHealth:
    rank: int
    dp_index: int
    cfg_index: int
    state: str
    ready: bool

    def as_status(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "dpIndex": self.dp_index,
            "cfgIndex": self.cfg_index,
            "state": self.state,
            "ready": self.ready,
        }


@dataclass(frozen=True)
class Batching:
    """What a pod's lanes batch under ``--latency-budget-ms``: warm-up's time of each bucket and the largest
    batch that fits the budget."""

    max_batch: int
    buckets_ms: tuple[tuple[int, float], ...]  # (bucket size, ms), ascending

    @classmethod
    def of(cls, doc: Readiness) -> Batching | None:
        """From a /readyz document; None without a budget (no times measured) or from an older runtime."""
        if doc.max_batch is None or not doc.batch_buckets_ms:
            return None
        return cls(doc.max_batch, tuple(sorted(doc.batch_buckets_ms.items())))

    def as_status(self) -> dict[str, Any]:
        return {"maxBatch": self.max_batch, "bucketsMs": {str(size): ms for size, ms in self.buckets_ms}}


@dataclass(frozen=True)
class ReadyzFacts:
    """One /readyz answer, read."""

    ready: bool
    ranks_ready: int
    world_size: int
    ranks: tuple[RankHealth, ...]
    message: str
    batching: Batching | None = None


@dataclass(frozen=True)
class PodHealth:
    name: str
    pod_ip: str | None
    phase: str
    world_size: int
    ranks_ready: int = 0
    ready: bool = False
    ranks: tuple[RankHealth, ...] = field(default_factory=tuple)
    message: str = ""
    # False: /readyz unreachable, ``ready`` is the kubelet's Ready condition; ranks_ready is then all of them
    # (the kubelet's probe got a 200, which needs every rank) or none (both views agree the pod is not serving)
    ranks_known: bool = True
    revision: str | None = None  # the pod's controller-revision-hash: which StatefulSet template it runs
    unschedulable: str = ""  # the scheduler's PodScheduled=False Unschedulable message
    termination: str = ""  # last lines of the newest failed container's termination message
    crash_loop: str = ""  # what killed a container the kubelet keeps restarting (``pod_problems.crash_loop``)
    created: str = ""  # metadata.creationTimestamp (RFC 3339: orders as text)
    batching: Batching | None = None  # from /readyz, under --latency-budget-ms

    @property
    def ranks_text(self) -> str:
        return f"{self.ranks_ready}/{self.world_size}"

    def as_status(self) -> dict[str, Any]:
        item: dict[str, Any] = {
            "name": self.name,
            "phase": self.phase,
            "ready": self.ready,
            "ranksReady": self.ranks_text,
            "ranks": [r.as_status() for r in self.ranks],
        }
        if not self.ranks_known:
            item["ranksKnown"] = False
        if self.revision:
            item["revision"] = self.revision
        if self.pod_ip:
            item["podIP"] = self.pod_ip
        if self.message:
            item["message"] = self.message
        return item


def read_readyz(status_code: int, body: bytes, expected_world_size: int) -> ReadyzFacts:
    """One /readyz answer, read; a malformed body is not ready."""
    try:
        doc = Readiness.parse(body)
    except ValueError as exc:
        return ReadyzFacts(
            False, 0, expected_world_size, (), f"/readyz answered {status_code} with a malformed body ({exc})"
        )
    world_size, ranks_ready = doc.world_size, doc.ranks_ready
    ranks = tuple(
        RankHealth(rank=r.rank, dp_index=r.dp_index, cfg_index=r.cfg_index, state=r.state.value, ready=r.ready)
        for r in doc.ranks
    )
    ready = doc.ready and status_code == 200 and ranks_ready >= world_size
    message = "" if ready else _not_ready_message(ranks, ranks_ready, world_size)
    return ReadyzFacts(ready, max(0, min(ranks_ready, world_size)), world_size, ranks, message, Batching.of(doc))


def parse_readyz(
    status_code: int, body: bytes, expected_world_size: int
) -> tuple[bool, int, int, tuple[RankHealth, ...], str]:
    """(ready, ranks_ready, world_size, ranks, message) from one /readyz answer; a malformed body is not ready."""
    facts = read_readyz(status_code, body, expected_world_size)
    return facts.ready, facts.ranks_ready, facts.world_size, facts.ranks, facts.message


def _not_ready_message(ranks: Sequence[RankHealth], ranks_ready: int, world_size: int) -> str:
    waiting = [f"rank {r.rank} {r.state}" for r in ranks if not r.ready]
    return f"{ranks_ready}/{world_size} ranks ready" + (f" ({', '.join(waiting[:8])})" if waiting else "")


class Unreachable(OSError):
    """No HTTP answer from the pod at all (refused, reset, timed out): says nothing about its ranks."""


class NotAnswering(Unreachable):
    """The pod accepted the connection and sent no answer in time: it is reachable and hung (a SIGSTOPped or
    wedged process, whose listening socket the kernel still completes handshakes for), not starting and not
    cut off by the network (which refuses or drops the connection itself)."""


def fetch_readyz(ip: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
    """(status code, body) of one GET /readyz (a 503 still carries the per-rank body); ``NotAnswering`` when the
    connection was made and no answer came in ``timeout``, ``Unreachable`` when there was no connection."""
    conn = http.client.HTTPConnection(ip, port, timeout=timeout)
    try:
        try:
            conn.connect()
        except OSError as exc:
            raise Unreachable(f"{READYZ_PATH} unreachable: {exc}") from exc
        try:
            conn.request("GET", READYZ_PATH, headers={"Connection": "close"})
            response = conn.getresponse()
            return response.status, response.read(MAX_BODY)
        except TimeoutError as exc:
            raise NotAnswering(f"not answering {READYZ_PATH}: connected, no answer in {timeout:g}s") from exc
        except (OSError, http.client.HTTPException) as exc:
            raise Unreachable(f"{READYZ_PATH} unreachable: {exc}") from exc
    finally:
        conn.close()


def probe_readyz(ip: str, port: int, expected_world_size: int, timeout: float = PROBE_TIMEOUT_S):
    try:
        code, body = fetch_readyz(ip, port, timeout)
    except Unreachable as exc:
        return False, 0, expected_world_size, (), str(exc)
    return parse_readyz(code, body, expected_world_size)


def kubelet_ready(pod: V1Pod) -> bool:
    """The pod's Ready condition: the kubelet's readiness probe, which asks the same /readyz."""
    return any(c.type == "Ready" and c.status == "True" for c in (pod.status.conditions if pod.status else None) or [])


def container_port(pod: V1Pod, name: str) -> int | None:
    """The port named ``name`` of any of the pod's containers, as its spec says; None: none is named so."""
    for container in (pod.spec.containers if pod.spec else None) or []:
        for port in container.ports or []:
            if port.name == name and port.container_port:
                return port.container_port
    return None


def pod_port(pod: V1Pod, default: int) -> int:
    """The pod's own ``ws`` port: during a port change old pods still listen on the old one."""
    return container_port(pod, PORT_NAME) or default


def pod_health(
    pod: V1Pod,
    port: int,
    world_size: int,
    timeout: float = PROBE_TIMEOUT_S,
    claims: Sequence[V1PersistentVolumeClaim] = (),
) -> PodHealth:
    """One pod's health: what the kubelet and the scheduler say of it, then its own ``/readyz`` once it runs.

    ``claims`` are the cache claims as read: a pod the scheduler turns away only until they bind is waiting
    (``claims_binding``), not unschedulable.
    """
    pod_meta, status = meta_of(pod), pod.status
    phase = (status.phase if status else None) or "Pending"
    ip = status.pod_ip if status else None
    binding = claims_binding(pod, claims)
    facts = PodHealth(
        pod_meta.name or "?",
        ip,
        phase,
        world_size,
        revision=(pod_meta.labels or {}).get(LABEL_CONTROLLER_REVISION_HASH),
        unschedulable="" if binding else unschedulable_message(pod),
        termination=termination(pod),
        crash_loop=crash_loop(pod),
        created=rfc3339(pod_meta.creation_timestamp),
    )
    if pod_meta.deletion_timestamp:
        return dataclasses.replace(facts, phase="Terminating", message="terminating")
    if phase != "Running" or not ip:
        return dataclasses.replace(facts, message=_crashing(facts) or binding or container_message(pod) or phase)
    try:
        code, body = fetch_readyz(ip, pod_port(pod, port), timeout)
    except Unreachable as exc:
        return unreachable_health(facts, pod, exc)
    read = read_readyz(code, body, world_size)
    return dataclasses.replace(
        facts,
        world_size=read.world_size,
        ranks_ready=read.ranks_ready,
        ready=read.ready,
        ranks=read.ranks,
        message=(_crashing(facts) or read.message) if not read.ready else read.message,
        batching=read.batching,
    )


def _crashing(facts: PodHealth) -> str:
    return f"crash-looping: {facts.crash_loop}" if facts.crash_loop else ""


def _not_ready_since(pod: V1Pod) -> str:
    """When the kubelet's readiness probe last turned the pod's Ready condition False ("" if it is not False)."""
    for c in (pod.status.conditions if pod.status else None) or []:
        if c.type == "Ready" and c.status == "False" and c.last_transition_time:
            return rfc3339(c.last_transition_time)
    return ""


def unreachable_health(facts: PodHealth, pod: V1Pod, exc: Unreachable) -> PodHealth:
    """A pod whose ``/readyz`` gave no HTTP answer: starting, unless the kubelet already calls it Ready.

    Every new pod refuses connections until its rank 0 listens, so an
    unreachable pod that the kubelet does not call Ready is simply not
    serving yet (0 ranks, known), or crash-looping when the kubelet restarts
    it after a failure.  One that took the connection and never answered
    (``NotAnswering``) is hung: not ready, whatever the kubelet last saw.
    Only one the kubelet's probe of the same ``/readyz`` found Ready and the
    operator cannot connect to is one the operator cannot see: its ranks count
    as ready on the kubelet's word and are flagged unknown.
    """
    if isinstance(exc, NotAnswering):
        since = _not_ready_since(pod)
        kubelet = f"; the kubelet's readiness probe fails since {since}" if since else ""
        return dataclasses.replace(facts, ranks_ready=0, ready=False, message=f"{exc}{kubelet}")
    if kubelet_ready(pod):
        return dataclasses.replace(
            facts,
            ranks_ready=facts.world_size,
            ready=True,
            ranks_known=False,
            message=f"{exc}; the kubelet reports the pod ready",
        )
    if facts.crash_loop:
        return dataclasses.replace(facts, ranks_ready=0, ready=False, message=_crashing(facts))
    detail = container_message(pod)
    return dataclasses.replace(
        facts, ranks_ready=0, ready=False, message=f"starting: {exc}" + (f" ({detail})" if detail else "")
    )


def poll_pods(
    pods: Sequence[V1Pod],
    port: int,
    world_size: int,
    timeout: float = PROBE_TIMEOUT_S,
    claims: Sequence[V1PersistentVolumeClaim] = (),
) -> list[PodHealth]:
    """Every pod's health, probed concurrently so one hung pod costs one timeout, not N."""
    ordered = sorted(pods, key=lambda p: _ordinal_key(meta_of(p).name or ""))
    if not ordered:
        return []
    with ThreadPoolExecutor(max_workers=min(MAX_PARALLEL_PROBES, len(ordered))) as pool:
        return list(pool.map(lambda p: pod_health(p, port, world_size, timeout, claims), ordered))


def _ordinal_key(name: str) -> tuple[str, int]:
    base, _, ordinal = name.rpartition("-")
    return (base, int(ordinal)) if ordinal.isdigit() else (name, -1)
