"""What the children's status says: the fetch Job's download state and the StatefulSet's rollout.

Pure functions of the objects as read from the API, so every state a Job or
StatefulSet can be in is a unit test, not a cluster experiment.

A pod the API server refuses to create (a ResourceQuota on ``nvidia.com/gpu``,
PodSecurity admission, a PriorityClass that does not exist) never shows up as a
pod: the only trace is the controller's ``FailedCreate`` Event on the Job or
StatefulSet.  ``failed_create`` reads those Events, so that status says why
there is no pod instead of waiting for one forever.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from policy_operator.constants import ANNOTATION_TEMPLATE_HASH, LABEL_CHECKPOINT_KEY
from policy_operator.exit_codes import FetchExit
from policy_operator.operator.conditions import Reason
from policy_operator.operator.manifests import FETCH_CONTAINER, Names
from policy_operator.operator.rank_probe import container_message
from policy_operator.operator.spec import PolicyServerSpec
from policy_operator.progress_line import FetchProgress, last_progress


class CheckpointPhase(str, Enum):
    """``status.checkpoint.phase``: where the spec's checkpoint stands on the cache volume."""

    PENDING = "Pending"
    DOWNLOADING = "Downloading"
    READY = "Ready"
    FAILED = "Failed"

    def __str__(self) -> str:
        return self.value


# policyserver fetch exit codes -> condition reasons
EXIT_REASONS: dict[int, Reason] = {FetchExit.USAGE: Reason.INVALID_SOURCE, FetchExit.SOURCE: Reason.SOURCE_UNREACHABLE,
                FetchExit.VERIFY: Reason.VERIFICATION_FAILED, FetchExit.DISK_FULL: Reason.DISK_FULL}
MAX_MESSAGE = 600
FAILED_CREATE = "FailedCreate"  # the Event reason of the Job and StatefulSet controllers when a pod is refused


@dataclass(frozen=True)
class CheckpointState:
    phase: CheckpointPhase
    reason: Reason
    message: str
    job_name: str
    progress: FetchProgress | None = None  # while downloading, from the fetch pod's last progress line


