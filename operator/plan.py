"""What a PolicyServer's children should be, as a pure function of its spec and what was observed.

No API calls here: :func:`plan` turns (spec, owner, observed children, the
checkpoint's state) into an ordered list of writes, the Events worth posting
for them, and at most one problem (a name conflict, a missing claim), so every
branch is a unit test.  Order matters: the cache claim and the fetch Job come
first; the StatefulSet and Services only once a checkpoint is ready to serve.

The StatefulSet and the Services are *server-side applied* on every pass, not
only when they differ: an apply that changes nothing is a no-op on the API
server, and one that does change something is a hand edit being put back.
What apply cannot take back (fields another manager added: an env entry of
``kubectl set env``, a Service port edited into another key) is found in
managedFields and replaced whole by a merge patch first, with a ``Repaired``
Warning.  Which pods to replace for a new template is ``rollout.py``'s.
The claim and the Jobs are created once: a claim's spec is immutable after
binding except its size, which grows when the StorageClass allows expansion
(``_plan_storage``), and a Job's template always is.  The PodDisruptionBudget
is applied like the Services while replicas > 1 and deleted below that.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import kopf

from policy_operator.constants import (
    ANNOTATION_CHECKPOINT_REVISION,
    ANNOTATION_CHECKPOINT_SOURCE,
    ANNOTATION_SURGE,
    ANNOTATION_TEMPLATE_HASH,
    COMPONENT_CACHE_GC,
    COMPONENT_FETCH,
    COND_PROGRESSING,
    FIELD_MANAGER,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from policy_operator.operator import manifests
from policy_operator.operator.child_status import CheckpointPhase, CheckpointState
from policy_operator.operator.conditions import FALSE, Condition, Event, Reason
from policy_operator.operator.manifests import Names, ServingCheckpoint
from policy_operator.operator.observe import Observed
from policy_operator.operator.rollout import plan_rollout, start_ordinal
from policy_operator.operator.spec import PolicyServerSpec


class Verb(StrEnum):
    APPLY = "apply"  # server-side apply, every pass
    CREATE = "create"  # only when missing
    PATCH = "patch"  # a merge patch of a few fields
    DELETE = "delete"  # an owned child the spec no longer asks for


@dataclass(frozen=True)
class Write:
    verb: Verb
    kind: str
    name: str
    body: dict[str, Any]
    event: Event | None = None  # posted once the write succeeded; None: nothing a human needs to hear


@dataclass(frozen=True)
class StorageCheck:
    """The cache claims against spec.storage, as planning found them: what is wrong, and what grows.

    ``status.storage_condition`` turns it into StorageReady, next to the other conditions.
    """

    problems: tuple[tuple[Reason, str], ...] = ()  # (reason, message), the first one's reason wins
    growing: tuple[str, ...] = ()  # claims patched to a larger size by this pass


@dataclass
class Plan:
    writes: list[Write] = field(default_factory=list)
    serving: ServingCheckpoint | None = None
    problem: Condition | None = None
    warnings: list[Event] = field(default_factory=list)
    storage: StorageCheck | None = None  # what status.py says as StorageReady

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
    return Condition(
        COND_PROGRESSING, FALSE, Reason.NAME_CONFLICT, f"{kind} {name} exists but {why}; rename or delete it"
    )


def _adopted(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    kopf.adopt(obj, owner=owner)  # type: ignore[arg-type]
    return obj


def _owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {}}
    kopf.append_owner_reference(obj, owner=owner)  # type: ignore[arg-type]
    return obj["metadata"]["ownerReferences"][0]


# --- the parts ------------------------------------------------------------------------------


def serving_checkpoint(
    spec: PolicyServerSpec, checkpoint: CheckpointState, sts: Mapping[str, Any] | None, *, hold: bool = False
) -> ServingCheckpoint | None:
    """The checkpoint the pods should load: the spec's once it is downloaded, else whatever they load now;
    ``hold`` keeps what they load now (a cleanup may still be removing the spec's directory)."""
    if checkpoint.phase == CheckpointPhase.READY and not hold:
        return ServingCheckpoint.of(spec)
    if sts is None:
        return None
    template_meta = ((sts.get("spec") or {}).get("template") or {}).get("metadata") or {}
    key = (template_meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY)
    annotations = template_meta.get("annotations") or {}
    if not key or ANNOTATION_CHECKPOINT_SOURCE not in annotations:
        return None
    return ServingCheckpoint(
        key, annotations[ANNOTATION_CHECKPOINT_SOURCE], annotations.get(ANNOTATION_CHECKPOINT_REVISION)
    )


def _plan_pvc(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], pvc: Mapping[str, Any] | None) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    if spec.storage.per_pod:
        return  # the StatefulSet controller makes one claim per pod from the volumeClaimTemplate
    if spec.storage.existing_claim:
        if pvc is None:
            plan.problem = Condition(
                COND_PROGRESSING,
                FALSE,
                Reason.CLAIM_NOT_FOUND,
                f"storage.existingClaim {spec.storage.existing_claim} does not exist",
            )
        return
    want_owned = not spec.storage.retain_on_delete
    if pvc is None:
        body = manifests.build_pvc(spec)
        body = _adopted(body, owner) if want_owned else body
        plan.writes.append(
            Write(
                Verb.CREATE,
                "PersistentVolumeClaim",
                names.pvc,
                body,
                Event("Normal", "Created", f"created PersistentVolumeClaim {names.pvc}"),
            )
        )
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
        plan.writes.append(
            Write(
                Verb.PATCH,
                "PersistentVolumeClaim",
                names.pvc,
                {"metadata": {"ownerReferences": wanted or None}},
                Event(
                    "Normal",
                    "Updated",
                    f"PersistentVolumeClaim {names.pvc} {verb} the "
                    f"PolicyServer (retainOnDelete={spec.storage.retain_on_delete})",
                ),
            )
        )


