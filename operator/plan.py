"""What a PolicyServer's children should be, as a pure function of its spec and what was observed.

No API calls here: :func:`plan` turns (spec, owner, observed children, the
checkpoint's state) into an ordered list of writes, the Events worth posting
for them, and at most one problem (a name conflict, a missing claim), so every
branch is a unit test.  Order matters: the cache claim and the fetch Job come
first; the StatefulSet and Services only once a checkpoint is ready to serve.

The StatefulSet and the Services are *server-side applied* on every pass, not
only when they differ: an apply that changes nothing is a no-op on the API
server, and one that does change something is a hand edit being put back.
The claim and the Job are created once: a claim's spec is immutable after
binding (its growth is a separate decision) and a Job's template always is.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import kopf

from policy_operator.constants import (
    ANNOTATION_CHECKPOINT_REVISION,
    ANNOTATION_CHECKPOINT_SOURCE,
    ANNOTATION_TEMPLATE_HASH,
    COND_PROGRESSING,
    LABEL_CHECKPOINT_KEY,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from policy_operator.operator import manifests
from policy_operator.operator.child_status import CheckpointPhase, CheckpointState
from policy_operator.operator.conditions import FALSE, Condition, Event, Reason
from policy_operator.operator.manifests import Names, ServingCheckpoint
from policy_operator.operator.spec import PolicyServerSpec

SHARED_MODES = frozenset({"ReadWriteMany", "ReadOnlyMany"})


class Verb(str, Enum):
    APPLY = "apply"    # server-side apply, every pass
    CREATE = "create"  # only when missing
    PATCH = "patch"    # a merge patch of a few fields


@dataclass(frozen=True)
class Write:
    verb: Verb
    kind: str
    name: str
    body: dict[str, Any]
    event: Event | None = None  # posted once the write succeeded; None: nothing a human needs to hear


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
    fetch_log: str | None = None  # the end of the running fetch pod's log, for its progress line


@dataclass
class Plan:
    writes: list[Write] = field(default_factory=list)
    serving: ServingCheckpoint | None = None
    problem: Condition | None = None
    warnings: list[Event] = field(default_factory=list)

    @property
    def changes(self) -> list[Write]:
        """The writes that change something (those with an Event); the rest re-assert what exists."""
        return [w for w in self.writes if w.event is not None]

    @property
    def blocked(self) -> bool:
        return self.problem is not None and self.problem.reason == Reason.NAME_CONFLICT


# --- ownership --------------------------------------------------------------------------------

def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def labelled_ours(obj: Mapping[str, Any], name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_INSTANCE) == name


def _conflict(kind: str, name: str, why: str) -> Condition:
    return Condition(COND_PROGRESSING, FALSE, Reason.NAME_CONFLICT, f"{kind} {name} exists but {why}; rename or delete it")


def _adopted(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    kopf.adopt(obj, owner=owner)  # type: ignore[arg-type]
    return obj


def _owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {}}
    kopf.append_owner_reference(obj, owner=owner)  # type: ignore[arg-type]
    return obj["metadata"]["ownerReferences"][0]


# --- the parts ------------------------------------------------------------------------------

def serving_checkpoint(spec: PolicyServerSpec, checkpoint: CheckpointState,
                       sts: Mapping[str, Any] | None) -> ServingCheckpoint | None:
    """The checkpoint the pods should load: the spec's once it is downloaded, else whatever they load now."""
    if checkpoint.phase == CheckpointPhase.READY:
        return ServingCheckpoint.of(spec)
    if sts is None:
        return None
    template_meta = ((sts.get("spec") or {}).get("template") or {}).get("metadata") or {}
    key = (template_meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY)
    annotations = template_meta.get("annotations") or {}
    if not key or ANNOTATION_CHECKPOINT_SOURCE not in annotations:
        return None
    return ServingCheckpoint(key, annotations[ANNOTATION_CHECKPOINT_SOURCE],
                             annotations.get(ANNOTATION_CHECKPOINT_REVISION))


def _plan_pvc(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], pvc: Mapping[str, Any] | None) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    if spec.storage.existing_claim:
        if pvc is None:
            plan.problem = Condition(COND_PROGRESSING, FALSE, Reason.CLAIM_NOT_FOUND,
                                     f"storage.existingClaim {spec.storage.existing_claim} does not exist")
        return
    want_owned = not spec.storage.retain_on_delete
    if pvc is None:
        body = manifests.build_pvc(spec)
        body = _adopted(body, owner) if want_owned else body
        plan.writes.append(Write(Verb.CREATE, "PersistentVolumeClaim", names.pvc, body,
                                 Event("Normal", "Created", f"created PersistentVolumeClaim {names.pvc}")))
        return
    if not labelled_ours(pvc, spec.name):
        plan.problem = _conflict("PersistentVolumeClaim", names.pvc, "was not created for this PolicyServer")
        return
    # retainOnDelete decides whether garbage collection may take the cache with the PolicyServer
    refs = list((pvc.get("metadata") or {}).get("ownerReferences") or [])
    others = [r for r in refs if r.get("uid") != uid]
    wanted = others + ([_owner_reference(owner)] if want_owned else [])
    if len(wanted) != len(refs) or (want_owned and not controlled_by(pvc, uid)):
        verb = "owned by" if want_owned else "released from"
        plan.writes.append(Write(Verb.PATCH, "PersistentVolumeClaim", names.pvc,
                                 {"metadata": {"ownerReferences": wanted or None}},
                                 Event("Normal", "Updated", f"PersistentVolumeClaim {names.pvc} {verb} the "
                                                            f"PolicyServer (retainOnDelete={spec.storage.retain_on_delete})")))


