"""Why a pod does not run, in the words of whoever knows: the kubelet, the scheduler or a controller.

The kubelet says it in a container's waiting reason and in its termination
message (with ``FallbackToLogsOnError``, the end of the log of a container that
wrote no message: for the server, the failing rank's error, then torchrun's
report, which is cut off here); the scheduler in the pod's ``PodScheduled``
condition.  A pod the API server refuses to create (a ResourceQuota on
``nvidia.com/gpu``, PodSecurity admission, a PriorityClass that does not
exist) never shows up as a pod: the only trace is the controller's
``FailedCreate`` Event on the Job or StatefulSet, which ``failed_create``
reads, so that status says why there is no pod instead of waiting for one
forever.  A pod the scheduler turns away only because its new claims are not
bound yet (``claims_binding``) is waiting, not refused: a provisioner is making
the volumes and the scheduler retries once they bind.  A container the kubelet
keeps restarting (``crash_loop``) is said in its own last error line, not in
whatever it logged while shutting down.  Pure functions of the objects as read.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Sequence
from typing import Any

from kubernetes.client import CoreV1Event, V1ContainerStatus, V1PersistentVolumeClaim, V1Pod

from policy_operator.operator.kube_objects import HasMetadata, meta_of

TERMINATION_TAIL_LINES = 5  # lines of a failed container's termination message that status carries
MAX_TERMINATION_TAIL = 1000
MAX_MESSAGE = 600  # of a FailedCreate message, and of the checkpoint's messages in status
FAILED_CREATE = "FailedCreate"  # the Event reason of the Job and StatefulSet controllers when a pod is refused
# the PV controller's annotation on a claim it handed to a provisioner (set before that provisioner makes the volume)
ANN_STORAGE_PROVISIONER = "volume.kubernetes.io/storage-provisioner"
UNBOUND_CLAIMS = "unbound immediate PersistentVolumeClaims"  # the scheduler's words for a pod whose claims are unbound
# A loop is failures in a row: one crash (a killed rank, an OOM) is a restart a pod recovers from, and the kubelet
# itself forgets a container's failures once it has run 10 minutes (its crash-loop back-off resets).
CRASH_LOOP_RESTARTS = 2
BACKOFF_RESET_S = 600.0


def unschedulable_message(pod: V1Pod) -> str:
    """The scheduler's reason a pod has no node (e.g. "0/3 nodes are available: 3 Insufficient nvidia.com/gpu.")."""
    for cond in (pod.status.conditions if pod.status else None) or []:
        if cond.type == "PodScheduled" and cond.status == "False":
            return str(cond.message or cond.reason or "Unschedulable")
    return ""


def setting_up(pod: V1Pod) -> bool:
    """Scheduled to a node that has not started its containers yet (phase Pending): mounting its volumes,
    pulling its image or running its init containers.  A volume whose Secret is missing holds a pod here, with
    the kubelet's words only in an Event the operator does not read."""
    status = pod.status
    if meta_of(pod).deletion_timestamp or status is None or status.phase != "Pending":
        return False
    scheduled = next((c for c in status.conditions or [] if c.type == "PodScheduled"), None)
    return scheduled is not None and scheduled.status == "True"


def pod_claims(pod: V1Pod) -> list[str]:
    """The names of the claims the pod mounts."""
    volumes = (pod.spec.volumes if pod.spec else None) or []
    return [v.persistent_volume_claim.claim_name for v in volumes if v.persistent_volume_claim is not None]


