"""The StatefulSet and Job controllers, only as far as the local node needs them.

Pure functions of an object and its pods that say what to create, what to
delete and which status to write; ``local_node.LocalNode`` applies them.

StatefulSet: pods ``NAME-0..N-1`` from the template, labelled with the
template's revision (``controller-revision-hash``, a digest of the template);
scale up and down; ``podManagementPolicy`` Parallel (all at once) or
OrderedReady (one at a time, in order); ``RollingUpdate`` replaces outdated
pods from the highest ordinal down, one at a time, once every other pod is
Ready (``partition`` honoured; ``OnDelete`` replaces nothing); pods that
ended (Failed/Succeeded) are deleted and recreated.  Status: replicas,
readyReplicas, availableReplicas, currentReplicas, updatedReplicas,
currentRevision/updateRevision, observedGeneration.

Job (NonIndexed, one completion): one pod at a time from the template; a
failed pod is matched against ``podFailurePolicy`` (onExitCodes, FailJob /
Ignore / Count) and otherwise counts against ``backoffLimit`` (default 6),
with the node's exponential backoff before the next pod;
``activeDeadlineSeconds`` and ``ttlSecondsAfterFinished``.  Status: active,
ready, succeeded, failed, startTime, completionTime and the conditions a
1.31+ Job controller writes (SuccessCriteriaMet + Complete, FailureTarget +
Failed).  Not done: parallelism/completions > 1, Indexed jobs, suspend,
podReplacementPolicy, onPodConditions rules (the node sets no pod conditions
that they match).
"""

from __future__ import annotations

import copy
import datetime
import hashlib
import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from policy_operator.constants import (
    LABEL_CONTROLLER_REVISION_HASH,
    LABEL_JOB_CONTROLLER_UID,
    LABEL_JOB_NAME,
    LABEL_LEGACY_CONTROLLER_UID,
    LABEL_LEGACY_JOB_NAME,
    LABEL_POD_INDEX,
    LABEL_STATEFULSET_POD_NAME,
)

DEFAULT_BACKOFF_LIMIT = 6
TERMINAL_PHASES = ("Succeeded", "Failed")


def rfc3339(t: float) -> str:
    return datetime.datetime.fromtimestamp(t, datetime.timezone.utc).replace(microsecond=0).isoformat().replace(
        "+00:00", "Z")


def parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()


def _meta(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("metadata") or {}


def is_terminating(pod: Mapping[str, Any]) -> bool:
    return bool(_meta(pod).get("deletionTimestamp"))


def is_ready(pod: Mapping[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in (pod.get("status") or {}).get("conditions") or [])


def owned_by(pod: Mapping[str, Any], owner: Mapping[str, Any]) -> bool:
    uid = _meta(owner).get("uid")
    return any(r.get("uid") == uid and r.get("controller") for r in _meta(pod).get("ownerReferences") or [])


def _owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    meta = _meta(owner)
    return {"apiVersion": owner["apiVersion"], "kind": owner["kind"], "name": meta["name"], "uid": meta["uid"],
            "controller": True, "blockOwnerDeletion": True}


def _condition(kind: str, reason: str, message: str, now: float) -> dict[str, Any]:
    t = rfc3339(now)
    return {"type": kind, "status": "True", "reason": reason, "message": message, "lastProbeTime": t,
            "lastTransitionTime": t}


@dataclass
class Plan:
    """What a controller pass wants: pods to create (bodies), pods to delete (names), the status to write."""

    create: list[dict[str, Any]] = field(default_factory=list)
    delete: list[str] = field(default_factory=list)
    status: dict[str, Any] | None = None  # None: leave the status alone
    delete_owner: bool = False  # the Job's TTL has passed
    wake_at: float | None = None  # when a pass should run again even if nothing changes (backoff)


# --- StatefulSet ---------------------------------------------------------------------------

def revision(sts: Mapping[str, Any]) -> str:
    """``NAME-<digest of the pod template>``: what a ControllerRevision's name carries."""
    template = (sts.get("spec") or {}).get("template") or {}
    digest = hashlib.sha256(json.dumps(template, sort_keys=True, separators=(",", ":")).encode()).hexdigest()
    return f"{_meta(sts)['name']}-{digest[:10]}"


def ordinal(sts: Mapping[str, Any], pod: Mapping[str, Any]) -> int | None:
    prefix = f"{_meta(sts)['name']}-"
    name = _meta(pod).get("name", "")
    tail = name[len(prefix):] if name.startswith(prefix) else ""
    return int(tail) if tail.isdigit() else None


def statefulset_pod(sts: Mapping[str, Any], index: int) -> dict[str, Any]:
    spec, meta = sts.get("spec") or {}, _meta(sts)
    template = copy.deepcopy(spec.get("template") or {})
    name = f"{meta['name']}-{index}"
    tmeta = template.get("metadata") or {}
    labels = {**(tmeta.get("labels") or {}), LABEL_CONTROLLER_REVISION_HASH: revision(sts),
              LABEL_STATEFULSET_POD_NAME: name, LABEL_POD_INDEX: str(index)}
    pod_spec = template.get("spec") or {}
    pod_spec.setdefault("hostname", name)
    if spec.get("serviceName"):
        pod_spec.setdefault("subdomain", spec["serviceName"])
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"name": name, "labels": labels, "ownerReferences": [_owner_reference(sts)]},
                            "spec": pod_spec}
    if tmeta.get("annotations"):
        body["metadata"]["annotations"] = dict(tmeta["annotations"])
    return body


