"""The observe step of a reconcile pass: read a PolicyServer's children and probe its pods' ranks.

Every pass reads the current state from the API instead of trusting the event
that woke it, which is what makes the operator level-triggered and
restart-safe: all names are deterministic, so a pass after a crash finds what
the previous one created.  Reads only; deciding is ``plan.py``/``status.py``.
"""

from __future__ import annotations

import logging
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policy_operator.constants import (
    COMPONENT_CACHE,
    COMPONENT_CACHE_GC,
    COMPONENT_FETCH,
    FETCH_PROGRESS_PORT,
    FETCH_PROGRESS_PORT_NAME,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
    PROGRESS_PATH,
)
from policy_operator.fetch_progress import MAX_BYTES as MAX_PROGRESS_BYTES
from policy_operator.operator import download_state, manifests, pod_problems, rank_probe
from policy_operator.operator.kube import Kube, KubeError
from policy_operator.operator.manifests import FETCH_CONTAINER, Names
from policy_operator.operator.rank_probe import PodHealth
from policy_operator.operator.spec import PolicyServerSpec

log = logging.getLogger(__name__)

PROGRESS_TIMEOUT_S = 1.0  # one small answer from a process busy downloading; a pass never waits longer for it


@dataclass
class Observed:
    """The PolicyServer's children as read from the API (None: does not exist)."""

    pvc: dict[str, Any] | None = None
    job: dict[str, Any] | None = None
    job_pods: list[dict[str, Any]] = field(default_factory=list)
    statefulset: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    headless_service: dict[str, Any] | None = None
    pods: list[dict[str, Any]] = field(default_factory=list)
    fetch_progress: str | None = None  # the running fetch container's newest progress line (its /progress)
    cache_claims: list[dict[str, Any]] = field(default_factory=list)  # perPod: the StatefulSet's claims
    storage_class: dict[str, Any] | None = None  # the cache claims' StorageClass, when readable
    pdb: dict[str, Any] | None = None
    gc_job: dict[str, Any] | None = None  # the cleanup Job of the spec's checkpoint
    cache_jobs: list[dict[str, Any]] = field(default_factory=list)  # every fetch and cleanup Job (shared cache)
    job_pods_all: list[dict[str, Any]] = field(default_factory=list)  # pods of every fetch and cleanup Job


def running_fetch_pod(job_pods: Sequence[Mapping[str, Any]]) -> Mapping[str, Any] | None:
    """The newest fetch pod whose fetch container is running: the attempt whose progress counts."""
    running = [
        p
        for p in job_pods
        if any(
            cs.get("name") == FETCH_CONTAINER and (cs.get("state") or {}).get("running") is not None
            for cs in (p.get("status") or {}).get("containerStatuses") or []
        )
    ]
    running.sort(key=lambda p: (p.get("metadata") or {}).get("creationTimestamp") or "")
    return running[-1] if running else None


def progress_port(pod: Mapping[str, Any]) -> int:
    """The fetch container's ``progress`` port (the Job's template names it), else the fixed default."""
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == FETCH_PROGRESS_PORT_NAME and port.get("containerPort"):
                return int(port["containerPort"])
    return FETCH_PROGRESS_PORT


def fetch_progress(
    job: Mapping[str, Any] | None, job_pods: Sequence[Mapping[str, Any]], timeout: float = PROGRESS_TIMEOUT_S
) -> str | None:
    """The running fetch container's newest progress line, from its ``/progress`` endpoint, or None.

    Read over the pod network as the server pods' ``/readyz`` is, so the
    operator needs no ``pods/log``.  Progress is a convenience: a pod that
    does not answer (starting, a NetworkPolicy in the way, an image older
    than the endpoint) leaves the status without it and never fails the pass.
    """
    if job is None or not ((job.get("status") or {}).get("active") or 0):
        return None
    pod = running_fetch_pod(job_pods)
    ip = ((pod or {}).get("status") or {}).get("podIP")
    if pod is None or not ip:
        return None
    url = f"http://{ip}:{progress_port(pod)}{PROGRESS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http to a pod IP
            return response.read(MAX_PROGRESS_BYTES).decode("utf-8", "replace") if response.status == 200 else None
    except (OSError, ValueError) as exc:
        log.debug("no download progress from %s: %s", url, exc)
        return None


def failed_create_events(
    kube: Kube, namespace: str, owner: Mapping[str, Any] | None, *, missing_pods: bool
) -> list[dict[str, Any]]:
    """The ``FailedCreate`` Events of a Job or StatefulSet, read only while some of its pods are missing.

    A pod the API server refuses never exists, so its refusal (quota,
    PodSecurity, a missing PriorityClass) is only in these Events.  An
    operator whose Role predates the ``events: list`` grant still reconciles;
    status then simply lacks the refusal.
    """
    uid = ((owner or {}).get("metadata") or {}).get("uid")
    if not missing_pods or not uid:
        return []
    try:
        return kube.list("Event", namespace, {}, {"involvedObject.uid": uid, "reason": pod_problems.FAILED_CREATE})
    except KubeError as exc:
        log.debug("no FailedCreate events of %s/%s: %s", namespace, (owner or {}).get("metadata", {}).get("name"), exc)
        return []


