"""Where the spec's checkpoint stands on the cache: the fetch Job's download state, read from the Job and its pods.

Pure functions of the objects as read from the API, so every state a Job can
be in is a unit test, not a cluster experiment: pending (with the reason a
fetch pod does not start, in the scheduler's or the kubelet's words),
downloading (with its progress line), ready, failed (with the fetch's own exit
code and error line).  A download counts only on the claim it landed on.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from kubernetes.client import (
    CoreV1Event,
    V1ContainerStatus,
    V1Job,
    V1JobCondition,
    V1JobStatus,
    V1PersistentVolumeClaim,
    V1Pod,
)

from policy_operator.exit_codes import FetchExit
from policy_operator.fetch_progress import FetchProgress, last_progress
from policy_operator.operator.conditions import Reason
from policy_operator.operator.kube_objects import meta_of
from policy_operator.operator.manifests import FETCH_CONTAINER, Names
from policy_operator.operator.pod_problems import (
    MAX_MESSAGE,
    claims_binding,
    container_message,
    container_statuses,
    event_time,
    failed_create,
    timestamp,
    unschedulable_message,
)
from policy_operator.operator.spec import PolicyServerSpec


class CheckpointPhase(str, Enum):
    """``status.checkpoint.phase``: where the spec's checkpoint stands on the cache volume."""

    PENDING = "Pending"
    DOWNLOADING = "Downloading"
    READY = "Ready"
    FAILED = "Failed"

    def __str__(self) -> str:
        return self.value


# policyserver fetch exit codes -> condition reasons
EXIT_REASONS: dict[int, Reason] = {
    FetchExit.USAGE: Reason.INVALID_SOURCE,
    FetchExit.SOURCE: Reason.SOURCE_UNREACHABLE,
    FetchExit.NOT_FOUND: Reason.SOURCE_NOT_FOUND,
    FetchExit.VERIFY: Reason.VERIFICATION_FAILED,
    FetchExit.DISK_FULL: Reason.DISK_FULL,
}


@dataclass(frozen=True)
class CheckpointState:
    phase: CheckpointPhase
    reason: Reason
    message: str
    job_name: str
    progress: FetchProgress | None = None  # while downloading, from the fetch pod's last progress line
    claim_uid: str | None = None  # Ready: the cache claim the checkpoint is on
    stale_job: bool = False  # the Job finished against a cache claim that is gone: delete it, then fetch again


def _conditions(job: V1Job) -> dict[str, V1JobCondition]:
    return {c.type: c for c in (job.status.conditions if job.status else None) or []}


def job_condition(job: V1Job, *kinds: str) -> bool:
    """One of the Job's conditions ``kinds`` is True (``Complete``, ``Failed``)."""
    return any(c.type in kinds and c.status == "True" for c in (job.status.conditions if job.status else None) or [])


def fetch_container_status(pod: V1Pod) -> V1ContainerStatus | None:
    """The fetch container's status in a fetch Job's pod; None before the kubelet reports one."""
    statuses = (pod.status.container_statuses if pod.status else None) or []
    return next((cs for cs in statuses if cs.name == FETCH_CONTAINER), None)


def _fetch_termination(pods: Sequence[V1Pod]) -> tuple[int | None, str]:
    """Exit code and last log line of the newest failed fetch container."""
    for pod in sorted(pods, key=_created_or_min, reverse=True):
        cs = fetch_container_status(pod)
        if cs is None:
            continue
        term = (cs.state.terminated if cs.state else None) or (cs.last_state.terminated if cs.last_state else None)
        if term and term.exit_code != 0:
            lines = [ln.strip() for ln in (term.message or "").splitlines() if ln.strip()]
            errors = [ln for ln in lines if "error" in ln.lower()]
            return term.exit_code, (errors or lines or [""])[-1][:MAX_MESSAGE]
    return None, ""


# the kubelet's reasons for a container it cannot start; ContainerCreating and PodInitializing only say "not yet"
KUBELET_START_ERRORS = frozenset(
    {
        "CreateContainerConfigError",
        "CreateContainerError",
        "ErrImagePull",
        "ImagePullBackOff",
        "InvalidImageName",
        "ErrImageNeverPull",
        "RunContainerError",
    }
)


def _fetch_started(pod: V1Pod) -> bool:
    """The fetch container runs or ran: from then on the attempt is a download, whatever it does."""
    cs = fetch_container_status(pod)
    if cs is None:
        return False
    state = cs.state
    return bool(
        (state is not None and (state.running is not None or state.terminated is not None))
        or (cs.last_state.terminated if cs.last_state else None)
    )


