"""The status step of a reconcile pass: what the status says, and writing it.

Deciding is a pure function of the spec and what was observed, so the phase
table is unit-tested row by row and a restarted operator computes the same
status from the same cluster.  Writing is two small merge patches: the status
subresource (only the keys that changed, so kopf's own keys and foreign
conditions survive) and each pod's rank-readiness annotation.

Status never claims more than was observed: ``Ready`` (phase and condition)
needs the StatefulSet to have rolled -- ready pods of an old template are
Available, and Progressing=True RollingOut; a pod the API server refused or
the scheduler cannot place is named in status with the refusal; and a rollout
that makes no progress for ``spec.progressDeadlineSeconds`` becomes
Progressing=False ProgressDeadlineExceeded with the failing container's last
words, instead of Starting forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client import V1Pod

from policy_operator.constants import (
    ANNOTATION_RANKS_READY,
    COND_AVAILABLE,
    COND_CHECKPOINT_READY,
    COND_PROGRESSING,
    COND_READY,
    COND_RECONCILING,
    COND_STALLED,
    COND_STORAGE_READY,
    COND_VALID,
    PHASE_DEGRADED,
    PHASE_DOWNLOADING,
    PHASE_FAILED,
    PHASE_PENDING,
    PHASE_READY,
    PHASE_STARTING,
)
from policy_operator.operator.conditions import (
    FALSE,
    FETCH_BLOCKED_REASONS,
    STALLED_REASONS,
    STUCK_REASONS,
    TRUE,
    Condition,
    Event,
    Reason,
    condition_events,
    merge_conditions,
    phase_event,
)
from policy_operator.operator.download_state import CheckpointPhase, CheckpointState
from policy_operator.operator.kube import Kube, NotFound, Rejected
from policy_operator.operator.kube_objects import meta_of
from policy_operator.operator.manifests import VOL_CACHE, claim_name, endpoint, lerobot_grpc_endpoint, selector_string
from policy_operator.operator.rank_probe import PodHealth
from policy_operator.operator.resource import (
    BatchingStatus,
    CheckpointStatus,
    DownloadProgress,
    PodStatus,
    PolicyServerStatus,
)
from policy_operator.operator.resource import Condition as StatusCondition
from policy_operator.operator.spec import PolicyServerSpec
from policy_operator.operator.storage_plan import StorageCheck
from policy_operator.operator.workload_state import WorkloadState

_NOT_YET = (CheckpointPhase.PENDING, CheckpointPhase.DOWNLOADING)


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).replace(microsecond=0).isoformat().replace("+00:00", "Z")


def _seconds_between(earlier: str, later: str) -> float:
    def parse(value: str) -> datetime.datetime:
        return datetime.datetime.fromisoformat(value.replace("Z", "+00:00"))

    return (parse(later) - parse(earlier)).total_seconds()


# --- deciding ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Blocker:
    """Why pods that should exist or run do not: the API server refused them, or no node fits them."""

    reason: Reason
    message: str


def blocker(workload: WorkloadState, pods: Sequence[PodHealth]) -> Blocker | None:
    if workload.failed_create:
        return Blocker(Reason.FAILED_CREATE, f"the StatefulSet controller cannot create pods: {workload.failed_create}")
    for pod in pods:
        if pod.unschedulable and pod.phase == "Pending":
            return Blocker(Reason.UNSCHEDULABLE, f"pod {pod.name} cannot be scheduled: {pod.unschedulable}")
    return None


def updated_pods(workload: WorkloadState, pods: Sequence[PodHealth]) -> list[PodHealth]:
    """The pods that run the StatefulSet's current template (all of them when the revision is not known yet)."""
    live = [p for p in pods if p.phase != "Terminating"]
    if workload.update_revision is None:
        return live
    return [p for p in live if p.revision == workload.update_revision]