def plan_statefulset(sts: Mapping[str, Any], pods: Sequence[Mapping[str, Any]]) -> Plan:
    spec, meta = sts.get("spec") or {}, _meta(sts)
    replicas = int(spec.get("replicas", 1))
    rev = revision(sts)
    parallel = spec.get("podManagementPolicy") == "Parallel"
    strategy = spec.get("updateStrategy") or {}
    partition = int(((strategy.get("rollingUpdate") or {}).get("partition")) or 0)
    mine = {o: p for p in pods if owned_by(p, sts) and (o := ordinal(sts, p)) is not None}
    plan = Plan()

    # pods that ended are replaced (restartPolicy Always never ends; a Never/OnFailure template can)
    for o, p in sorted(mine.items()):
        if not is_terminating(p) and (p.get("status") or {}).get("phase") in TERMINAL_PHASES:
            plan.delete.append(_meta(p)["name"])
    ended = set(plan.delete)

    # scale up: missing ordinals (OrderedReady: the first missing one, once all before it are Ready)
    for o in range(replicas):
        if o in mine:
            continue
        if parallel or all(i in mine and is_ready(mine[i]) and not is_terminating(mine[i]) for i in range(o)):
            plan.create.append(statefulset_pod(sts, o))
        if not parallel:
            break

    # scale down: ordinals >= replicas (OrderedReady: the highest first, one at a time)
    extra = sorted((o for o, p in mine.items() if o >= replicas and not is_terminating(p)), reverse=True)
    if extra:
        chosen = extra if parallel else ([extra[0]] if not any(is_terminating(p) for p in mine.values()) else [])
        plan.delete += [_meta(mine[o])["name"] for o in chosen]

    # rolling update: highest outdated ordinal, once every other pod exists and is Ready
    if strategy.get("type", "RollingUpdate") == "RollingUpdate" and not extra:
        outdated = sorted((o for o, p in mine.items() if partition <= o < replicas and not is_terminating(p)
                           and (_meta(p).get("labels") or {}).get(LABEL_CONTROLLER_REVISION_HASH) != rev),
                          reverse=True)
        if outdated:
            target = outdated[0]
            others = [o for o in range(replicas) if o != target]
            settled = all(o in mine and is_ready(mine[o]) and not is_terminating(mine[o]) for o in others)
            if settled and not any(is_terminating(p) for p in mine.values()):
                name = _meta(mine[target])["name"]
                if name not in ended:
                    plan.delete.append(name)

    live = [p for p in mine.values() if not is_terminating(p)]
    rev_of = {_meta(p)["name"]: (_meta(p).get("labels") or {}).get(LABEL_CONTROLLER_REVISION_HASH) for p in live}
    updated = sum(1 for r in rev_of.values() if r == rev)
    ready = sum(1 for p in live if is_ready(p))
    status = sts.get("status") or {}
    current = status.get("currentRevision") or rev
    if updated >= replicas and len(live) == replicas:
        current = rev
    plan.status = {
        "observedGeneration": meta.get("generation", 1),
        "replicas": len(live),
        "readyReplicas": ready,
        "availableReplicas": ready,
        "currentReplicas": sum(1 for r in rev_of.values() if r == current),
        "updatedReplicas": updated,
        "currentRevision": current,
        "updateRevision": rev,
        "collisionCount": 0,
    }
    return plan


# --- Job ---------------------------------------------------------------------------------

def job_pod(job: Mapping[str, Any]) -> dict[str, Any]:
    meta = _meta(job)
    template = copy.deepcopy((job.get("spec") or {}).get("template") or {})
    tmeta = template.get("metadata") or {}
    labels = {**(tmeta.get("labels") or {}), LABEL_JOB_NAME: meta["name"], LABEL_LEGACY_JOB_NAME: meta["name"],
              LABEL_JOB_CONTROLLER_UID: meta["uid"], LABEL_LEGACY_CONTROLLER_UID: meta["uid"]}
    body: dict[str, Any] = {"apiVersion": "v1", "kind": "Pod",
                            "metadata": {"generateName": f"{meta['name']}-", "labels": labels,
                                         "ownerReferences": [_owner_reference(job)]},
                            "spec": template.get("spec") or {}}
    if tmeta.get("annotations"):
        body["metadata"]["annotations"] = dict(tmeta["annotations"])
    return body