def _bytes(quantity: Any) -> Any:
    from kubernetes.utils import parse_quantity

    return parse_quantity(quantity) if quantity is not None else None


def _expandable(storage_class: Mapping[str, Any] | None) -> bool | None:
    """The StorageClass's allowVolumeExpansion; None when it could not be read (the apiserver then decides)."""
    if storage_class is None:
        return None
    return bool(storage_class.get("allowVolumeExpansion"))


def _plan_storage(
    plan: Plan,
    spec: PolicyServerSpec,
    claims: Sequence[Mapping[str, Any]],
    storage_class: Mapping[str, Any] | None,
    sts: Mapping[str, Any] | None,
) -> list[Write]:
    """What StorageReady says, and the writes that grow claims (run last: a refused growth must not stop the rest).

    A claim's access modes and class cannot change after it is made: an
    explicit spec that differs gets a Warning and a False condition instead of
    silence.  A larger storage.size grows every cache claim the operator made
    when their StorageClass allows expansion; a smaller one never shrinks a
    claim.  An existingClaim is the user's: only read.
    """
    storage = spec.storage
    problems: list[tuple[Reason, str]] = []
    grows: list[Write] = []
    if sts is not None:
        has_templates = bool((sts.get("spec") or {}).get("volumeClaimTemplates"))
        if has_templates != storage.per_pod:
            was = "perPod" if has_templates else "shared"
            problems.append(
                (
                    Reason.IMMUTABLE_CHANGE,
                    f"storage.mode {storage.mode} cannot replace {was} on an existing PolicyServer (a "
                    f"StatefulSet's volumeClaimTemplates are immutable); the pods are left as they are: set "
                    f"it back to {was}, or delete and recreate the PolicyServer",
                )
            )
    for claim in claims:
        meta = claim.get("metadata") or {}
        if meta.get("deletionTimestamp"):
            problems.append(
                (
                    Reason.CLAIM_TERMINATING,
                    f"PersistentVolumeClaim {meta.get('name')} is being deleted: it goes once no pod uses it "
                    f"(kubernetes.io/pvc-protection), then a new, empty claim is made and the checkpoint is "
                    f"fetched again",
                )
            )
    if not storage.existing_claim:
        want = _bytes(storage.size)
        for claim in claims:
            name = str((claim.get("metadata") or {}).get("name"))
            claim_spec = claim.get("spec") or {}
            modes = sorted(claim_spec.get("accessModes") or [])
            if storage.access_modes and modes != sorted(storage.access_modes):
                problems.append(
                    (
                        Reason.IMMUTABLE_CHANGE,
                        f"PersistentVolumeClaim {name} has access modes {modes}, the spec asks for "
                        f"{sorted(storage.access_modes)}: access modes cannot change after creation; "
                        f"delete the claim (the checkpoint downloads again) or restore the spec",
                    )
                )
            if storage.storage_class_name and claim_spec.get("storageClassName") != storage.storage_class_name:
                problems.append(
                    (
                        Reason.IMMUTABLE_CHANGE,
                        f"PersistentVolumeClaim {name} has StorageClass {claim_spec.get('storageClassName')}, "
                        f"the spec asks for {storage.storage_class_name}: a claim's class cannot change; "
                        f"delete the claim (the checkpoint downloads again) or restore the spec",
                    )
                )
            have = _bytes(((claim_spec.get("resources") or {}).get("requests") or {}).get("storage"))
            if have is None or want == have:
                continue
            if want < have:
                problems.append(
                    (
                        Reason.IMMUTABLE_CHANGE,
                        f"PersistentVolumeClaim {name} requests {claim_spec['resources']['requests']['storage']}"
                        f"; storage.size {storage.size} is smaller and a claim never shrinks",
                    )
                )
            elif _expandable(storage_class) is False:
                problems.append(
                    (
                        Reason.EXPANSION_NOT_ALLOWED,
                        f"PersistentVolumeClaim {name} stays at {claim_spec['resources']['requests']['storage']}"
                        f": StorageClass {(storage_class or {}).get('metadata', {}).get('name')} does not "
                        f"allow volume expansion (allowVolumeExpansion is not true)",
                    )
                )
            else:
                grows.append(
                    Write(
                        Verb.PATCH,
                        "PersistentVolumeClaim",
                        name,
                        manifests.grown_claim_patch(storage.size),
                        Event(
                            "Normal",
                            "Expanding",
                            f"PersistentVolumeClaim {name}: "
                            f"{claim_spec['resources']['requests']['storage']} -> {storage.size}",
                        ),
                    )
                )
        shared_claim = claims[0] if claims and not storage.per_pod else None
        if shared_claim is not None and spec.replicas > 1:
            modes = (shared_claim.get("spec") or {}).get("accessModes") or []
            if not manifests.cache_is_shared(modes):
                problems.append(
                    (
                        Reason.CACHE_NOT_SHARED,
                        f"{spec.replicas} replicas share the ReadWriteOnce cache "
                        f"{(shared_claim.get('metadata') or {}).get('name')}: a pod affinity keeps them all "
                        f"on one node (they fit only if one node has room for all of them); use "
                        f"ReadWriteMany storage or storage.mode perPod",
                    )
                )
    plan.storage = StorageCheck(tuple(problems), tuple(w.name for w in grows))
    return grows