def claims_binding(pod: V1Pod, claims: Sequence[V1PersistentVolumeClaim]) -> str:
    """ "waiting for claim C to be bound (provisioner P)" while the scheduler turns the pod away only for claims
    a provisioner is still making volumes for; "" when that is not the scheduler's complaint, or when a claim of
    the pod is Pending with no provisioner to make its volume (a missing StorageClass: really unschedulable).

    A new claim is unbound until its provisioner has made the volume, and the scheduler, which may look at the
    pod first, marks it Unschedulable ("pod has unbound immediate PersistentVolumeClaims") and retries once the
    claim binds: every new PolicyServer's first pod goes through it.  ``claims`` are the claims as read; one the
    pod names that was not read (just created) is taken as binding, a Bound one as the scheduler's next try.
    """
    if UNBOUND_CLAIMS not in unschedulable_message(pod):
        return ""
    by_name = {meta_of(c).name: c for c in claims}
    waiting: list[str] = []
    for name in pod_claims(pod):
        claim = by_name.get(name)
        if claim is not None and (claim.status.phase if claim.status else None) == "Bound":
            continue
        provisioner = (meta_of(claim).annotations or {}).get(ANN_STORAGE_PROVISIONER) if claim is not None else None
        if claim is not None and not provisioner:
            return ""
        waiting.append(f"claim {name}" + (f" (provisioner {provisioner})" if provisioner else ""))
    if not waiting:
        return "waiting for the scheduler to place it now that its claims are bound"
    return f"waiting for {', '.join(waiting)} to be bound"


def container_statuses(pod: V1Pod) -> list[V1ContainerStatus]:
    """The pod's init containers' statuses, then its containers' (the order the kubelet runs them)."""
    status = pod.status
    if status is None:
        return []
    return [*(status.init_container_statuses or []), *(status.container_statuses or [])]


# torchrun's own report of a failed run: its agent's log line, its traceback and the ChildFailedError summary
_TORCHRUN_REPORT = re.compile(r"torch/distributed/elastic/|ChildFailedError")
_ROOT_CAUSE = re.compile(r"^\s*(rank|exitcode)\s*:\s*(-?\d+)")
_ERRORISH = re.compile(r"error|exception|traceback|failed|fatal", re.IGNORECASE)


def failure_lines(message: str, lines: int = TERMINATION_TAIL_LINES) -> tuple[list[str], str, bool]:
    """(the rank's own last error lines, "rank R exit code C", whether any line reads as an error) from a log tail.

    torchrun ends a failed run with ~30 lines of its own (its agent's log
    line, its traceback, the ChildFailedError table); the last lines of the
    log are therefore never the rank's error.  The report is cut off (its
    root cause kept as "rank R exit code C"), and of what the ranks wrote the
    lines that read as errors win over the last ones.
    """
    text = [ln.rstrip() for ln in message.splitlines() if ln.strip()]
    cut = next((i for i, ln in enumerate(text) if _TORCHRUN_REPORT.search(ln)), len(text))
    if cut < len(text) and cut > 0 and text[cut - 1].startswith("Traceback"):
        cut -= 1
    found: dict[str, str] = {m.group(1): m.group(2) for ln in text[cut:] if (m := _ROOT_CAUSE.match(ln))}
    root = f"rank {found['rank']} exit code {found['exitcode']}" if {"rank", "exitcode"} <= found.keys() else ""
    body = text[:cut]
    errors = [ln for ln in body if _ERRORISH.search(ln)]
    return (errors or body)[-lines:], root, bool(errors)


def _failure_text(head: str, message: str, lines: int) -> tuple[str, bool]:
    found, root, explained = failure_lines(message, lines)
    head += f", {root}" if root and ", rank " not in head else ""
    tail = "\n".join(found)
    return (f"{head}: {tail}" if tail else head)[:MAX_TERMINATION_TAIL], explained


def termination(pod: V1Pod, lines: int = TERMINATION_TAIL_LINES) -> str:
    """What the newest non-zero termination of any container of the pod says, in a few lines.

    With ``terminationMessagePolicy: FallbackToLogsOnError`` the kubelet puts
    the end of the log there (at most 80 lines, 2 KiB) when the container
    wrote no message: for the server, the failing rank's error, then whatever
    it logged while shutting down, then torchrun's report.  The operator reads
    no pod's log (it holds no ``pods/log`` grant), so this message is all it
    reports; ``kubectl logs --previous`` has the rest.
    """
    for cs in container_statuses(pod):
        for term in (cs.state.terminated if cs.state else None, (cs.last_state.terminated if cs.last_state else None)):
            if term and term.exit_code != 0:
                head = f"{cs.name} exited {term.exit_code} ({term.reason or 'Error'})"
                return _failure_text(head, term.message or "", lines)[0]
    return ""


def termination_tail(pod: V1Pod, lines: int = TERMINATION_TAIL_LINES) -> str:
    return termination(pod, lines)