def decide_phase(
    *,
    checkpoint: CheckpointState,
    workload: WorkloadState,
    ready_pods: int,
    previous_phase: str | None,
    updated_ready: int | None = None,
    blocked: bool = False,
    deadline_exceeded: bool = False,
    crash_looping: bool = False,
) -> str:
    """The one-word summary; see docs/operator.md for the table.

    ``ready_pods`` counts every ready pod (old template or new), ``updated_ready``
    only those of the current template: Ready needs the rollout to be done.
    ``crash_looping``: a pod of the current template is being restarted after
    a failure (``crash_looping``): failing, not starting.
    """
    updated_ready = ready_pods if updated_ready is None else updated_ready
    serving = workload.exists and ready_pods > 0
    if checkpoint.phase == CheckpointPhase.FAILED:
        return PHASE_DEGRADED if serving else PHASE_FAILED
    if checkpoint.phase in _NOT_YET and not (workload.exists and workload.serving_key):
        return PHASE_PENDING if checkpoint.phase == CheckpointPhase.PENDING else PHASE_DOWNLOADING
    if checkpoint.phase in _NOT_YET:
        return PHASE_DOWNLOADING  # a new checkpoint downloads while the old one keeps serving
    if workload.desired == 0:
        return PHASE_PENDING
    if not workload.rolling and updated_ready >= workload.desired:
        return PHASE_READY
    if deadline_exceeded or crash_looping:
        return PHASE_DEGRADED if serving else PHASE_FAILED
    if blocked and not serving:
        return PHASE_PENDING  # no pod can be created or placed: nothing is starting
    if workload.rolling or previous_phase not in (PHASE_READY, PHASE_DEGRADED):
        return PHASE_STARTING
    return PHASE_DEGRADED


def is_progressing(phase: str, block: Blocker | None) -> bool:
    """Whether the progress deadline runs: pods are starting or rolling, or are held back from it."""
    return phase == PHASE_STARTING or (phase == PHASE_PENDING and block is not None)


def last_progress(previous: Mapping[str, Any], marker: Mapping[str, Any], now: str) -> str:
    """When the rollout last moved: kept from ``previous`` while nothing in ``marker`` changed."""
    since = previous.get("lastProgressTime")
    if since and all(previous.get(k) == v for k, v in marker.items()):
        return str(since)
    return now


def batching_status(pods: Sequence[PodHealth], updated: Sequence[PodHealth]) -> BatchingStatus | None:
    """The newest ready pod's batch times under a latency budget, a pod of the current template first (during a
    rollout the old pods measured under the old spec)."""
    current = {p.name for p in updated}
    measured = [p for p in pods if p.ready and p.batching is not None]
    if not measured:
        return None
    pod = max(measured, key=lambda p: (p.name in current, p.created, p.name))
    assert pod.batching is not None
    return BatchingStatus.model_validate({**pod.batching.as_status(), "pod": pod.name})


def deadline_detail(pods: Sequence[PodHealth], block: Blocker | None) -> str:
    """Why the rollout is stuck: a container's termination message first (the failing rank's last words)."""
    for pod in pods:
        if pod.termination:
            return f"pod {pod.name}: {pod.termination}"
    if block is not None:
        return block.message
    for pod in pods:
        if pod.message and not pod.ready:
            return f"pod {pod.name}: {pod.message}"
    return "no pod became ready"


def checkpoint_condition(ck: CheckpointState) -> Condition:
    return Condition(COND_CHECKPOINT_READY, TRUE if ck.phase == CheckpointPhase.READY else FALSE, ck.reason, ck.message)