def _cache_modes(spec: PolicyServerSpec, pvc: Mapping[str, Any] | None) -> tuple[str, ...]:
    """The shared cache claim's access modes as they are (a claim keeps those it was made with), else the spec's."""
    return tuple(((pvc or {}).get("spec") or {}).get("accessModes") or spec.access_modes)


def _plan_job(
    plan: Plan,
    spec: PolicyServerSpec,
    owner: Mapping[str, Any],
    job: Mapping[str, Any] | None,
    checkpoint: CheckpointState,
    pvc: Mapping[str, Any] | None = None,
    cleanup: str | None = None,
) -> None:
    job_name = Names(spec.name).job(spec.checkpoint.key)
    if spec.storage.per_pod:
        return  # every pod fetches into its own claim (an init container)
    if job is not None and not labelled_ours(job, spec.name):
        plan.problem = _conflict("Job", job_name, "was not created for this PolicyServer")
    elif job is not None and checkpoint.stale_job:  # it filled a claim that is gone: the next pass fetches again
        plan.writes.append(
            Write(
                Verb.DELETE,
                "Job",
                job_name,
                {},
                Event(
                    "Normal",
                    "Deleted",
                    f"deleted fetch Job {job_name}: it downloaded into a cache claim that was deleted since",
                ),
            )
        )
    elif job is None and checkpoint.phase != CheckpointPhase.READY and cleanup is None:
        plan.writes.append(
            Write(
                Verb.CREATE,
                "Job",
                job_name,
                _adopted(manifests.build_fetch_job(spec, _cache_modes(spec, pvc)), owner),
                Event("Normal", "Created", f"created fetch Job {job_name} for {spec.checkpoint.source}"),
            )
        )