def _pod_created(pod: V1Pod) -> datetime.datetime | None:
    return timestamp(meta_of(pod).creation_timestamp)


def _created_or_min(pod: V1Pod) -> datetime.datetime:
    return _pod_created(pod) or datetime.datetime.min.replace(tzinfo=datetime.UTC)


def waiting_fetch_pod(job_pods: Sequence[V1Pod]) -> V1Pod | None:
    """The newest fetch pod when no attempt is downloading: one that exists and has not started its fetch."""
    live = [
        p
        for p in job_pods
        if not meta_of(p).deletion_timestamp and (p.status.phase if p.status else None) not in ("Succeeded", "Failed")
    ]
    if not live or any(_fetch_started(p) for p in live):
        return None
    return max(live, key=_created_or_min)


def start_problem(
    pod: V1Pod, events: Sequence[CoreV1Event] = (), claims: Sequence[V1PersistentVolumeClaim] = ()
) -> tuple[Reason, str] | None:
    """Why a pod that exists does not start, in the scheduler's or the kubelet's words; None: nothing says so yet.

    The scheduler says it in the pod's ``PodScheduled`` condition; the
    kubelet in a container's waiting reason (a missing Secret key, an image
    it cannot pull) or, for volumes (a missing Secret or claim), only in a
    Warning Event on the pod (``FailedMount``), which ``events`` holds.
    The scheduler's "unbound immediate PersistentVolumeClaims" while a
    provisioner makes the volumes of ``claims`` is a wait, not a problem
    (``pod_problems.claims_binding``): every new cache claim goes through it.
    """
    name = meta_of(pod).name or "?"
    binding = claims_binding(pod, claims)
    unschedulable = "" if binding else unschedulable_message(pod)
    if unschedulable:
        return Reason.UNSCHEDULABLE, f"pod {name} cannot be scheduled: {unschedulable}"
    for cs in container_statuses(pod):
        waiting = cs.state.waiting if cs.state else None
        if waiting is not None and (waiting.reason in KUBELET_START_ERRORS or waiting.message):
            return Reason.FETCH_POD_NOT_STARTING, f"pod {name} cannot start: {container_message(pod)}"
    uid = meta_of(pod).uid
    scheduled = any(
        c.type == "PodScheduled" and c.status == "True" for c in (pod.status.conditions if pod.status else None) or []
    )
    warnings = [
        (t, e)
        for e in events
        if e.type == "Warning"
        and uid
        and e.involved_object.uid == uid
        and (t := event_time(e)) is not None
        and not ((scheduled or binding) and e.reason == "FailedScheduling")
    ]  # the scheduler's, once it placed it or while the claims bind
    if warnings:
        _, newest = max(warnings, key=lambda te: te[0])
        return (
            Reason.FETCH_POD_NOT_STARTING,
            f"pod {name} cannot start: {newest.reason}: {newest.message}",
        )
    return None


def _not_scheduled(pod: V1Pod) -> str:
    """What a pod no scheduler has looked at says: nothing, so the operator names the scheduler it waits for."""
    conditions = (pod.status.conditions if pod.status else None) or []
    if (pod.spec.node_name if pod.spec else None) or any(c.type == "PodScheduled" for c in conditions):
        return ""
    scheduler = (pod.spec.scheduler_name if pod.spec else None) or "default-scheduler"
    return f"no scheduler has taken it (schedulerName {scheduler})"


def fetch_pod_waiting_state(
    spec: PolicyServerSpec,
    pod: V1Pod,
    job_name: str,
    events: Sequence[CoreV1Event],
    now: datetime.datetime | None,
    claims: Sequence[V1PersistentVolumeClaim] = (),
) -> CheckpointState:
    """A fetch pod that exists and does not run: say why as soon as the scheduler or the kubelet does; past
    ``progressDeadlineSeconds`` from its creation it is ProgressDeadlineExceeded (Stalled), as a rollout would be."""
    name = meta_of(pod).name or "?"
    problem = start_problem(pod, events, claims)
    binding = claims_binding(pod, claims)
    created = _pod_created(pod)
    deadline = spec.progress_deadline_seconds
    if now is not None and created is not None and (now - created).total_seconds() > deadline:
        detail = (
            problem[1]
            if problem
            else f"pod {name}: " + (binding or _not_scheduled(pod) or container_message(pod) or "not running")
        )
        return CheckpointState(
            CheckpointPhase.FAILED,
            Reason.PROGRESS_DEADLINE_EXCEEDED,
            f"the fetch pod of {job_name} did not start in {deadline}s (spec.progressDeadlineSeconds): {detail}"[
                :MAX_MESSAGE
            ],
            job_name,
        )
    if problem is not None:
        return CheckpointState(CheckpointPhase.PENDING, problem[0], problem[1][:MAX_MESSAGE], job_name)
    waiting = binding or _not_scheduled(pod) or container_message(pod)
    return CheckpointState(
        CheckpointPhase.PENDING,
        Reason.JOB_PENDING,
        f"waiting for the fetch pod {name} to start" + (f" ({waiting})" if waiting else ""),
        job_name,
    )