def available_condition(
    *,
    checkpoint: CheckpointState,
    workload: WorkloadState,
    ready_pods: int,
    ranks: str,
    previously_available: bool,
    block: Blocker | None = None,
    ranks_unknown: bool = False,
    updated_ready: int | None = None,
) -> Condition:
    summary = f"{ready_pods}/{workload.desired} pods ready ({ranks} ranks)"
    if updated_ready is not None and updated_ready != ready_pods:
        summary += f", {updated_ready} of them on the current spec"
    if ranks_unknown:
        summary += "; ranks unknown: /readyz unreachable from the operator, readiness is the kubelet's"
    if ready_pods > 0:
        reason = Reason.REPLICAS_READY if ready_pods >= workload.desired else Reason.PARTIALLY_READY
        return Condition(COND_AVAILABLE, TRUE, Reason.RANKS_UNKNOWN if ranks_unknown else reason, summary)
    if workload.desired == 0:
        return Condition(COND_AVAILABLE, FALSE, Reason.SCALED_TO_ZERO, "replicas is 0")
    if not workload.exists and checkpoint.phase != CheckpointPhase.READY:
        return Condition(
            COND_AVAILABLE, FALSE, Reason.CHECKPOINT_NOT_READY, "pods start once the checkpoint is downloaded"
        )
    if block is not None:
        return Condition(COND_AVAILABLE, FALSE, block.reason, block.message)
    reason = Reason.REPLICAS_UNAVAILABLE if previously_available else Reason.NO_REPLICAS_READY
    return Condition(COND_AVAILABLE, FALSE, reason, summary)


def progressing_condition(
    phase: str,
    *,
    checkpoint: CheckpointState,
    workload: WorkloadState,
    block: Blocker | None = None,
    deadline: str | None = None,
    updated: int = 0,
    crash: str | None = None,
) -> Condition:
    """``deadline``: the ProgressDeadlineExceeded message, once the rollout made no progress for too long.
    ``crash``: a pod of the current template the kubelet keeps restarting (``crash_looping``): Progressing stays
    True (the kubelet retries, the deadline still runs) with reason CrashLoopBackOff and what killed it."""
    if deadline is not None:
        return Condition(COND_PROGRESSING, FALSE, Reason.PROGRESS_DEADLINE_EXCEEDED, deadline)
    if crash is not None and phase in (PHASE_FAILED, PHASE_DEGRADED):
        return Condition(COND_PROGRESSING, TRUE, Reason.CRASH_LOOP_BACK_OFF, crash)
    if phase == PHASE_PENDING and workload.desired == 0 and checkpoint.phase == CheckpointPhase.READY:
        return Condition(COND_PROGRESSING, FALSE, Reason.STABLE, "scaled to zero")
    if block is not None and is_progressing(phase, block):
        return Condition(COND_PROGRESSING, TRUE, block.reason, block.message)
    if phase in (PHASE_PENDING, PHASE_DOWNLOADING):  # a fetch pod refused, unplaceable or not starting says so
        reason = checkpoint.reason if checkpoint.reason in FETCH_BLOCKED_REASONS else Reason.DOWNLOADING
        return Condition(COND_PROGRESSING, TRUE, reason, checkpoint.message)
    if phase == PHASE_STARTING:
        return Condition(
            COND_PROGRESSING,
            TRUE,
            Reason.ROLLING_OUT,
            f"{updated}/{workload.desired} pods run the current spec; pods are starting or being replaced",
        )
    if phase == PHASE_READY:
        return Condition(COND_PROGRESSING, FALSE, Reason.STABLE, "every pod runs the current spec")
    if phase == PHASE_FAILED or checkpoint.phase == CheckpointPhase.FAILED:
        stuck = checkpoint.reason == Reason.PROGRESS_DEADLINE_EXCEEDED  # a fetch pod that never started
        return Condition(
            COND_PROGRESSING, FALSE, Reason.PROGRESS_DEADLINE_EXCEEDED if stuck else Reason.FAILED, checkpoint.message
        )
    return Condition(COND_PROGRESSING, FALSE, Reason.REPLICAS_UNAVAILABLE, "some pods are not ready")


def ready_condition(phase: str, *, available: Condition, progressing: Condition, desired: int) -> Condition:
    """The one condition generic tools read: True only in phase Ready, else the most telling other reason."""
    if phase == PHASE_READY and progressing.reason == Reason.STABLE:
        return Condition(COND_READY, TRUE, Reason.REPLICAS_READY, f"{desired}/{desired} pods ready on the current spec")
    if progressing.status == TRUE or progressing.reason in STUCK_REASONS:
        return Condition(COND_READY, FALSE, progressing.reason, progressing.message)
    if available.status == FALSE:
        return Condition(COND_READY, FALSE, available.reason, available.message)
    return Condition(COND_READY, FALSE, progressing.reason, progressing.message)


