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

from kubernetes.client import (
    CoreV1Event,
    V1Job,
    V1PersistentVolumeClaim,
    V1Pod,
    V1PodDisruptionBudget,
    V1Service,
    V1StatefulSet,
    V1StorageClass,
)

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
from policy_operator.operator.kube_objects import HasMetadata, meta_of, rfc3339, typed_list, typed_or_none
from policy_operator.operator.manifests import Names
from policy_operator.operator.rank_probe import PodHealth
from policy_operator.operator.spec import PolicyServerSpec

log = logging.getLogger(__name__)

PROGRESS_TIMEOUT_S = 1.0  # one small answer from a process busy downloading; a pass never waits longer for it


@dataclass
class Observed:
    """The PolicyServer's children as read from the API (None: does not exist)."""

    pvc: V1PersistentVolumeClaim | None = None
    job: V1Job | None = None
    job_pods: list[V1Pod] = field(default_factory=list)
    statefulset: V1StatefulSet | None = None
    service: V1Service | None = None
    headless_service: V1Service | None = None
    pods: list[V1Pod] = field(default_factory=list)
    fetch_progress: str | None = None  # the running fetch container's newest progress line (its /progress)
    cache_claims: list[V1PersistentVolumeClaim] = field(default_factory=list)  # perPod: the StatefulSet's claims
    storage_class: V1StorageClass | None = None  # the cache claims' StorageClass, when readable
    pdb: V1PodDisruptionBudget | None = None
    gc_job: V1Job | None = None  # the cleanup Job of the spec's checkpoint
    cache_jobs: list[V1Job] = field(default_factory=list)  # every fetch and cleanup Job (shared cache)
    job_pods_all: list[V1Pod] = field(default_factory=list)  # pods of every fetch and cleanup Job


def running_fetch_pod(job_pods: Sequence[V1Pod]) -> V1Pod | None:
    """The newest fetch pod whose fetch container is running: the attempt whose progress counts."""
    running = [
        p
        for p in job_pods
        if (cs := download_state.fetch_container_status(p)) is not None
        and cs.state is not None
        and cs.state.running is not None
    ]
    running.sort(key=lambda p: rfc3339(meta_of(p).creation_timestamp))
    return running[-1] if running else None


def progress_port(pod: V1Pod) -> int:
    """The fetch container's ``progress`` port (the Job's template names it), else the fixed default."""
    return rank_probe.container_port(pod, FETCH_PROGRESS_PORT_NAME) or FETCH_PROGRESS_PORT


def fetch_progress(job: V1Job | None, job_pods: Sequence[V1Pod], timeout: float = PROGRESS_TIMEOUT_S) -> str | None:
    """The running fetch container's newest progress line, from its ``/progress`` endpoint, or None.

    Read over the pod network as the server pods' ``/readyz`` is, so the
    operator needs no ``pods/log``.  Progress is a convenience: a pod that
    does not answer (starting, a NetworkPolicy in the way, an image older
    than the endpoint) leaves the status without it and never fails the pass.
    """
    if job is None or job.status is None or not job.status.active:
        return None
    pod = running_fetch_pod(job_pods)
    if pod is None or pod.status is None or not pod.status.pod_ip:
        return None
    ip = pod.status.pod_ip
    url = f"http://{ip}:{progress_port(pod)}{PROGRESS_PATH}"
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 - http to a pod IP
            return response.read(MAX_PROGRESS_BYTES).decode("utf-8", "replace") if response.status == 200 else None
    except (OSError, ValueError) as exc:
        log.debug("no download progress from %s: %s", url, exc)
        return None


def failed_create_events(
    kube: Kube, namespace: str, owner: HasMetadata | None, *, missing_pods: bool
) -> list[CoreV1Event]:
    """The ``FailedCreate`` Events of a Job or StatefulSet, read only while some of its pods are missing.

    A pod the API server refuses never exists, so its refusal (quota,
    PodSecurity, a missing PriorityClass) is only in these Events.  An
    operator whose Role predates the ``events: list`` grant still reconciles;
    status then simply lacks the refusal.
    """
    uid = meta_of(owner).uid
    if not missing_pods or not uid:
        return []
    try:
        return _events(kube, namespace, {"involvedObject.uid": uid, "reason": pod_problems.FAILED_CREATE})
    except KubeError as exc:
        log.debug("no FailedCreate events of %s/%s: %s", namespace, meta_of(owner).name, exc)
        return []