def ran_on_older_claim(job: V1Job, claim: V1PersistentVolumeClaim | None) -> bool:
    """The Job was made before the cache claim there is now: it wrote to a claim that was deleted since.

    The claim is always made before its first fetch Job (same pass, earlier
    write), so a Job older than the claim can only be one whose claim was
    deleted (and made again, empty) after it.
    """
    made = timestamp(meta_of(job).creation_timestamp)
    claim_made = timestamp(meta_of(claim).creation_timestamp)
    return made is not None and claim_made is not None and made < claim_made


def checkpoint_state(
    spec: PolicyServerSpec,
    job: V1Job | None,
    job_pods: Sequence[V1Pod],
    recorded: Mapping[str, Any] | None,
    fetch_progress: str | None = None,
    job_events: Sequence[CoreV1Event] = (),
    *,
    now: datetime.datetime | None = None,
    claim: V1PersistentVolumeClaim | None = None,
) -> CheckpointState:
    """Where the spec's checkpoint stands.

    ``recorded`` is the last ``status.checkpoint``: a download that finished
    stays Ready after its Job was garbage-collected (ttlSecondsAfterFinished),
    so the cache is not fetched again; pods still verify it before serving.
    ``fetch_progress`` is the running fetch container's newest progress line
    (its ``/progress`` endpoint): it becomes the state's progress.  ``job_events`` are the Events of the
    Job and of its waiting pod: a ``FailedCreate`` one while the Job has no
    pod says why (quota, PodSecurity, a missing PriorityClass), a Warning on
    the pod why it does not start (``FailedMount``).  The Job counts a pod
    that waits for a node or a volume as active, so a pod that never started
    its fetch is read for itself (``fetch_pod_waiting_state``), not taken for
    a download; ``now`` bounds that wait by ``progressDeadlineSeconds``.

    ``claim`` is the shared cache claim as it is now.  A download counts only
    on the claim it landed on: a Job that ran before the claim was made, or a
    record of another claim's uid, is a checkpoint the pods will not find
    (``verify-checkpoint``: "checkpoint not fetched"), so it is fetched again.
    """
    job_name = Names(spec.name).job(spec.checkpoint.key)
    if spec.storage.per_pod:  # no fetch Job: each pod's init container fetches into its own claim
        return CheckpointState(
            CheckpointPhase.READY,
            Reason.FETCHED_BY_PODS,
            f"each pod fetches {spec.checkpoint.source} into {spec.checkpoint.path} on its own claim before it serves",
            job_name,
        )
    if job is None:
        return without_job(spec, job_name, recorded or {}, claim)
    return finished_job_state(spec, job, job_pods, job_name, claim) or running_job_state(
        spec, job, job_pods, job_name, fetch_progress, job_events, now=now, claim=claim
    )


def finished_job_state(
    spec: PolicyServerSpec,
    job: V1Job,
    job_pods: Sequence[V1Pod],
    job_name: str,
    claim: V1PersistentVolumeClaim | None,
) -> CheckpointState | None:
    """A Job that is done: Ready (on the claim there is now), Failed (with what its exit code means), stale (it
    wrote to a claim that is gone), or None while it still runs."""
    if ran_on_older_claim(job, claim) and job_condition(job, "Complete"):
        return CheckpointState(
            CheckpointPhase.PENDING,
            Reason.JOB_PENDING,
            f"fetch Job {job_name} wrote to a cache claim that is gone ({meta_of(claim).name} was made "
            f"after it): deleting it to fetch again",
            job_name,
            stale_job=True,
        )
    if job_condition(job, "Complete") or ((job.status.succeeded if job.status else None) or 0) >= 1:
        return CheckpointState(
            CheckpointPhase.READY,
            Reason.DOWNLOADED,
            f"{spec.checkpoint.path} is complete",
            job_name,
            claim_uid=meta_of(claim).uid,
        )
    if not job_condition(job, "Failed"):
        return None
    cond = _conditions(job)["Failed"]
    exit_code, last_line = _fetch_termination(job_pods)
    # the Job's deadline, else what the fetch's exit code means (policy_operator/exit_codes.py)
    reason = (
        Reason.DEADLINE_EXCEEDED
        if cond.reason == "DeadlineExceeded"
        else EXIT_REASONS.get(exit_code or 0, Reason.FETCH_FAILED)
    )
    detail = last_line or cond.message or cond.reason or "the fetch Job failed"
    return CheckpointState(
        CheckpointPhase.FAILED, reason, f"fetch Job {job_name} failed: {detail}"[:MAX_MESSAGE], job_name
    )