def _plan_job(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], job: Mapping[str, Any] | None,
              checkpoint: CheckpointState) -> None:
    job_name = Names(spec.name).job(spec.checkpoint.key)
    if job is not None and not labelled_ours(job, spec.name):
        plan.problem = _conflict("Job", job_name, "was not created for this PolicyServer")
    elif job is None and checkpoint.phase != CheckpointPhase.READY:
        plan.writes.append(Write(Verb.CREATE, "Job", job_name, _adopted(manifests.build_fetch_job(spec), owner),
                                 Event("Normal", "Created", f"created fetch Job {job_name} for {spec.checkpoint.source}")))


def _plan_statefulset(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], sts: Mapping[str, Any] | None,
                      pvc: Mapping[str, Any] | None) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    assert plan.serving is not None
    desired = _adopted(manifests.build_statefulset(spec, plan.serving), owner)
    want_hash = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
    modes = set(((pvc or {}).get("spec") or {}).get("accessModes") or spec.storage.access_modes_for(spec.replicas))
    shared_warning = Event("Warning", "CacheNotShared",
                           f"{spec.replicas} replicas share cache {manifests.claim_name(spec)} with access modes "
                           f"{sorted(modes)}: pods on different nodes cannot mount it; use ReadWriteMany storage")
    if sts is None:
        plan.writes.append(Write(Verb.APPLY, "StatefulSet", names.statefulset, desired,
                                 Event("Normal", "Created", f"created StatefulSet {names.statefulset} "
                                                            f"({spec.replicas} pods x {spec.layout.world_size} ranks, "
                                                            f"checkpoint {plan.serving.key})")))
        if spec.replicas > 1 and not modes & SHARED_MODES:
            plan.warnings.append(shared_warning)
        return
    if not controlled_by(sts, uid):
        plan.problem = _conflict("StatefulSet", names.statefulset, "is not controlled by this PolicyServer")
        return
    meta, current_spec = sts.get("metadata") or {}, sts.get("spec") or {}
    changes = []
    if (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH) != want_hash:
        old_key = (meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY)
        changes.append(f"rolling pods to template {want_hash}" +
                       (f" (checkpoint {old_key} -> {plan.serving.key})" if old_key != plan.serving.key else ""))
    if current_spec.get("replicas") != spec.replicas:
        changes.append(f"scaling {current_spec.get('replicas')} -> {spec.replicas} pods")
        if spec.replicas > 1 and not modes & SHARED_MODES:
            plan.warnings.append(shared_warning)
    event = Event("Normal", "Updated", f"StatefulSet {names.statefulset}: " + "; ".join(changes)) if changes else None
    plan.writes.append(Write(Verb.APPLY, "StatefulSet", names.statefulset, desired, event))


def _plan_service(plan: Plan, owner: Mapping[str, Any], existing: Mapping[str, Any] | None,
                  desired: dict[str, Any]) -> None:
    name = desired["metadata"]["name"]
    desired = _adopted(desired, owner)
    if existing is None:
        plan.writes.append(Write(Verb.APPLY, "Service", name, desired, Event("Normal", "Created", f"created Service {name}")))
    elif not controlled_by(existing, owner["metadata"]["uid"]):
        plan.problem = _conflict("Service", name, "is not controlled by this PolicyServer")
    else:
        changed = manifests.service_needs_patch(existing, desired)
        plan.writes.append(Write(Verb.APPLY, "Service", name, desired,
                                 Event("Normal", "Updated", f"updated Service {name}") if changed else None))


def plan(spec: PolicyServerSpec, owner: Mapping[str, Any], observed: Observed, checkpoint: CheckpointState) -> Plan:
    """The writes in order: cache claim, fetch Job, then (a checkpoint to serve) StatefulSet and Services."""
    result = Plan()
    _plan_pvc(result, spec, owner, observed.pvc)
    if result.blocked:
        return result
    _plan_job(result, spec, owner, observed.job, checkpoint)
    if result.blocked:
        return result
    result.serving = serving_checkpoint(spec, checkpoint, observed.statefulset)
    if result.serving is None:
        return result
    _plan_statefulset(result, spec, owner, observed.statefulset, observed.pvc)
    if result.blocked:
        return result
    _plan_service(result, owner, observed.headless_service, manifests.build_headless_service(spec))
    _plan_service(result, owner, observed.service, manifests.build_service(spec))
    return result