def storage_condition(spec: PolicyServerSpec, check: StorageCheck) -> Condition:
    """StorageReady: the cache claims are as spec.storage says, are growing to its size, or why they cannot be."""
    storage = spec.storage
    if check.problems:
        reason, _ = check.problems[0]
        return Condition(COND_STORAGE_READY, FALSE, reason, "; ".join(m for _, m in check.problems))
    if check.growing:
        return Condition(
            COND_STORAGE_READY, TRUE, Reason.EXPANDING, f"growing {', '.join(check.growing)} to {storage.size}"
        )
    what = (
        f"one claim per pod ({VOL_CACHE}-{spec.name}-N), {storage.size}"
        if storage.per_pod
        else f"claim {claim_name(spec)}"
    )
    return Condition(
        COND_STORAGE_READY, TRUE, Reason.STORAGE_AS_SPECIFIED, f"{what} as spec.storage says (mode {storage.mode})"
    )


def kstatus_conditions(ready: Condition, *, scaled_to_zero: bool = False) -> list[Condition]:
    """Reconciling and Stalled, the two conditions kstatus (Flux's health checks, kpt, cli-utils) reads.

    kstatus calls a resource Current when neither is True (and observedGeneration
    is current): so Reconciling is True whenever Ready is False for a reason that
    time may fix (a download, a rollout, a refusal that may be lifted, a pod
    restarting), Stalled when only a change can (an invalid spec, a failed
    download, a passed progress deadline, a name conflict).
    """
    stalled = ready.status == FALSE and ready.reason in STALLED_REASONS
    reconciling = ready.status == FALSE and not stalled and not scaled_to_zero
    return [
        Condition(COND_RECONCILING, TRUE if reconciling else FALSE, ready.reason, ready.message),
        Condition(COND_STALLED, TRUE if stalled else FALSE, ready.reason, ready.message),
    ]


def status_conditions(merged: Sequence[Mapping[str, Any]]) -> list[StatusCondition]:
    """``merge_conditions``' API form (this pass's conditions and those it keeps) as the status model's."""
    return [StatusCondition.model_validate(c) for c in merged]


@dataclass(frozen=True)
class StatusUpdate:
    status: PolicyServerStatus  # only the fields this pass decides are set
    events: list[Event]

    @property
    def document(self) -> dict[str, Any]:
        """The status as the API stores it (``status_document``)."""
        return status_document(self.status)


def invalid_status(error: Exception, *, previous: Mapping[str, Any] | None, generation: int, now: str) -> StatusUpdate:
    """Only Valid, Ready and the phase change: whatever already runs keeps running, its conditions stay true."""
    previous = previous or {}
    cond = Condition(COND_VALID, FALSE, Reason.INVALID_SPEC, str(error))
    ready = Condition(COND_READY, FALSE, Reason.INVALID_SPEC, str(error))
    status = PolicyServerStatus(
        observed_generation=generation,
        phase=PHASE_FAILED,
        conditions=status_conditions(
            merge_conditions(
                previous.get("conditions"), [ready, *kstatus_conditions(ready), cond], generation=generation, now=now
            )
        ),
    )
    events = condition_events(previous.get("conditions"), [cond]) + phase_event(
        previous.get("phase"), PHASE_FAILED, str(error)
    )
    return StatusUpdate(status, events)