def crash_loop(pod: V1Pod, lines: int = 1) -> str:
    """What killed a container the kubelet keeps restarting: "server exited 1 (Error), 3 restarts: <error>", or "".

    A container crash-loops while its last run ended in failure, it has not
    been ready since (waiting out the kubelet's back-off, CrashLoopBackOff, or
    running again and not ready yet), it was restarted at least
    ``CRASH_LOOP_RESTARTS`` times, and its last run was shorter than the
    kubelet's back-off reset (``BACKOFF_RESET_S``).  Its own error lines win
    over the last ones (``failure_lines``): a server that dies at warm-up logs
    its shutdown (websockets' "server closed") after the error.
    """
    for cs in container_statuses(pod):
        last = cs.last_state.terminated if cs.last_state else None
        if last is None or last.exit_code == 0 or cs.ready or (cs.state is not None and cs.state.terminated):
            continue
        restarts = cs.restart_count or 0
        if restarts < CRASH_LOOP_RESTARTS or _ran_for(last.started_at, last.finished_at) >= BACKOFF_RESET_S:
            continue
        head = f"{cs.name} exited {last.exit_code} ({last.reason or 'Error'}), {restarts} restarts"
        return _failure_text(head, last.message or "", lines)[0]
    return ""


def _ran_for(started: Any, finished: Any) -> float:
    """Seconds between two Kubernetes timestamps; 0 when either is unknown (a run of unknown length counts short)."""
    start, end = timestamp(started), timestamp(finished)
    return (end - start).total_seconds() if start is not None and end is not None else 0.0


def container_message(pod: V1Pod) -> str:
    """Why a pod is not running, in the kubelet's words (init container first: it verifies the checkpoint)."""
    for cs in container_statuses(pod):
        last = cs.last_state.terminated if cs.last_state else None
        waiting = cs.state.waiting if cs.state else None
        if waiting is not None:
            detail = failure_lines((last.message if last else None) or waiting.message or "", 1)[0]
            reason = waiting.reason or "Waiting"
            return f"{cs.name}: {reason}" + (f": {detail[-1]}" if detail else "")
        terminated = cs.state.terminated if cs.state else None
        if terminated and terminated.exit_code != 0:
            detail = failure_lines(terminated.message or "", 1)[0]
            return f"{cs.name}: exited {terminated.exit_code} ({terminated.reason or 'Error'})" + (
                f": {detail[-1]}" if detail else ""
            )
    unschedulable = unschedulable_message(pod)
    return f"unschedulable: {unschedulable}" if unschedulable else ""


def timestamp(value: Any) -> datetime.datetime | None:
    """A Kubernetes timestamp (RFC 3339 text, or a datetime) as an aware datetime; None when absent or unreadable."""
    if not value:
        return None
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    try:
        return datetime.datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def event_time(event: CoreV1Event) -> datetime.datetime | None:
    """When an Event last happened: a series' last observation, else lastTimestamp, eventTime, creation."""
    return (
        timestamp(event.series.last_observed_time if event.series else None)
        or timestamp(event.last_timestamp)
        or timestamp(event.event_time)
        or timestamp(meta_of(event).creation_timestamp)
    )


def failed_create(owner: HasMetadata | None, events: Sequence[CoreV1Event], pods: Sequence[V1Pod]) -> str:
    """The message of the newest ``FailedCreate`` Event of ``owner`` (a Job or StatefulSet) still in force, or "".

    An Event outlives its cause (the apiserver keeps Events for an hour): one
    counts only when it is about this very object (its uid) and no pod of the
    owner was created after it -- a later creation means the refusal was lifted.
    """
    if owner is None:
        return ""
    uid = meta_of(owner).uid
    mine = [e for e in events if e.reason == FAILED_CREATE and (not uid or e.involved_object.uid in (None, uid))]
    dated = [(t, e) for e in mine if (t := event_time(e)) is not None]
    if not dated:
        return ""
    when, newest = max(dated, key=lambda te: te[0])
    created = [t for p in pods if (t := timestamp(meta_of(p).creation_timestamp)) is not None]
    if created and max(created) > when:
        return ""
    return str(newest.message or FAILED_CREATE)[:MAX_MESSAGE]