def _events(kube: Kube, namespace: str, fields: Mapping[str, str]) -> list[CoreV1Event]:
    return typed_list(CoreV1Event, kube.list("Event", namespace, {}, fields))


def job_events(kube: Kube, namespace: str, job: V1Job | None, job_pods: Sequence[V1Pod]) -> list[CoreV1Event]:
    """A running Job with no pod at all: the Job controller may be refused (its FailedCreate Events say why).
    A fetch pod that exists and does not start: the kubelet's Warnings on it (``FailedMount``) say why, when
    neither its containers nor the scheduler do."""
    status = job.status if job else None
    active = bool(status.active if status else None)
    waiting = not job_pods and not (status.succeeded if status else None) and not active
    events = failed_create_events(kube, namespace, job, missing_pods=waiting)
    pod = download_state.waiting_fetch_pod(job_pods) if active else None
    uid = meta_of(pod).uid
    if pod is not None and uid and download_state.start_problem(pod) is None:
        try:
            events += _events(kube, namespace, {"involvedObject.uid": uid, "type": "Warning"})
        except KubeError as exc:
            log.debug("no Events of the fetch pod %s: %s", uid, exc)
    return events


def statefulset_events(
    kube: Kube, namespace: str, sts: V1StatefulSet | None, pods: Sequence[V1Pod]
) -> list[CoreV1Event]:
    """Fewer pods than the StatefulSet asks for: its FailedCreate Events say whether one was refused."""
    live = [p for p in pods if not meta_of(p).deletion_timestamp]
    wanted = (sts.spec.replicas if sts and sts.spec else None) or 0
    return failed_create_events(kube, namespace, sts, missing_pods=len(live) < wanted)


def children(kube: Kube, spec: PolicyServerSpec) -> Observed:
    ns, names = spec.namespace, Names(spec.name)
    job = typed_or_none(V1Job, kube.get("Job", ns, names.job(spec.checkpoint.key)))
    job_pods = (
        _pods(
            kube,
            ns,
            {**manifests.selector_labels(spec.name, COMPONENT_FETCH), LABEL_CHECKPOINT_KEY: spec.checkpoint.key},
        )
        if job
        else []
    )
    sts = typed_or_none(V1StatefulSet, kube.get("StatefulSet", ns, names.statefulset))
    # the rollout (rollout.py) decides from every server pod's revision, readiness and schedulability
    pods = _pods(kube, ns, manifests.selector_labels(spec.name)) if sts else []
    pvc = typed_or_none(V1PersistentVolumeClaim, kube.get("PersistentVolumeClaim", ns, manifests.claim_name(spec)))
    storage = storage_and_disruption(kube, spec, pvc)
    return Observed(
        pvc=pvc,
        job=job,
        job_pods=job_pods,
        fetch_progress=fetch_progress(job, job_pods),
        statefulset=sts,
        pods=pods,
        service=typed_or_none(V1Service, kube.get("Service", ns, names.service)),
        headless_service=typed_or_none(V1Service, kube.get("Service", ns, names.headless_service)),
        job_pods_all=[
            p
            for p in _pods(kube, ns, _instance_labels(spec.name))
            if (meta_of(p).labels or {}).get(LABEL_COMPONENT) in (COMPONENT_FETCH, COMPONENT_CACHE_GC)
        ],
        cache_claims=storage.cache_claims,
        storage_class=storage.storage_class,
        pdb=storage.pdb,
        gc_job=storage.gc_job,
        cache_jobs=storage.cache_jobs,
    )


def _pods(kube: Kube, namespace: str, selector: Mapping[str, str]) -> list[V1Pod]:
    return typed_list(V1Pod, kube.list("Pod", namespace, selector))


def _instance_labels(name: str) -> dict[str, str]:
    """Every child of one PolicyServer, whatever its component."""
    return {k: v for k, v in manifests.selector_labels(name).items() if k != LABEL_COMPONENT}