def _conditions(obj: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    return {c.get("type", ""): c for c in ((obj or {}).get("status") or {}).get("conditions") or []}


def _is_true(conds: Mapping[str, Mapping[str, Any]], kind: str) -> bool:
    return conds.get(kind, {}).get("status") == "True"


def _fetch_termination(pods: Sequence[Mapping[str, Any]]) -> tuple[int | None, str]:
    """Exit code and last log line of the newest failed fetch container."""
    def created(p: Mapping[str, Any]) -> str:
        return (p.get("metadata") or {}).get("creationTimestamp") or ""

    for pod in sorted(pods, key=created, reverse=True):
        for cs in (pod.get("status") or {}).get("containerStatuses") or []:
            if cs.get("name") != FETCH_CONTAINER:
                continue
            term = (cs.get("state") or {}).get("terminated") or (cs.get("lastState") or {}).get("terminated")
            if term and term.get("exitCode", 0) != 0:
                lines = [ln.strip() for ln in (term.get("message") or "").splitlines() if ln.strip()]
                errors = [ln for ln in lines if "error" in ln.lower()]
                return int(term["exitCode"]), (errors or lines or [""])[-1][:MAX_MESSAGE]
    return None, ""


def _time(value: Any) -> datetime.datetime | None:
    if not value:
        return None
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def event_time(event: Mapping[str, Any]) -> datetime.datetime | None:
    """When an Event last happened: a series' last observation, else lastTimestamp, eventTime, creation."""
    return (_time((event.get("series") or {}).get("lastObservedTime")) or _time(event.get("lastTimestamp"))
            or _time(event.get("eventTime")) or _time((event.get("metadata") or {}).get("creationTimestamp")))


def failed_create(owner: Mapping[str, Any] | None, events: Sequence[Mapping[str, Any]],
                  pods: Sequence[Mapping[str, Any]]) -> str:
    """The message of the newest ``FailedCreate`` Event of ``owner`` (a Job or StatefulSet) still in force, or "".

    An Event outlives its cause (the apiserver keeps Events for an hour): one
    counts only when it is about this very object (its uid) and no pod of the
    owner was created after it -- a later creation means the refusal was lifted.
    """
    if owner is None:
        return ""
    uid = (owner.get("metadata") or {}).get("uid")
    mine = [e for e in events if e.get("reason") == FAILED_CREATE
            and (not uid or (e.get("involvedObject") or {}).get("uid") in (None, uid))]
    dated = [(t, e) for e in mine if (t := event_time(e)) is not None]
    if not dated:
        return ""
    when, newest = max(dated, key=lambda te: te[0])
    created = [t for p in pods if (t := _time((p.get("metadata") or {}).get("creationTimestamp"))) is not None]
    if created and max(created) > when:
        return ""
    return str(newest.get("message") or FAILED_CREATE)[:MAX_MESSAGE]


def checkpoint_state(spec: PolicyServerSpec, job: Mapping[str, Any] | None, job_pods: Sequence[Mapping[str, Any]],
                     recorded: Mapping[str, Any] | None, fetch_log: str | None = None,
                     job_events: Sequence[Mapping[str, Any]] = ()) -> CheckpointState:
    """Where the spec's checkpoint stands.

    ``recorded`` is the last ``status.checkpoint``: a download that finished
    stays Ready after its Job was garbage-collected (ttlSecondsAfterFinished),
    so the cache is not fetched again; pods still verify it before serving.
    ``fetch_log`` is the end of the running fetch pod's log: its last progress
    line becomes the state's progress.  ``job_events`` are the Job's Events:
    a ``FailedCreate`` one while the Job has no pod says why (quota,
    PodSecurity, a missing PriorityClass).
    """
    ck = spec.checkpoint
    job_name = Names(spec.name).job(ck.key)
    recorded = recorded or {}
    if spec.storage.per_pod:  # no fetch Job: each pod's init container fetches into its own claim
        return CheckpointState(CheckpointPhase.READY, Reason.FETCHED_BY_PODS,
                               f"each pod fetches {ck.source} into {ck.path} on its own claim before it serves",
                               job_name)
    if job is None:
        if recorded.get("key") == ck.key and recorded.get("phase") == CheckpointPhase.READY:
            return CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, f"{ck.path} is complete", job_name)
        return CheckpointState(CheckpointPhase.PENDING, Reason.JOB_PENDING, f"creating fetch Job {job_name}", job_name)
    conds = _conditions(job)
    status = job.get("status") or {}
    if _is_true(conds, "Complete") or (status.get("succeeded") or 0) >= 1:
        return CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, f"{ck.path} is complete", job_name)
    failed = status.get("failed") or 0
    exit_code, last_line = _fetch_termination(job_pods)
    if _is_true(conds, "Failed"):
        cond = conds["Failed"]
        if cond.get("reason") == "DeadlineExceeded":
            reason = Reason.DEADLINE_EXCEEDED
        else:
            reason = EXIT_REASONS.get(exit_code or 0, Reason.FETCH_FAILED)
        detail = last_line or cond.get("message") or cond.get("reason") or "the fetch Job failed"
        return CheckpointState(CheckpointPhase.FAILED, reason, f"fetch Job {job_name} failed: {detail}"[:MAX_MESSAGE], job_name)
    attempts = ck.fetch_job.backoff_limit + 1
    if (status.get("active") or 0) >= 1:
        progress = last_progress(fetch_log) if fetch_log else None
        message = f"downloading {ck.source}" + (f": {progress.text}" if progress else "") + \
            f" (attempt {failed + 1}/{attempts})"
        if failed and last_line:
            message += f"; last attempt: {last_line}"
        return CheckpointState(CheckpointPhase.DOWNLOADING, Reason.DOWNLOADING, message[:MAX_MESSAGE], job_name,
                               progress)
    if failed:
        return CheckpointState(CheckpointPhase.DOWNLOADING, Reason.RETRYING,
                               f"attempt {failed}/{attempts} failed: {last_line or 'see the Job'}"[:MAX_MESSAGE], job_name)
    refused = failed_create(job, job_events, job_pods) if not job_pods else ""
    if refused:
        return CheckpointState(CheckpointPhase.PENDING, Reason.FAILED_CREATE,
                               f"the Job controller cannot create the fetch pod of {job_name}: {refused}"[:MAX_MESSAGE],
                               job_name)
    waiting = next((m for m in (container_message(p) for p in job_pods) if m), "")
    return CheckpointState(CheckpointPhase.PENDING, Reason.JOB_PENDING,
                           f"waiting for the fetch pod of {job_name} to start" + (f" ({waiting})" if waiting else ""),
                           job_name)


@dataclass(frozen=True)
class WorkloadState:
    exists: bool
    desired: int
    current: int = 0
    rolling: bool = False
    serving_key: str | None = None
    template_hash: str | None = None
    update_revision: str | None = None  # the ControllerRevision of the StatefulSet's current template
    updated: int = 0  # pods the StatefulSet controller counts as running the current template
    failed_create: str = ""  # the controller's FailedCreate message while pods are missing


def workload_state(sts: Mapping[str, Any] | None, desired: int, events: Sequence[Mapping[str, Any]] = (),
                   pods: Sequence[Mapping[str, Any]] = ()) -> WorkloadState:
    """Whether the StatefulSet is still converging on its own spec (rolling out or scaling).

    "Rolled" means the controller has seen the latest spec (observedGeneration),
    counts every replica as updated, and the current revision *is* the update
    revision: ready pods before that may be old pods, and Ready must not be
    claimed on their behalf.  ``events`` and ``pods`` (the StatefulSet's) say
    whether a missing pod is one the API server refused to create.
    """
    if sts is None:
        return WorkloadState(exists=False, desired=desired, rolling=desired > 0)
    meta, spec, status = sts.get("metadata") or {}, sts.get("spec") or {}, sts.get("status") or {}
    replicas = spec.get("replicas", 1)
    current = status.get("replicas") or 0
    rolling = (
        (status.get("observedGeneration") or 0) < (meta.get("generation") or 1)
        or current != replicas
        or (status.get("updatedReplicas") or 0) < replicas
        or (bool(status.get("updateRevision")) and status.get("currentRevision") != status.get("updateRevision"))
        or replicas != desired
    )
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    refused = failed_create(sts, events, pods) if len(live) < replicas else ""
    return WorkloadState(exists=True, desired=desired, current=current, rolling=rolling,
                         serving_key=(meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY),
                         template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
                         update_revision=status.get("updateRevision") or None,
                         updated=status.get("updatedReplicas") or 0, failed_create=refused)
