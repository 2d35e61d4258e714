"""Status of a PolicyServer: the four conditions, the phase, and the Events their changes deserve.

Everything here is a pure function of the spec and what was observed, so the
phase table is unit-tested row by row and a restarted operator computes the
same status from the same cluster.  ``lastTransitionTime`` only moves when a
condition's status flips (Kubernetes API conventions); an Event is posted for
every change of a condition's status or reason and of the phase.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policy_operator.constants import (
    COND_AVAILABLE,
    COND_CHECKPOINT_READY,
    COND_PROGRESSING,
    COND_VALID,
    PHASE_DEGRADED,
    PHASE_DOWNLOADING,
    PHASE_FAILED,
    PHASE_PENDING,
    PHASE_READY,
    PHASE_STARTING,
)
from policy_operator.operator.rank_probe import PodHealth
from policy_operator.operator.manifests import endpoint, selector_string
from policy_operator.operator.child_status import (
    CK_DOWNLOADING,
    CK_FAILED,
    CK_PENDING,
    CK_READY,
    FETCH_FAILURE_REASONS,
    CheckpointState,
    WorkloadState,
)
from policy_operator.operator.spec import PolicyServerSpec

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
CONDITION_TYPES = (COND_VALID, COND_CHECKPOINT_READY, COND_AVAILABLE, COND_PROGRESSING)

# Reasons (CamelCase, as Kubernetes conventions ask).  Those in WARNING_REASONS become Warning Events.
R_SPEC_VALID, R_INVALID_SPEC = "SpecValid", "InvalidSpec"
R_REPLICAS_READY, R_PARTIALLY_READY, R_NO_REPLICAS_READY = "ReplicasReady", "PartiallyReady", "NoReplicasReady"
R_REPLICAS_UNAVAILABLE, R_SCALED_TO_ZERO, R_CHECKPOINT_NOT_READY = "ReplicasUnavailable", "ScaledToZero", "CheckpointNotReady"
R_DOWNLOADING, R_ROLLING_OUT, R_STABLE, R_FAILED = "Downloading", "RollingOut", "Stable", "Failed"
R_CONFLICT, R_APPLY_FAILED = "NameConflict", "ApplyFailed"
WARNING_REASONS = frozenset({R_INVALID_SPEC, R_REPLICAS_UNAVAILABLE, R_CONFLICT, R_APPLY_FAILED, R_FAILED,
                             *FETCH_FAILURE_REASONS})


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: str
    message: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def merge_conditions(previous: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition], *,
                     generation: int, now: str) -> list[dict[str, Any]]:
    """The new conditions in API form; a type not in ``new`` is kept as it was."""
    old = {c.get("type"): c for c in previous or []}
    merged = []
    for cond in new:
        prev = old.get(cond.type) or {}
        since = prev.get("lastTransitionTime") if prev.get("status") == cond.status else None
        merged.append({"type": cond.type, "status": cond.status, "reason": cond.reason, "message": cond.message,
                       "lastTransitionTime": since or now, "observedGeneration": generation})
    types = {c.type for c in new}
    merged += [dict(c) for t, c in old.items() if t not in types]
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(merged, key=lambda c: order.get(c["type"], len(order)))


def condition_events(previous: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition]) -> list[Event]:
    old = {c.get("type"): c for c in previous or []}
    events = []
    for cond in new:
        prev = old.get(cond.type) or {}
        if (prev.get("status"), prev.get("reason")) != (cond.status, cond.reason):
            kind = "Warning" if cond.reason in WARNING_REASONS else "Normal"
            events.append(Event(kind, cond.reason, f"{cond.type}={cond.status}: {cond.message}"[:1000]))
    return events


def phase_event(previous: str | None, phase: str, message: str) -> list[Event]:
    if previous == phase:
        return []
    kind = "Warning" if phase in (PHASE_FAILED, PHASE_DEGRADED) else "Normal"
    return [Event(kind, phase, f"phase {previous or '(none)'} -> {phase}: {message}"[:1000])]


# --- the decisions --------------------------------------------------------------------------

def decide_phase(*, checkpoint: CheckpointState, workload: WorkloadState, ready_pods: int,
                 previous_phase: str | None) -> str:
    """The one-word summary; see docs/operator.md for the table."""
    serving = workload.exists and ready_pods > 0
    if checkpoint.phase == CK_FAILED:
        return PHASE_DEGRADED if serving else PHASE_FAILED
    if checkpoint.phase in (CK_PENDING, CK_DOWNLOADING) and not (workload.exists and workload.serving_key):
        return PHASE_PENDING if checkpoint.phase == CK_PENDING else PHASE_DOWNLOADING
    if checkpoint.phase in (CK_PENDING, CK_DOWNLOADING):
        return PHASE_DOWNLOADING  # a new checkpoint downloads while the old one keeps serving
    if workload.desired == 0:
        return PHASE_PENDING
    if ready_pods >= workload.desired:
        return PHASE_READY
    if workload.rolling or previous_phase not in (PHASE_READY, PHASE_DEGRADED):
        return PHASE_STARTING
    return PHASE_DEGRADED


def checkpoint_condition(ck: CheckpointState) -> Condition:
    return Condition(COND_CHECKPOINT_READY, TRUE if ck.phase == CK_READY else FALSE, ck.reason, ck.message)


def available_condition(*, checkpoint: CheckpointState, workload: WorkloadState, ready_pods: int, ranks: str,
                        previously_available: bool) -> Condition:
    summary = f"{ready_pods}/{workload.desired} pods ready ({ranks} ranks)"
    if ready_pods > 0:
        reason = R_REPLICAS_READY if ready_pods >= workload.desired else R_PARTIALLY_READY
        return Condition(COND_AVAILABLE, TRUE, reason, summary)
    if workload.desired == 0:
        return Condition(COND_AVAILABLE, FALSE, R_SCALED_TO_ZERO, "replicas is 0")
    if not workload.exists and checkpoint.phase != CK_READY:
        return Condition(COND_AVAILABLE, FALSE, R_CHECKPOINT_NOT_READY, "pods start once the checkpoint is downloaded")
    reason = R_REPLICAS_UNAVAILABLE if previously_available else R_NO_REPLICAS_READY
    return Condition(COND_AVAILABLE, FALSE, reason, summary)


def progressing_condition(phase: str, *, checkpoint: CheckpointState, workload: WorkloadState) -> Condition:
    if phase == PHASE_PENDING and workload.desired == 0 and checkpoint.phase == CK_READY:
        return Condition(COND_PROGRESSING, FALSE, R_STABLE, "scaled to zero")
    if phase in (PHASE_PENDING, PHASE_DOWNLOADING):
        return Condition(COND_PROGRESSING, TRUE, R_DOWNLOADING, checkpoint.message)
    if phase == PHASE_STARTING:
        return Condition(COND_PROGRESSING, TRUE, R_ROLLING_OUT, "pods are starting or being replaced")
    if phase == PHASE_READY:
        return Condition(COND_PROGRESSING, FALSE, R_STABLE, "every pod runs the current spec")
    if phase == PHASE_FAILED or checkpoint.phase == CK_FAILED:
        return Condition(COND_PROGRESSING, FALSE, R_FAILED, checkpoint.message)
    return Condition(COND_PROGRESSING, FALSE, R_REPLICAS_UNAVAILABLE, "some pods are not ready")


@dataclass(frozen=True)
class StatusUpdate:
    status: dict[str, Any]
    events: list[Event]


def invalid_status(error: Exception, *, previous: Mapping[str, Any] | None, generation: int, now: str) -> StatusUpdate:
    """Only Valid and the phase change: whatever already runs keeps running, its conditions stay true."""
    previous = previous or {}
    cond = Condition(COND_VALID, FALSE, R_INVALID_SPEC, str(error))
    status = {
        "observedGeneration": generation,
        "phase": PHASE_FAILED,
        "conditions": merge_conditions(previous.get("conditions"), [cond], generation=generation, now=now),
    }
    events = condition_events(previous.get("conditions"), [cond]) + phase_event(previous.get("phase"), PHASE_FAILED,
                                                                                 str(error))
    return StatusUpdate(status, events)


def build_status(spec: PolicyServerSpec, *, checkpoint: CheckpointState, workload: WorkloadState,
                 pods: Sequence[PodHealth], service_exists: bool, previous: Mapping[str, Any] | None,
                 generation: int, now: str, problem: Condition | None = None) -> StatusUpdate:
    """The full status of a valid PolicyServer, and the Events for what changed since ``previous``.

    ``problem`` is a Progressing=False condition from the apply step (a name
    conflict or an object the API server rejected); it wins over the phase's own.
    """
    previous = previous or {}
    ready_pods = sum(1 for p in pods if p.ready)
    ranks_ready = sum(p.ranks_ready for p in pods)
    ranks = f"{ranks_ready}/{workload.desired * spec.layout.world_size}"
    prev_conditions = previous.get("conditions") or []
    previously_available = any(c.get("type") == COND_AVAILABLE and c.get("status") == TRUE for c in prev_conditions)
    phase = decide_phase(checkpoint=checkpoint, workload=workload, ready_pods=ready_pods,
                         previous_phase=previous.get("phase"))
    conditions = [
        Condition(COND_VALID, TRUE, R_SPEC_VALID,
                  f"layout {spec.layout.label} (world size {spec.layout.world_size}), {spec.gpus_per_pod} GPU(s) per pod"),
        checkpoint_condition(checkpoint),
        available_condition(checkpoint=checkpoint, workload=workload, ready_pods=ready_pods, ranks=ranks,
                            previously_available=previously_available),
        problem or progressing_condition(phase, checkpoint=checkpoint, workload=workload),
    ]
    ck = spec.checkpoint
    checkpoint_status: dict[str, Any] = {
        "key": ck.key, "source": ck.source, "path": ck.path, "jobName": checkpoint.job_name,
        "phase": checkpoint.phase, "message": checkpoint.message,
    }
    if ck.revision is not None:
        checkpoint_status["revision"] = ck.revision
    if workload.serving_key:
        checkpoint_status["servingKey"] = workload.serving_key
    status: dict[str, Any] = {
        "observedGeneration": generation,
        "phase": phase,
        "replicas": workload.current if workload.exists else 0,
        "readyReplicas": ready_pods,
        "ready": f"{ready_pods}/{workload.desired}",
        "ranksReady": ranks,
        "layout": spec.layout.label,
        "selector": selector_string(spec.name),
        "checkpoint": checkpoint_status,
        "pods": [p.as_status() for p in pods],
        "conditions": merge_conditions(prev_conditions, conditions, generation=generation, now=now),
    }
    if service_exists:
        status["endpoint"] = endpoint(spec)
    if workload.template_hash:
        status["templateHash"] = workload.template_hash
    summary = conditions[2].message if phase not in (PHASE_PENDING, PHASE_DOWNLOADING, PHASE_FAILED) \
        else checkpoint.message
    events = condition_events(prev_conditions, conditions) + phase_event(previous.get("phase"), phase, summary)
    return StatusUpdate(status, events)