@dataclass(frozen=True)
class StorageAndDisruption:
    """The part of ``Observed`` that ``storage_and_disruption`` reads."""

    cache_claims: list[V1PersistentVolumeClaim]
    storage_class: V1StorageClass | None
    pdb: V1PodDisruptionBudget | None
    gc_job: V1Job | None
    cache_jobs: list[V1Job]


def storage_and_disruption(
    kube: Kube, spec: PolicyServerSpec, pvc: V1PersistentVolumeClaim | None
) -> StorageAndDisruption:
    """perPod cache claims, the cache's StorageClass, the PodDisruptionBudget and the cleanup Job.

    ``pvc`` is the shared cache claim as ``children`` read it (the claim named by ``manifests.claim_name``).
    """
    ns, names = spec.namespace, Names(spec.name)
    claims = (
        typed_list(
            V1PersistentVolumeClaim,
            kube.list("PersistentVolumeClaim", ns, manifests.selector_labels(spec.name, COMPONENT_CACHE)),
        )
        if spec.storage.per_pod
        else []
    )
    shared = None if spec.storage.per_pod else pvc
    mine = (
        claims if spec.storage.per_pod else [c for c in [shared] if c is not None and not spec.storage.existing_claim]
    )
    class_name = mine[0].spec.storage_class_name if mine and mine[0].spec else None
    storage_class = None
    if class_name and any(wants_growth(c, spec.storage.size) for c in mine):
        storage_class = readable_storage_class(kube, class_name)
    return StorageAndDisruption(
        cache_claims=claims,
        storage_class=storage_class,
        pdb=typed_or_none(V1PodDisruptionBudget, kube.get("PodDisruptionBudget", ns, names.pdb)),
        gc_job=typed_or_none(V1Job, kube.get("Job", ns, names.gc_job(spec.checkpoint.key))),
        # fetch and cleanup Jobs of every checkpoint: a finished fetch vouches for a directory a cleanup removes
        cache_jobs=[]
        if spec.storage.per_pod or spec.storage.existing_claim
        else typed_list(V1Job, kube.list("Job", ns, _instance_labels(spec.name))),
    )


def wants_growth(claim: V1PersistentVolumeClaim, size: str) -> bool:
    """The claim requests less than ``size``: only then does its StorageClass matter (allowVolumeExpansion)."""
    from kubernetes.utils import parse_quantity

    have = manifests.claim_storage(claim)
    try:
        return have is not None and parse_quantity(have) < parse_quantity(size)
    except ValueError:
        return False


_unreadable_classes: set[str] = set()  # read once and refused (403): RBAC does not change under a running operator


def readable_storage_class(kube: Kube, name: str) -> V1StorageClass | None:
    """A StorageClass, read only when a claim is to grow and never again once RBAC refused it (cluster-scoped: a
    namespaced install may not read them; the apiserver's resize admission then decides)."""
    if name in _unreadable_classes:
        return None
    try:
        return typed_or_none(V1StorageClass, kube.get("StorageClass", "", name))
    except KubeError as exc:
        if exc.status in (401, 403):
            _unreadable_classes.add(name)
        log.debug("StorageClass %s not readable: %s", name, exc)
        return None


def ranks(
    kube: Kube,
    spec: PolicyServerSpec,
    statefulset: V1StatefulSet | None,
    *,
    probe_timeout: float,
    claims: Sequence[V1PersistentVolumeClaim] = (),
) -> tuple[list[V1Pod], list[PodHealth]]:
    """The server pods and each one's per-rank readiness from its own ``/readyz`` (concurrently, bounded).

    ``claims``: the cache claims as ``children`` read them, so that a pod waiting for its claim to bind is
    told from one that cannot be placed."""
    if statefulset is None:
        return [], []
    pods = _pods(kube, spec.namespace, manifests.selector_labels(spec.name))
    healths = rank_probe.poll_pods(
        pods, spec.service.port, spec.layout.world_size, timeout=probe_timeout, claims=claims
    )
    return pods, healths


def cache_claims(observed: Observed) -> list[V1PersistentVolumeClaim]:
    """Every cache claim ``children`` read: the shared one and perPod's."""
    return [*([observed.pvc] if observed.pvc is not None else []), *observed.cache_claims]