@dataclass(frozen=True)
class PodCounts:
    """What the pods say, counted once for the phase, the conditions and the status fields."""

    ready: int  # pods with every rank ready, of any template
    updated: list[PodHealth]  # live pods of the current template
    updated_ready: int
    ranks: str  # "ready/total" ranks, capped at what is desired (a surge pod serves beside the one it replaces)
    ranks_unknown: bool  # some live pod's /readyz was unreachable: its readiness is the kubelet's

    @classmethod
    def of(cls, spec: PolicyServerSpec, workload: WorkloadState, pods: Sequence[PodHealth]) -> PodCounts:
        updated = updated_pods(workload, pods)
        total_ranks = workload.desired * spec.layout.world_size
        return cls(
            ready=sum(1 for p in pods if p.ready),
            updated=updated,
            updated_ready=sum(1 for p in updated if p.ready),
            ranks=f"{min(sum(p.ranks_ready for p in pods), total_ranks)}/{total_ranks}",
            ranks_unknown=any(not p.ranks_known for p in pods if p.phase != "Terminating"),
        )


def crash_looping(checkpoint: CheckpointState, workload: WorkloadState, updated: Sequence[PodHealth]) -> str | None:
    """ "pod P: <what killed it>" for the first pod of the current template the kubelet keeps restarting, or None.

    Such a pod is failing, not starting: the phase says so at once (Failed, or Degraded while other pods serve)
    instead of Starting until ``progressDeadlineSeconds``.  Only once the checkpoint is ready (before, the pods
    are the old template's or none) and pods are wanted."""
    if checkpoint.phase != CheckpointPhase.READY or workload.desired == 0:
        return None
    pod = next((p for p in updated if p.crash_loop and not p.ready), None)
    return f"pod {pod.name}: {pod.crash_loop}" if pod is not None else None


def previously_available(prev_conditions: Sequence[Mapping[str, Any]]) -> bool:
    """It served before: Available was True, or already says it no longer is (sticky for the whole outage)."""
    return any(
        c.get("type") == COND_AVAILABLE and (c.get("status") == TRUE or c.get("reason") == Reason.REPLICAS_UNAVAILABLE)
        for c in prev_conditions
    )


@dataclass(frozen=True)
class Progress:
    """The progress deadline's clock: when the rollout last moved, and the deadline's message once it passed."""

    since: str | None  # status.lastProgressTime; None while nothing is starting or rolling
    deadline: str | None  # the ProgressDeadlineExceeded message


def rollout_progress(
    spec: PolicyServerSpec,
    *,
    phase: str,
    block: Blocker | None,
    workload: WorkloadState,
    counts: PodCounts,
    pods: Sequence[PodHealth],
    previous: Mapping[str, Any],
    generation: int,
    now: str,
) -> Progress:
    """The clock restarts whenever the rollout moves: a new spec, a new or newly ready pod of the current one."""
    if not is_progressing(phase, block):
        return Progress(None, None)
    marker = {
        "observedGeneration": generation,
        "templateHash": workload.template_hash,
        "updatedReplicas": len(counts.updated),
        "updatedReadyReplicas": counts.updated_ready,
    }
    since = last_progress(previous, marker, now)
    if _seconds_between(since, now) <= spec.progress_deadline_seconds:
        return Progress(since, None)
    detail = deadline_detail(counts.updated or pods, block)
    return Progress(
        since, f"no progress for {spec.progress_deadline_seconds}s (spec.progressDeadlineSeconds): {detail}"
    )


def valid_condition(spec: PolicyServerSpec) -> Condition:
    return Condition(
        COND_VALID,
        TRUE,
        Reason.SPEC_VALID,
        f"layout {spec.layout.label} (world size {spec.layout.world_size}), {spec.gpus_per_pod} GPU(s) per pod",
    )


def phase_summary(
    phase: str,
    *,
    checkpoint: CheckpointState,
    block: Blocker | None,
    available: Condition,
    progressing: Condition,
    deadline: str | None,
) -> str:
    """What the phase's Event says: the deadline, the crash, the download's state, or the pods' counts."""
    if deadline is not None:
        return deadline
    if progressing.reason == Reason.CRASH_LOOP_BACK_OFF:
        return progressing.message
    if phase in (PHASE_PENDING, PHASE_DOWNLOADING, PHASE_FAILED) and block is None:
        return checkpoint.message
    return available.message


