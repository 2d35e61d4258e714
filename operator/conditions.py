"""The vocabulary of a PolicyServer's status: conditions, their reasons, and the Events their changes deserve.

``lastTransitionTime`` only moves when a condition's status flips (Kubernetes
API conventions); an Event is posted for every change of a condition's status
or reason and of the phase.  What the conditions *say* is decided in
``status.py``; this module only knows how conditions merge and which changes
are worth a Warning.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from policy_operator.constants import (
    COND_AVAILABLE,
    COND_CHECKPOINT_READY,
    COND_PROGRESSING,
    COND_READY,
    COND_RECONCILING,
    COND_STALLED,
    COND_VALID,
    PHASE_DEGRADED,
    PHASE_FAILED,
)

TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"
CONDITION_TYPES = (
    COND_READY,
    COND_RECONCILING,
    COND_STALLED,
    COND_VALID,
    COND_CHECKPOINT_READY,
    COND_AVAILABLE,
    COND_PROGRESSING,
)
# metav1.Condition's limits, which the CRD's status schema states (operator/resource.py)
MAX_CONDITION_MESSAGE = 32768
MAX_REASON = 1024
REASON_PATTERN = r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$"


class Reason(str, Enum):
    """Every condition reason the operator writes (CamelCase, as Kubernetes conventions ask)."""

    SPEC_VALID = "SpecValid"
    INVALID_SPEC = "InvalidSpec"
    # Available
    REPLICAS_READY = "ReplicasReady"
    PARTIALLY_READY = "PartiallyReady"
    NO_REPLICAS_READY = "NoReplicasReady"
    REPLICAS_UNAVAILABLE = "ReplicasUnavailable"
    RANKS_UNKNOWN = "RanksUnknown"  # /readyz unreachable from the operator: readiness is the kubelet's
    UNSCHEDULABLE = "Unschedulable"  # a pod's PodScheduled=False Unschedulable
    FAILED_CREATE = "FailedCreate"  # the StatefulSet or Job controller could not create a pod (quota, PodSecurity...)
    SCALED_TO_ZERO = "ScaledToZero"
    CHECKPOINT_NOT_READY = "CheckpointNotReady"
    # Progressing
    DOWNLOADING = "Downloading"
    ROLLING_OUT = "RollingOut"
    CRASH_LOOP_BACK_OFF = (
        "CrashLoopBackOff"  # a pod of the current spec is restarted after failing (the kubelet's word)
    )
    STABLE = "Stable"
    FAILED = "Failed"
    PROGRESS_DEADLINE_EXCEEDED = "ProgressDeadlineExceeded"
    # StorageReady (the cache claims against spec.storage)
    STORAGE_AS_SPECIFIED = "AsSpecified"
    EXPANDING = "Expanding"
    EXPANSION_NOT_ALLOWED = "ExpansionNotAllowed"
    IMMUTABLE_CHANGE = "ImmutableChange"
    CACHE_NOT_SHARED = "CacheNotShared"
    FETCHED_BY_PODS = "FetchedByPods"  # CheckpointReady with storage.mode perPod: each pod's init container fetches
    NAME_CONFLICT = "NameConflict"
    APPLY_FAILED = "ApplyFailed"
    CLAIM_NOT_FOUND = "ClaimNotFound"
    CLAIM_TERMINATING = "ClaimTerminating"  # StorageReady: the cache claim is being deleted
    # CheckpointReady: the fetch Job's progress and, from its exit code, why it failed
    JOB_PENDING = "JobPending"
    FETCH_POD_NOT_STARTING = "FetchPodNotStarting"  # the kubelet cannot start it: a Secret, a claim, an image
    RETRYING = "Retrying"
    DOWNLOADED = "Downloaded"
    INVALID_SOURCE = "InvalidSource"
    SOURCE_UNREACHABLE = "SourceUnreachable"
    SOURCE_NOT_FOUND = "SourceNotFound"  # the hub has no such repository or revision (fetch exit 6): no retry
    VERIFICATION_FAILED = "VerificationFailed"
    DISK_FULL = "DiskFull"
    FETCH_FAILED = "FetchFailed"
    DEADLINE_EXCEEDED = "DeadlineExceeded"

    def __str__(self) -> str:
        return self.value


FETCH_FAILURE_REASONS = frozenset(
    {
        Reason.INVALID_SOURCE,
        Reason.SOURCE_UNREACHABLE,
        Reason.SOURCE_NOT_FOUND,
        Reason.VERIFICATION_FAILED,
        Reason.DISK_FULL,
        Reason.FETCH_FAILED,
        Reason.DEADLINE_EXCEEDED,
    }
)
# Those become Warning Events.
WARNING_REASONS = frozenset(
    {
        Reason.INVALID_SPEC,
        Reason.REPLICAS_UNAVAILABLE,
        Reason.NAME_CONFLICT,
        Reason.APPLY_FAILED,
        Reason.FAILED,
        Reason.CLAIM_NOT_FOUND,
        Reason.UNSCHEDULABLE,
        Reason.FAILED_CREATE,
        Reason.CRASH_LOOP_BACK_OFF,
        Reason.FETCH_POD_NOT_STARTING,
        Reason.PROGRESS_DEADLINE_EXCEEDED,
        *FETCH_FAILURE_REASONS,
        Reason.EXPANSION_NOT_ALLOWED,
        Reason.IMMUTABLE_CHANGE,
        Reason.CACHE_NOT_SHARED,
        Reason.CLAIM_TERMINATING,
    }
)
# Progressing=False reasons that mean "stuck", not "done"
STUCK_REASONS = frozenset(
    {
        Reason.FAILED,
        Reason.NAME_CONFLICT,
        Reason.APPLY_FAILED,
        Reason.CLAIM_NOT_FOUND,
        Reason.PROGRESS_DEADLINE_EXCEEDED,
        Reason.REPLICAS_UNAVAILABLE,
    }
)
# ... of which those that no retry fixes without a change to the spec or the cluster (Stalled=True)
STALLED_REASONS = frozenset(
    {
        Reason.INVALID_SPEC,
        Reason.FAILED,
        Reason.NAME_CONFLICT,
        Reason.APPLY_FAILED,
        Reason.CLAIM_NOT_FOUND,
        Reason.PROGRESS_DEADLINE_EXCEEDED,
    }
)


@dataclass(frozen=True)
class Condition:
    type: str
    status: str
    reason: Reason
    message: str = ""


@dataclass(frozen=True)
class Event:
    type: str  # Normal | Warning
    reason: str
    message: str


def merge_conditions(
    previous: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition], *, generation: int, now: str
) -> list[dict[str, Any]]:
    """The new conditions in API form; a type not in ``new`` is kept as it was."""
    old = {c.get("type"): c for c in previous or []}
    merged = []
    for cond in new:
        prev = old.get(cond.type) or {}
        since = prev.get("lastTransitionTime") if prev.get("status") == cond.status else None
        merged.append(
            {
                "type": cond.type,
                "status": cond.status,
                "reason": str(cond.reason),
                "message": cond.message[:MAX_CONDITION_MESSAGE],
                "lastTransitionTime": since or now,
                "observedGeneration": generation,
            }
        )
    types = {c.type for c in new}
    merged += [dict(c) for t, c in old.items() if t not in types]
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    return sorted(merged, key=lambda c: order.get(c["type"], len(order)))


# The reasons a fetch pod that does not run gives CheckpointReady, and Progressing with it
FETCH_BLOCKED_REASONS = frozenset({Reason.FAILED_CREATE, Reason.UNSCHEDULABLE, Reason.FETCH_POD_NOT_STARTING})


def condition_events(previous: Sequence[Mapping[str, Any]] | None, new: Sequence[Condition]) -> list[Event]:
    """One Event per condition whose status or reason changed; one per reason when several conditions change to
    the same one in a pass (a pod that cannot be placed turns Available and Progressing to Unschedulable)."""
    old = {c.get("type"): c for c in previous or []}
    events: list[Event] = []
    for cond in new:
        prev = old.get(cond.type) or {}
        if (prev.get("status"), prev.get("reason")) != (cond.status, cond.reason):
            kind = "Warning" if cond.reason in WARNING_REASONS else "Normal"
            if any(e.reason == str(cond.reason) and e.type == kind for e in events):
                continue
            events.append(Event(kind, str(cond.reason), f"{cond.type}={cond.status}: {cond.message}"[:1000]))
    return events


def phase_event(previous: str | None, phase: str, message: str) -> list[Event]:
    if previous == phase:
        return []
    kind = "Warning" if phase in (PHASE_FAILED, PHASE_DEGRADED) else "Normal"
    return [Event(kind, phase, f"phase {previous or '(none)'} -> {phase}: {message}"[:1000])]