def _terminated(pod: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out = []
    for cs in (pod.get("status") or {}).get("containerStatuses") or []:
        term = (cs.get("state") or {}).get("terminated")
        if term:
            out.append((cs.get("name", ""), term))
    return out


def match_pod_failure_policy(job: Mapping[str, Any], pod: Mapping[str, Any]) -> tuple[str, int, str, int] | None:
    """(action, rule index, container, exit code) of the first rule a failed pod matches, or None."""
    rules = (((job.get("spec") or {}).get("podFailurePolicy")) or {}).get("rules") or []
    for index, rule in enumerate(rules):
        codes = rule.get("onExitCodes")
        if not codes:
            continue  # onPodConditions: the local node never sets DisruptionTarget & co.
        for name, term in _terminated(pod):
            code = int(term.get("exitCode", 0))
            if code == 0 or (codes.get("containerName") and codes["containerName"] != name):
                continue
            values = set(codes.get("values") or [])
            hit = code in values if codes.get("operator", "In") == "In" else code not in values
            if hit:
                return str(rule.get("action")), index, name, code
    return None


def _created(pod: Mapping[str, Any]) -> tuple[str, str]:
    return (_meta(pod).get("creationTimestamp") or "", _meta(pod).get("name") or "")


def plan_job(job: Mapping[str, Any], pods: Sequence[Mapping[str, Any]], now: float,
             backoff: Callable[[int], float]) -> Plan:
    spec, meta, status = job.get("spec") or {}, _meta(job), dict(job.get("status") or {})
    conds = {c.get("type"): c for c in status.get("conditions") or []}
    finished = any(conds.get(k, {}).get("status") == "True" for k in ("Complete", "Failed"))
    mine = sorted((p for p in pods if owned_by(p, job)), key=_created)
    active = [p for p in mine if (p.get("status") or {}).get("phase") not in TERMINAL_PHASES and not is_terminating(p)]
    plan = Plan()
    if finished:
        plan.delete = [_meta(p)["name"] for p in active]
        ttl = spec.get("ttlSecondsAfterFinished")
        done_at = parse_time(status.get("completionTime")) or parse_time(
            next((c.get("lastTransitionTime") for c in conds.values() if c.get("status") == "True"), None))
        if ttl is not None and done_at is not None:
            plan.delete_owner = now >= done_at + int(ttl)
            plan.wake_at = None if plan.delete_owner else done_at + int(ttl)
        return plan

    succeeded = [p for p in mine if (p.get("status") or {}).get("phase") == "Succeeded"]
    failed = [p for p in mine if (p.get("status") or {}).get("phase") == "Failed"]
    counted: list[Mapping[str, Any]] = []
    fail: tuple[str, str] | None = None
    for p in failed:
        match = match_pod_failure_policy(job, p)
        if match is not None and match[0] == "Ignore":
            continue
        counted.append(p)
        if match is not None and match[0] == "FailJob" and fail is None:
            fail = ("PodFailurePolicy", f"Container {match[2]} for pod {meta.get('namespace')}/{_meta(p)['name']} "
                                        f"failed with exit code {match[3]} matching FailJob rule at index {match[1]}")
    start = parse_time(status.get("startTime")) or now
    limit = int(spec.get("backoffLimit", DEFAULT_BACKOFF_LIMIT))
    deadline = spec.get("activeDeadlineSeconds")
    new_conditions: list[dict[str, Any]] = []
    if succeeded:
        reached = ("CompletionsReached", "Reached expected number of succeeded pods", now)
        new_conditions = [_condition("SuccessCriteriaMet", *reached), _condition("Complete", *reached)]
        status["completionTime"] = rfc3339(now)
    elif fail is None and len(counted) > limit:
        fail = ("BackoffLimitExceeded", "Job has reached the specified backoff limit")
    elif fail is None and deadline is not None and now >= start + int(deadline):
        fail = ("DeadlineExceeded", "Job was active longer than specified deadline")
    if fail is not None:
        new_conditions = [_condition("FailureTarget", *fail, now), _condition("Failed", *fail, now)]
    if new_conditions:
        plan.delete = [_meta(p)["name"] for p in active]
        active = []
    elif not active:
        last_failure = max((parse_time(t.get("finishedAt")) or now for p in counted for _, t in _terminated(p)),
                           default=None)
        ready_at = now if last_failure is None else last_failure + backoff(len(counted))
        if now >= ready_at:
            plan.create.append(job_pod(job))
        else:
            plan.wake_at = ready_at
    if deadline is not None and not new_conditions:
        plan.wake_at = min(x for x in (plan.wake_at, start + int(deadline)) if x is not None)
    status.update({
        "startTime": rfc3339(start),
        "active": len(active) + len(plan.create),
        "ready": sum(1 for p in active if is_ready(p)),
        "succeeded": len(succeeded),
        "failed": len(counted),
        "terminating": sum(1 for p in mine if is_terminating(p)),
        "uncountedTerminatedPods": {},
    })
    if new_conditions:
        status["conditions"] = [c for c in status.get("conditions") or []
                                if c.get("type") not in {n["type"] for n in new_conditions}] + new_conditions
    plan.status = status
    return plan