# --- drift: fields of the operator's children that another manager wrote -----------------------------


def foreign_managers(obj: Mapping[str, Any], *path: str) -> list[str]:
    """Field managers other than the operator that own fields under ``path`` (``"spec", "template"``).

    Server-side apply takes back the fields the operator sets, but leaves
    those it never set and another manager added (``kubectl set env`` adds an
    env entry owned by ``kubectl-set``).  Those are found in managedFields.
    """
    found = []
    for entry in (obj.get("metadata") or {}).get("managedFields") or []:
        if entry.get("manager") == FIELD_MANAGER:
            continue
        node: Any = entry.get("fieldsV1") or {}
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
        if node:
            found.append(str(entry.get("manager")))
    return sorted(set(found))


def replacement_patch(live: Any, desired: Any) -> Any:
    """A merge patch that turns ``live`` into ``desired``: every map key only ``live`` has set to null.

    Lists are replaced whole by a merge patch; a key the API server had
    defaulted comes back with its default, so the result is ``desired`` as
    the API server stores it, whoever wrote the rest.
    """
    if not isinstance(live, dict) or not isinstance(desired, dict):
        return copy.deepcopy(desired)
    out: dict[str, Any] = {key: None for key in live if key not in desired}
    for key, value in desired.items():
        out[key] = replacement_patch(live.get(key), value)
    return out


def _repair_template(plan: Plan, name: str, sts: Mapping[str, Any], desired: Mapping[str, Any]) -> bool:
    """Put the pod template back whole when another manager wrote into it (a PATCH before the apply)."""
    managers = foreign_managers(sts, "spec", "template")
    if not managers:
        return False
    live = ((sts.get("spec") or {}).get("template")) or {}
    plan.writes.append(
        Write(
            Verb.PATCH,
            "StatefulSet",
            name,
            {"spec": {"template": replacement_patch(live, desired["spec"]["template"])}},
            Event(
                "Warning",
                "Repaired",
                f"StatefulSet {name}: the pod template had fields written by "
                f"{', '.join(managers)}; put back as the PolicyServer says "
                f"(no pod was replaced for them)",
            ),
        )
    )
    return True


def _plan_statefulset(
    plan: Plan,
    spec: PolicyServerSpec,
    owner: Mapping[str, Any],
    sts: Mapping[str, Any] | None,
    pvc: Mapping[str, Any] | None,
    pods: Sequence[Mapping[str, Any]] = (),
) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    assert plan.serving is not None
    desired = _adopted(manifests.build_statefulset(spec, plan.serving, _cache_modes(spec, pvc)), owner)
    want_hash = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
    if sts is None:
        plan.writes.append(
            Write(
                Verb.APPLY,
                "StatefulSet",
                names.statefulset,
                desired,
                Event(
                    "Normal",
                    "Created",
                    f"created StatefulSet {names.statefulset} "
                    f"({spec.replicas} pods x {spec.layout.world_size} ranks, "
                    f"checkpoint {plan.serving.key})",
                ),
            )
        )
        return
    if not controlled_by(sts, uid):
        plan.problem = _conflict("StatefulSet", names.statefulset, "is not controlled by this PolicyServer")
        return
    templates = (sts.get("spec") or {}).get("volumeClaimTemplates")
    if bool(templates) != spec.storage.per_pod:
        return  # storage.mode changed: the apiserver would refuse the StatefulSet; StorageReady says why
    if templates:
        # volumeClaimTemplates are immutable: keep them (a larger size grows the existing claims instead)
        desired["spec"]["volumeClaimTemplates"] = copy.deepcopy(templates)
    meta, current_spec = sts.get("metadata") or {}, sts.get("spec") or {}
    drifted = _repair_template(plan, names.statefulset, sts, desired)
    rollout = plan_rollout(
        spec.replicas, sts, want_hash, pods, retire_by_ordinal=not spec.storage.per_pod, drifted=drifted
    )
    desired["spec"]["replicas"] = rollout.replicas
    desired["spec"]["ordinals"] = {"start": rollout.start}
    if rollout.surge is not None:  # left out, server-side apply removes it: the surge is over
        desired["metadata"].setdefault("annotations", {})[ANNOTATION_SURGE] = rollout.surge
    changes = []
    if (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH) != want_hash:
        old_key = (meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY)
        changes.append(
            f"rolling pods to template {want_hash}"
            + (f" (checkpoint {old_key} -> {plan.serving.key})" if old_key != plan.serving.key else "")
            + (f"; {rollout.note}" if rollout.note else "")
        )
    if (
        current_spec.get("replicas") != rollout.replicas
        and rollout.event is None
        and rollout.surge is None
        and start_ordinal(sts) == rollout.start
    ):
        changes.append(f"scaling {current_spec.get('replicas')} -> {rollout.replicas} pods")
    event = Event("Normal", "Updated", f"StatefulSet {names.statefulset}: " + "; ".join(changes)) if changes else None
    plan.writes.append(Write(Verb.APPLY, "StatefulSet", names.statefulset, desired, event))
    for pod in rollout.delete:  # OnDelete: the controller recreates each from the update revision
        plan.writes.append(Write(Verb.DELETE, "Pod", pod, {}))
    if rollout.event is not None:
        plan.warnings.append(rollout.event)  # posted after the writes, like every warning of the plan