def job_events(
    kube: Kube, namespace: str, job: Mapping[str, Any] | None, job_pods: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """A running Job with no pod at all: the Job controller may be refused (its FailedCreate Events say why).
    A fetch pod that exists and does not start: the kubelet's Warnings on it (``FailedMount``) say why, when
    neither its containers nor the scheduler do."""
    status = (job or {}).get("status") or {}
    waiting = not job_pods and not status.get("succeeded") and not status.get("active")
    events = failed_create_events(kube, namespace, job, missing_pods=waiting)
    pod = download_state.waiting_fetch_pod(job_pods) if status.get("active") else None
    uid = ((pod or {}).get("metadata") or {}).get("uid")
    if pod is not None and uid and download_state.start_problem(pod) is None:
        try:
            events += kube.list("Event", namespace, {}, {"involvedObject.uid": uid, "type": "Warning"})
        except KubeError as exc:
            log.debug("no Events of the fetch pod %s: %s", uid, exc)
    return events


def statefulset_events(
    kube: Kube, namespace: str, sts: Mapping[str, Any] | None, pods: Sequence[Mapping[str, Any]]
) -> list[dict[str, Any]]:
    """Fewer pods than the StatefulSet asks for: its FailedCreate Events say whether one was refused."""
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    wanted = int(((sts or {}).get("spec") or {}).get("replicas") or 0)
    return failed_create_events(kube, namespace, sts, missing_pods=len(live) < wanted)


def children(kube: Kube, spec: PolicyServerSpec) -> Observed:
    ns, names = spec.namespace, Names(spec.name)
    job = kube.get("Job", ns, names.job(spec.checkpoint.key))
    job_pods = (
        kube.list(
            "Pod",
            ns,
            {**manifests.selector_labels(spec.name, COMPONENT_FETCH), LABEL_CHECKPOINT_KEY: spec.checkpoint.key},
        )
        if job
        else []
    )
    sts = kube.get("StatefulSet", ns, names.statefulset)
    # the rollout (rollout.py) decides from every server pod's revision, readiness and schedulability
    pods = kube.list("Pod", ns, manifests.selector_labels(spec.name)) if sts else []
    pvc = kube.get("PersistentVolumeClaim", ns, manifests.claim_name(spec))
    return Observed(
        pvc=pvc,
        job=job,
        job_pods=job_pods,
        fetch_progress=fetch_progress(job, job_pods),
        statefulset=sts,
        pods=pods,
        service=kube.get("Service", ns, names.service),
        headless_service=kube.get("Service", ns, names.headless_service),
        job_pods_all=[
            p
            for p in kube.list("Pod", ns, _instance_labels(spec.name))
            if ((p.get("metadata") or {}).get("labels") or {}).get(LABEL_COMPONENT)
            in (COMPONENT_FETCH, COMPONENT_CACHE_GC)
        ],
        **storage_and_disruption(kube, spec, pvc),
    )


def _instance_labels(name: str) -> dict[str, str]:
    """Every child of one PolicyServer, whatever its component."""
    return {k: v for k, v in manifests.selector_labels(name).items() if k != LABEL_COMPONENT}


def storage_and_disruption(kube: Kube, spec: PolicyServerSpec, pvc: dict[str, Any] | None) -> dict[str, Any]:
    """perPod cache claims, the cache's StorageClass, the PodDisruptionBudget and the cleanup Job.

    ``pvc`` is the shared cache claim as ``children`` read it (the claim named by ``manifests.claim_name``).
    """
    ns, names = spec.namespace, Names(spec.name)
    claims = (
        kube.list("PersistentVolumeClaim", ns, manifests.selector_labels(spec.name, COMPONENT_CACHE))
        if spec.storage.per_pod
        else []
    )
    shared = None if spec.storage.per_pod else pvc
    mine = (
        claims if spec.storage.per_pod else [c for c in [shared] if c is not None and not spec.storage.existing_claim]
    )
    class_name = ((mine[0] if mine else {}).get("spec") or {}).get("storageClassName")
    storage_class = None
    if class_name and any(wants_growth(c, spec.storage.size) for c in mine):
        storage_class = readable_storage_class(kube, class_name)
    return {
        "cache_claims": claims,
        "storage_class": storage_class,
        "pdb": kube.get("PodDisruptionBudget", ns, names.pdb),
        "gc_job": kube.get("Job", ns, names.gc_job(spec.checkpoint.key)),
        # fetch and cleanup Jobs of every checkpoint: a finished fetch vouches for a directory a cleanup removes
        "cache_jobs": []
        if spec.storage.per_pod or spec.storage.existing_claim
        else kube.list(
            "Job", ns, {k: v for k, v in manifests.selector_labels(spec.name).items() if k != LABEL_COMPONENT}
        ),
    }


def wants_growth(claim: Mapping[str, Any], size: str) -> bool:
    """The claim requests less than ``size``: only then does its StorageClass matter (allowVolumeExpansion)."""
    from kubernetes.utils import parse_quantity

    have = (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")
    try:
        return have is not None and parse_quantity(have) < parse_quantity(size)
    except ValueError:
        return False


_unreadable_classes: set[str] = set()  # read once and refused (403): RBAC does not change under a running operator


def readable_storage_class(kube: Kube, name: str) -> dict[str, Any] | None:
    """A StorageClass, read only when a claim is to grow and never again once RBAC refused it (cluster-scoped: a
    namespaced install may not read them; the apiserver's resize admission then decides)."""
    if name in _unreadable_classes:
        return None
    try:
        return kube.get("StorageClass", "", name)
    except KubeError as exc:
        if exc.status in (401, 403):
            _unreadable_classes.add(name)
        log.debug("StorageClass %s not readable: %s", name, exc)
        return None


def ranks(
    kube: Kube, spec: PolicyServerSpec, statefulset: Mapping[str, Any] | None, *, probe_timeout: float
) -> tuple[list[dict[str, Any]], list[PodHealth]]:
    """The server pods and each one's per-rank readiness from its own ``/readyz`` (concurrently, bounded)."""
    if statefulset is None:
        return [], []
    pods = kube.list("Pod", spec.namespace, manifests.selector_labels(spec.name))
    healths = rank_probe.poll_pods(pods, spec.service.port, spec.layout.world_size, timeout=probe_timeout)
    return pods, healths