def build_status(
    spec: PolicyServerSpec,
    *,
    checkpoint: CheckpointState,
    workload: WorkloadState,
    pods: Sequence[PodHealth],
    service_exists: bool,
    previous: Mapping[str, Any] | None,
    generation: int,
    now: str,
    problem: Condition | None = None,
    storage: StorageCheck | None = None,
) -> StatusUpdate:
    """The full status of a valid PolicyServer, and the Events for what changed since ``previous``.

    ``problem`` is a Progressing=False condition from the apply step (a name
    conflict or an object the API server rejected); it wins over the phase's own.
    ``storage`` is what planning found of the cache claims (StorageReady); None leaves StorageReady as it was.
    """
    previous = previous or {}
    counts = PodCounts.of(spec, workload, pods)
    prev_conditions = previous.get("conditions") or []
    block = blocker(workload, pods) if workload.exists else None
    crash = crash_looping(checkpoint, workload, counts.updated)
    phase_args: dict[str, Any] = dict(
        checkpoint=checkpoint,
        workload=workload,
        ready_pods=counts.ready,
        previous_phase=previous.get("phase"),
        updated_ready=counts.updated_ready,
        blocked=block is not None,
    )
    progress = rollout_progress(
        spec,
        phase=decide_phase(**phase_args),  # the clock runs on the pods' own progress, whether or not they crash
        block=block,
        workload=workload,
        counts=counts,
        pods=pods,
        previous=previous,
        generation=generation,
        now=now,
    )
    phase = decide_phase(**phase_args, deadline_exceeded=progress.deadline is not None, crash_looping=crash is not None)
    available = available_condition(
        checkpoint=checkpoint,
        workload=workload,
        ready_pods=counts.ready,
        ranks=counts.ranks,
        previously_available=previously_available(prev_conditions),
        block=block,
        ranks_unknown=counts.ranks_unknown and counts.ready > 0,
        updated_ready=counts.updated_ready if workload.rolling else None,
    )
    progressing = problem or progressing_condition(
        phase,
        checkpoint=checkpoint,
        workload=workload,
        block=block,
        deadline=progress.deadline,
        updated=len(counts.updated),
        crash=crash,
    )
    conditions = [valid_condition(spec), checkpoint_condition(checkpoint), available, progressing]
    ready = ready_condition(phase, available=available, progressing=progressing, desired=workload.desired)
    storage_ready = [storage_condition(spec, storage)] if storage is not None else []
    kstatus = kstatus_conditions(ready, scaled_to_zero=(workload.desired == 0 and progressing.reason == Reason.STABLE))
    status = PolicyServerStatus(
        observed_generation=generation,
        phase=phase,
        replicas=workload.current if workload.exists else 0,
        ready_replicas=counts.ready,
        updated_replicas=len(counts.updated),
        updated_ready_replicas=counts.updated_ready,
        ready=f"{min(counts.ready, workload.desired)}/{workload.desired}",
        ranks_ready=counts.ranks,
        layout=spec.layout.label,
        selector=selector_string(spec.name),
        endpoint=endpoint(spec) if service_exists else None,
        lerobot_grpc_endpoint=lerobot_grpc_endpoint(spec) if service_exists else None,
        template_hash=workload.template_hash or None,
        last_progress_time=progress.since,
        checkpoint=checkpoint_status(spec, checkpoint, workload),
        pods=[PodStatus.model_validate(p.as_status()) for p in pods],
        batching=batching_status(pods, counts.updated) if spec.runtime.batching.latency_budget_ms is not None else None,
        conditions=status_conditions(
            merge_conditions(
                prev_conditions, [ready, *kstatus, *conditions, *storage_ready], generation=generation, now=now
            )
        ),
    )
    summary = phase_summary(
        phase,
        checkpoint=checkpoint,
        block=block,
        available=available,
        progressing=progressing,
        deadline=progress.deadline,
    )
    # Ready, Reconciling and Stalled summarise the others: their changes are told by the others' Events and the phase's
    events = (
        condition_events(prev_conditions, conditions)
        + phase_event(previous.get("phase"), phase, summary)
        + condition_events(prev_conditions, storage_ready)
    )
    return StatusUpdate(status, events)