def _service_repair(existing: Mapping[str, Any], desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch removing ports and selector keys another manager added to a Service; None: none.

    Service ports are a list map keyed by (port, protocol): a port edited by
    hand is another key, owned by its editor, which server-side apply keeps
    next to the operator's, and two ports named ``ws`` are refused (422
    ``Duplicate value``) on every later apply.  A merge patch replaces the list
    whole (a port kept keeps its nodePort).
    """
    if not foreign_managers(existing, "spec", "ports") and not foreign_managers(existing, "spec", "selector"):
        return None  # a spec change: server-side apply moves the operator's own port
    have, want = existing.get("spec") or {}, desired["spec"]
    patch: dict[str, Any] = {}
    keys = {(p.get("port"), p.get("protocol", "TCP")): p for p in have.get("ports") or []}
    if set(keys) != {(p["port"], p.get("protocol", "TCP")) for p in want["ports"]}:
        patch["ports"] = [
            {**p, **({"nodePort": keys[key]["nodePort"]} if key in keys and "nodePort" in keys[key] else {})}
            for p in want["ports"]
            for key in [(p["port"], p.get("protocol", "TCP"))]
        ]
    extra = set(have.get("selector") or {}) - set(want["selector"])
    if extra:
        patch["selector"] = {**dict.fromkeys(sorted(extra)), **want["selector"]}
    return {"spec": patch} if patch else None


def _plan_service(
    plan: Plan, owner: Mapping[str, Any], existing: Mapping[str, Any] | None, desired: dict[str, Any]
) -> None:
    name = desired["metadata"]["name"]
    desired = _adopted(desired, owner)
    if existing is None:
        plan.writes.append(
            Write(Verb.APPLY, "Service", name, desired, Event("Normal", "Created", f"created Service {name}"))
        )
    elif not controlled_by(existing, owner["metadata"]["uid"]):
        plan.problem = _conflict("Service", name, "is not controlled by this PolicyServer")
    else:
        repair = _service_repair(existing, desired)
        if repair is not None:
            have = [
                f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in (existing.get("spec") or {}).get("ports") or []
            ]
            plan.writes.append(
                Write(
                    Verb.PATCH,
                    "Service",
                    name,
                    repair,
                    Event(
                        "Warning",
                        "Repaired",
                        f"Service {name}: ports {', '.join(have)} and selector put back as the "
                        f"PolicyServer says ({', '.join(f'{p["port"]}/{p["protocol"]}' for p in desired['spec']['ports'])})",
                    ),
                )
            )
        changed = repair is None and manifests.service_needs_patch(existing, desired)
        plan.writes.append(
            Write(
                Verb.APPLY,
                "Service",
                name,
                desired,
                Event("Normal", "Updated", f"updated Service {name}") if changed else None,
            )
        )


def _plan_pdb(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], existing: Mapping[str, Any] | None) -> None:
    """A PodDisruptionBudget while replicas > 1 (applied every pass, like the Services); deleted below that."""
    name, uid = Names(spec.name).pdb, owner["metadata"]["uid"]
    if existing is not None and not controlled_by(existing, uid):
        plan.problem = _conflict("PodDisruptionBudget", name, "is not controlled by this PolicyServer")
    elif spec.replicas > 1:
        event = (
            Event(
                "Normal",
                "Created",
                f"created PodDisruptionBudget {name} (maxUnavailable {manifests.PDB_MAX_UNAVAILABLE})",
            )
            if existing is None
            else None
        )
        plan.writes.append(
            Write(Verb.APPLY, "PodDisruptionBudget", name, _adopted(manifests.build_pdb(spec), owner), event)
        )
    elif existing is not None:
        plan.writes.append(
            Write(
                Verb.DELETE,
                "PodDisruptionBudget",
                name,
                {},
                Event("Normal", "Deleted", f"deleted PodDisruptionBudget {name}: {spec.replicas} replica(s)"),
            )
        )


def fully_rolled(sts: Mapping[str, Any] | None, key: str) -> bool:
    """Every pod of the StatefulSet runs its current template, which serves ``key``, and is ready.

    Until then an old pod may still read an old checkpoint directory, so
    nothing may be removed from the cache.
    """
    if sts is None:
        return False
    meta, spec, status = sts.get("metadata") or {}, sts.get("spec") or {}, sts.get("status") or {}
    template_labels = ((spec.get("template") or {}).get("metadata") or {}).get("labels") or {}
    replicas = int(spec.get("replicas") or 0)
    return (
        template_labels.get(LABEL_CHECKPOINT_KEY) == key
        and int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 1)
        and bool(status.get("updateRevision"))
        and status.get("currentRevision") == status.get("updateRevision")
        and int(status.get("replicas") or 0) == replicas
        and int(status.get("updatedReplicas") or 0) == replicas
        and int(status.get("readyReplicas") or 0) == replicas
    )


def _job_finished(job: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )


def _cache_jobs(observed: Observed, component: str, spec: PolicyServerSpec) -> list[Mapping[str, Any]]:
    """This PolicyServer's Jobs of one component for checkpoints other than the spec's."""
    return [
        j
        for j in observed.cache_jobs
        if labelled_ours(j, spec.name)
        and (j["metadata"].get("labels") or {}).get(LABEL_COMPONENT) == component
        and (j["metadata"].get("labels") or {}).get(LABEL_CHECKPOINT_KEY) != spec.checkpoint.key
    ]


def cleanup_running(spec: PolicyServerSpec, observed: Observed) -> str | None:
    """A cleanup Job of another checkpoint that has not ended, by name; None when there is none.

    Its prune keeps only that checkpoint (and the N newest), so it may be
    removing the directory of the spec's checkpoint right now: a fetch started
    meanwhile finds the directory complete (it reads the marker before taking
    the lock) and ends, then the prune renames the directory away under the
    pods about to load it.  Until the cleanup has ended nothing is fetched and
    the pods keep the checkpoint they load.
    """
    return next(
        (j["metadata"]["name"] for j in _cache_jobs(observed, COMPONENT_CACHE_GC, spec) if not _job_finished(j)), None
    )


def _plan_gc(
    plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], observed: Observed, checkpoint: CheckpointState
) -> None:
    """The cleanup Job of the shared cache, once per checkpoint, after the switch to it completed.

    Only while the checkpoint's fetch Job is still around (a download just
    happened, so an older directory may be left); never on an existingClaim
    (other workloads may keep checkpoints on it); perPod claims prune
    themselves in each pod's init container.

    A finished fetch Job says its checkpoint is on the cache (a switch back
    to it skips the download), which stops being true once a cleanup may
    remove it: those Jobs are deleted first, and the cleanup Job is created
    on a later pass, when none is left.  A fetch of another checkpoint still
    running (the spec moved on mid-download) delays the cleanup until it ends.
    """
    storage, key = spec.storage, spec.checkpoint.key
    if storage.per_pod or storage.existing_claim or observed.gc_job is not None or observed.job is None:
        return
    if checkpoint.phase != CheckpointPhase.READY or not fully_rolled(observed.statefulset, key):
        return
    others = _cache_jobs(observed, COMPONENT_FETCH, spec)
    for job in others:
        if _job_finished(job) and controlled_by(job, owner["metadata"]["uid"]):
            name = job["metadata"]["name"]
            plan.writes.append(
                Write(
                    Verb.DELETE,
                    "Job",
                    name,
                    {},
                    Event(
                        "Normal",
                        "Deleted",
                        f"deleted fetch Job {name}: the cleanup of {manifests.claim_name(spec)} may "
                        f"remove its checkpoint",
                    ),
                )
            )
    if others:
        return
    name = Names(spec.name).gc_job(key)
    body = _adopted(manifests.build_gc_job(spec, key, _cache_modes(spec, observed.pvc)), owner)
    plan.writes.append(
        Write(
            Verb.CREATE,
            "Job",
            name,
            body,
            Event(
                "Normal",
                "Created",
                f"created cleanup Job {name}: every pod serves {key}; keeping the last "
                f"{storage.keep_checkpoints} checkpoint(s) on {manifests.claim_name(spec)}",
            ),
        )
    )


def plan(spec: PolicyServerSpec, owner: Mapping[str, Any], observed: Observed, checkpoint: CheckpointState) -> Plan:
    """The writes in order: cache claim, fetch Job, then (a checkpoint to serve) StatefulSet, Services, PDB,
    cleanup Job; claim growth last (a refused expansion stops nothing else)."""
    result = Plan()
    claims = observed.cache_claims if spec.storage.per_pod else [c for c in [observed.pvc] if c is not None]
    grows = _plan_storage(result, spec, claims, observed.storage_class, observed.statefulset)
    _plan_pvc(result, spec, owner, observed.pvc)
    if result.blocked:
        return result
    cleanup = None if spec.storage.per_pod else cleanup_running(spec, observed)
    _plan_job(result, spec, owner, observed.job, checkpoint, observed.pvc, cleanup)
    if result.blocked:
        return result
    result.serving = serving_checkpoint(spec, checkpoint, observed.statefulset, hold=cleanup is not None)
    if result.serving is not None:
        _plan_statefulset(result, spec, owner, observed.statefulset, observed.pvc, observed.pods)
        if result.blocked:
            return result
        _plan_service(result, owner, observed.headless_service, manifests.build_headless_service(spec))
        _plan_service(result, owner, observed.service, manifests.build_service(spec))
        _plan_pdb(result, spec, owner, observed.pdb)
        _plan_gc(result, spec, owner, observed, checkpoint)
    result.writes += finished_job_pods(spec, observed)
    result.writes += grows
    return result


def finished_job_pods(spec: PolicyServerSpec, observed: Observed) -> list[Write]:
    """Deletes of the pods of this PolicyServer's fetch and cleanup Jobs that completed.

    A completed pod does nothing more, but it still mounts the cache claim:
    a claim deleted by hand would stay Terminating for the Job's whole
    ``ttlSecondsAfterFinished``.  The Job keeps its Complete condition (what
    vouches for the download).  A failed attempt's pod is kept: its
    termination message is the fetch's error in status.
    """
    complete = {
        j["metadata"]["name"]
        for j in observed.cache_jobs + [observed.job]
        if j and labelled_ours(j, spec.name) and _job_complete(j)
    }
    writes = []
    for pod in observed.job_pods_all:
        meta = pod.get("metadata") or {}
        owner = next((r.get("name") for r in meta.get("ownerReferences") or [] if r.get("kind") == "Job"), None)
        if owner in complete and not meta.get("deletionTimestamp") and labelled_ours(pod, spec.name):
            writes.append(Write(Verb.DELETE, "Pod", str(meta.get("name")), {}))
    return writes


def _job_complete(job: Mapping[str, Any]) -> bool:
    return any(
        c.get("type") == "Complete" and c.get("status") == "True"
        for c in (job.get("status") or {}).get("conditions") or []
    )