def running_job_state(
    spec: PolicyServerSpec,
    job: V1Job,
    job_pods: Sequence[V1Pod],
    job_name: str,
    fetch_progress: str | None,
    job_events: Sequence[CoreV1Event],
    *,
    now: datetime.datetime | None,
    claim: V1PersistentVolumeClaim | None,
) -> CheckpointState:
    """A Job that still runs: its pod not started (and why), downloading (with its progress and the last
    failure), between attempts, or refused its pod (FailedCreate)."""
    status = job.status or V1JobStatus()
    failed = status.failed or 0
    _, last_line = _fetch_termination(job_pods)
    waiting_pod = waiting_fetch_pod(job_pods) if (status.active or 0) >= 1 else None
    if waiting_pod is not None:
        not_started = fetch_pod_waiting_state(
            spec, waiting_pod, job_name, job_events, now, [claim] if claim is not None else []
        )
        if not (
            failed and not_started.reason == Reason.JOB_PENDING
        ):  # a retry about to start: the last failure says more
            return not_started
    attempts = spec.checkpoint.fetch_job.backoff_limit + 1
    if (status.active or 0) >= 1:
        progress = last_progress(fetch_progress) if fetch_progress else None
        message = (
            f"downloading {spec.checkpoint.source}"
            + (f": {progress.text}" if progress else "")
            + f" (attempt {failed + 1}/{attempts})"
        )
        if failed and last_line:
            message += f"; last attempt: {last_line}"
        return CheckpointState(
            CheckpointPhase.DOWNLOADING, Reason.DOWNLOADING, message[:MAX_MESSAGE], job_name, progress
        )
    if failed:
        return CheckpointState(
            CheckpointPhase.DOWNLOADING,
            Reason.RETRYING,
            f"attempt {failed}/{attempts} failed: {last_line or 'see the Job'}"[:MAX_MESSAGE],
            job_name,
        )
    refused = failed_create(job, job_events, job_pods) if not job_pods else ""
    if refused:
        return CheckpointState(
            CheckpointPhase.PENDING,
            Reason.FAILED_CREATE,
            f"the Job controller cannot create the fetch pod of {job_name}: {refused}"[:MAX_MESSAGE],
            job_name,
        )
    return waiting_for_fetch_pod(job_name, next((m for m in (container_message(p) for p in job_pods) if m), ""))


def without_job(
    spec: PolicyServerSpec, job_name: str, recorded: Mapping[str, Any], claim: V1PersistentVolumeClaim | None
) -> CheckpointState:
    """No fetch Job: a download recorded Ready on this claim (its Job garbage-collected since), or one to start.

    A record of another claim's uid is a checkpoint the pods will not find: it is fetched again, and the
    message says why.
    """
    ck = spec.checkpoint
    claim_uid = meta_of(claim).uid
    recorded_claim = recorded.get("claimUid")
    if (
        recorded.get("key") == ck.key
        and recorded.get("phase") == CheckpointPhase.READY
        and (not recorded_claim or not claim_uid or recorded_claim == claim_uid)
    ):
        return CheckpointState(
            CheckpointPhase.READY,
            Reason.DOWNLOADED,
            f"{ck.path} is complete",
            job_name,
            claim_uid=recorded_claim or claim_uid,
        )
    again = recorded_claim and claim_uid and recorded_claim != claim_uid
    return CheckpointState(
        CheckpointPhase.PENDING,
        Reason.JOB_PENDING,
        f"creating fetch Job {job_name}"
        + (f": the checkpoint was on a cache claim that is gone; {meta_of(claim).name} is new" if again else ""),
        job_name,
    )


def waiting_for_fetch_pod(job_name: str, waiting: str = "") -> CheckpointState:
    """A fetch Job whose pod has not started (``waiting``: the kubelet's words, when it has any).

    It is also the state of a fetch Job the apply step has just created: the
    Job controller has not made its pod yet, so the pass says so without
    reading the Job again.
    """
    return CheckpointState(
        CheckpointPhase.PENDING,
        Reason.JOB_PENDING,
        f"waiting for the fetch pod of {job_name} to start" + (f" ({waiting})" if waiting else ""),
        job_name,
    )