def checkpoint_status(spec: PolicyServerSpec, checkpoint: CheckpointState, workload: WorkloadState) -> CheckpointStatus:
    """``status.checkpoint``: the spec's checkpoint, where its download stands, and what the pods serve.

    Progress only while downloading (a finished download's bytes say nothing); the claim's uid only once the
    checkpoint is ready in it, so a claim recreated under the same name is never taken for the verified one.
    """
    ck = spec.checkpoint
    downloading = checkpoint.progress is not None and checkpoint.phase == CheckpointPhase.DOWNLOADING
    return CheckpointStatus(
        key=ck.key,
        source=ck.source,
        revision=ck.revision,
        path=ck.path,
        job_name=checkpoint.job_name,
        phase=checkpoint.phase,
        message=checkpoint.message,
        progress=DownloadProgress.model_validate(checkpoint.progress.as_status())
        if downloading and checkpoint.progress is not None
        else None,
        serving_key=workload.serving_key or None,
        claim_uid=checkpoint.claim_uid if checkpoint.claim_uid and checkpoint.phase == CheckpointPhase.READY else None,
    )


# --- writing ----------------------------------------------------------------------------------

# Every status key the schema declares; a full write drops those this pass no longer sets.
STATUS_FIELDS = tuple(f.alias or name for name, f in PolicyServerStatus.model_fields.items())


def status_document(status: PolicyServerStatus) -> dict[str, Any]:
    """The status as the API stores it: camelCase, and only the fields the pass set (a partial status, such as
    ``invalid_status``'s, leaves the others as they are)."""
    return status.model_dump(mode="json", by_alias=True, exclude_none=True, exclude_unset=True)


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any], *, full: bool) -> dict[str, Any] | None:
    """A merge patch from ``previous`` to ``new`` status (None when nothing changed); ``full`` drops stale keys."""
    patch: dict[str, Any] = {}
    for key, value in new.items():
        old = previous.get(key)
        if old == value:
            continue
        patch[key] = _replacing(old, value)
    if full:
        patch.update({k: None for k in STATUS_FIELDS if k in previous and k not in new})
    return patch or None


def _replacing(old: Any, new: Any) -> Any:
    """``new`` as a merge-patch value over ``old``: a merge patch merges maps, so a nested key this pass no longer
    writes (checkpoint.progress once the download is done, a bucket of batching.bucketsMs) must be sent as null,
    at any depth, or it stays forever."""
    if not (isinstance(new, Mapping) and isinstance(old, Mapping)):
        return new
    return {**{k: _replacing(old.get(k), v) for k, v in new.items()}, **{k: None for k in old if k not in new}}


def write_status(
    kube: Kube, namespace: str, name: str, previous: Mapping[str, Any], status: PolicyServerStatus, *, full: bool
) -> None:
    """Merge-patch the status subresource from ``previous`` (as read) to ``status``, serialized here, once."""
    patch = status_patch(previous, status_document(status), full=full)
    if patch is not None:
        kube.merge_patch("PolicyServer", namespace, name, {"status": patch}, subresource="status")


def annotate_pods(kube: Kube, namespace: str, pods: Sequence[V1Pod], healths: Sequence[PodHealth]) -> None:
    """Mirror each pod's rank readiness into an annotation, so `kubectl get pods` users see it too."""
    by_name = {meta_of(p).name: p for p in pods}
    for h in healths:
        pod = by_name.get(h.name)
        if pod is None or h.phase == "Terminating":
            continue
        if (meta_of(pod).annotations or {}).get(ANNOTATION_RANKS_READY) != h.ranks_text:
            try:
                kube.merge_patch(
                    "Pod", namespace, h.name, {"metadata": {"annotations": {ANNOTATION_RANKS_READY: h.ranks_text}}}
                )
            except (NotFound, Rejected):  # a pod that just vanished is not worth failing the pass
                pass
