"""What a PolicyServer's children should be, as a pure function of its spec and what was observed.

No API calls here: :func:`plan` turns (spec, owner, observed children, the
checkpoint's state) into an ordered list of writes, the Events worth posting
for them, and at most one problem (a name conflict, a missing claim), so every
branch is a unit test.  Order matters: the cache claim and the fetch Job come
first; the StatefulSet and Services only once a checkpoint is ready to serve.

The StatefulSet and the Services are *server-side applied* on every pass, not
only when they differ: an apply that changes nothing is a no-op on the API
server, and one that does change something is a hand edit being put back;
what apply cannot take back is ``drift.py``'s.  Which pods to replace for a
new template is ``rollout.py``'s; the cache claims and StorageReady are
``storage_plan.py``'s.  The claim and the Jobs are created once (a Job's
template is immutable).  The PodDisruptionBudget is applied like the Services
while replicas > 1 and deleted below that.  Once every pod serves the new
checkpoint, a cleanup Job prunes the old ones from the shared cache.
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from kubernetes.client import (
    V1Job,
    V1PersistentVolumeClaim,
    V1Pod,
    V1PodDisruptionBudget,
    V1Service,
    V1StatefulSet,
)

from policy_operator.constants import (
    ANNOTATION_CHECKPOINT_REVISION,
    ANNOTATION_CHECKPOINT_SOURCE,
    ANNOTATION_SURGE,
    ANNOTATION_TEMPLATE_HASH,
    COMPONENT_CACHE_GC,
    COMPONENT_FETCH,
    LABEL_CHECKPOINT_KEY,
    LABEL_COMPONENT,
)
from policy_operator.operator import manifests
from policy_operator.operator.conditions import Condition, Event, Reason
from policy_operator.operator.download_state import CheckpointPhase, CheckpointState, job_condition
from policy_operator.operator.drift import service_repair, template_repair
from policy_operator.operator.kube_objects import api_json, meta_of
from policy_operator.operator.manifests import Names, ServingCheckpoint
from policy_operator.operator.observe import Observed
from policy_operator.operator.ownership import adopted, conflict, controlled_by, labelled_ours
from policy_operator.operator.pod_problems import setting_up
from policy_operator.operator.rollout import fully_rolled, plan_rollout, start_ordinal
from policy_operator.operator.spec import PolicyServerSpec
from policy_operator.operator.storage_plan import StorageCheck, cache_modes, check_storage, plan_claim
from policy_operator.operator.writes import Verb, Write


@dataclass
class Plan:
    writes: list[Write] = field(default_factory=list)
    serving: ServingCheckpoint | None = None
    problem: Condition | None = None
    events: list[Event] = field(default_factory=list)  # Events no write carries, posted after the writes
    storage: StorageCheck | None = None  # what status.py says as StorageReady

    @property
    def blocked(self) -> bool:
        return self.problem is not None and self.problem.reason == Reason.NAME_CONFLICT


# --- the parts ------------------------------------------------------------------------------


def serving_checkpoint(
    spec: PolicyServerSpec, checkpoint: CheckpointState, sts: V1StatefulSet | None, *, hold: bool = False
) -> ServingCheckpoint | None:
    """The checkpoint the pods should load: the spec's once it is downloaded, else whatever they load now;
    ``hold`` keeps what they load now (a cleanup may still be removing the spec's directory)."""
    if checkpoint.phase == CheckpointPhase.READY and not hold:
        return ServingCheckpoint.of(spec)
    if sts is None:
        return None
    template_meta = meta_of(sts.spec.template if sts.spec else None)
    key = (template_meta.labels or {}).get(LABEL_CHECKPOINT_KEY)
    annotations = template_meta.annotations or {}
    if not key or ANNOTATION_CHECKPOINT_SOURCE not in annotations:
        return None
    return ServingCheckpoint(
        key, annotations[ANNOTATION_CHECKPOINT_SOURCE], annotations.get(ANNOTATION_CHECKPOINT_REVISION)
    )


def _plan_job(
    plan: Plan,
    spec: PolicyServerSpec,
    owner: Mapping[str, Any],
    job: V1Job | None,
    checkpoint: CheckpointState,
    pvc: V1PersistentVolumeClaim | None = None,
    cleanup: str | None = None,
) -> None:
    job_name = Names(spec.name).job(spec.checkpoint.key)
    if spec.storage.per_pod:
        return  # every pod fetches into its own claim (an init container)
    if job is not None and not labelled_ours(job, spec.name):
        plan.problem = conflict("Job", job_name, "was not created for this PolicyServer")
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
                Verb.APPLY_MISSING,
                "Job",
                job_name,
                adopted(manifests.build_fetch_job(spec, cache_modes(spec, pvc)), owner),
                Event("Normal", "Created", f"created fetch Job {job_name} for {spec.checkpoint.source}"),
            )
        )


def _compile_key(
    spec: PolicyServerSpec,
    owner: Mapping[str, Any],
    sts: V1StatefulSet | None,
    desired: Mapping[str, Any],
    pods: Sequence[V1Pod] = (),
) -> list[Write]:
    """The compile key Secret, created (never overwritten: the operator cannot read it) before the first template
    that mounts it, and again while a pod that mounts it is setting up: a Secret deleted by hand is only seen as
    a pod the kubelet cannot start (the operator cannot read Secrets), and a POST of an existing one is refused
    (409) and changes nothing.  Passes at rest (no pod setting up) send nothing."""
    name = Names(spec.name).compile_key
    wanted = any(v.get("secret", {}).get("secretName") == name for v in desired["spec"]["template"]["spec"]["volumes"])
    template = sts.spec.template.spec if sts is not None and sts.spec is not None else None
    has = any(
        v.secret is not None and v.secret.secret_name == name for v in (template.volumes if template else None) or []
    )
    if not wanted:
        return []
    event = None
    if has:
        waiting = [meta_of(p).name for p in pods if setting_up(p)]
        if not waiting:
            return []
        event = Event(
            "Warning",
            "Recreated",
            f"created compile key Secret {name} again: it was missing while pod {waiting[0]} set up its volumes; "
            "compiled artifacts tagged with the old key are compiled again",
        )
    secret = adopted(manifests.build_compile_key_secret(spec, secrets.token_hex(32)), owner)
    return [Write(Verb.CREATE, "Secret", name, secret, event)]


def _plan_statefulset(
    plan: Plan,
    spec: PolicyServerSpec,
    owner: Mapping[str, Any],
    sts: V1StatefulSet | None,
    pvc: V1PersistentVolumeClaim | None,
    pods: Sequence[V1Pod] = (),
) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    assert plan.serving is not None
    desired = adopted(manifests.build_statefulset(spec, plan.serving, cache_modes(spec, pvc)), owner)
    want_hash = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
    plan.writes += _compile_key(spec, owner, sts, desired, pods)
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
        plan.problem = conflict("StatefulSet", names.statefulset, "is not controlled by this PolicyServer")
        return
    templates = sts.spec.volume_claim_templates if sts.spec else None
    if bool(templates) != spec.storage.per_pod:
        return  # storage.mode changed: the apiserver would refuse the StatefulSet; StorageReady says why
    if templates:
        # volumeClaimTemplates are immutable: keep them (a larger size grows the existing claims instead)
        desired["spec"]["volumeClaimTemplates"] = [api_json(t) for t in templates]
    meta, current_replicas = meta_of(sts), (sts.spec.replicas if sts.spec else None)
    repair = template_repair(names.statefulset, sts, desired)
    if repair is not None:
        plan.writes.append(repair)
    drifted = repair is not None
    rollout = plan_rollout(
        spec.replicas, sts, want_hash, pods, retire_by_ordinal=not spec.storage.per_pod, drifted=drifted
    )
    desired["spec"]["replicas"] = rollout.replicas
    desired["spec"]["ordinals"] = {"start": rollout.start}
    if rollout.surge is not None:  # left out, server-side apply removes it: the surge is over
        desired["metadata"].setdefault("annotations", {})[ANNOTATION_SURGE] = rollout.surge
    changes = []
    if (meta.annotations or {}).get(ANNOTATION_TEMPLATE_HASH) != want_hash:
        old_key = (meta.labels or {}).get(LABEL_CHECKPOINT_KEY)
        changes.append(
            f"rolling pods to template {want_hash}"
            + (f" (checkpoint {old_key} -> {plan.serving.key})" if old_key != plan.serving.key else "")
            + (f"; {rollout.note}" if rollout.note else "")
        )
    if (
        current_replicas != rollout.replicas
        and rollout.event is None
        and rollout.surge is None
        and start_ordinal(sts) == rollout.start
    ):
        changes.append(f"scaling {current_replicas} -> {rollout.replicas} pods")
    event = Event("Normal", "Updated", f"StatefulSet {names.statefulset}: " + "; ".join(changes)) if changes else None
    plan.writes.append(Write(Verb.APPLY, "StatefulSet", names.statefulset, desired, event))
    for pod in rollout.delete:  # OnDelete: the controller recreates each from the update revision
        plan.writes.append(Write(Verb.DELETE, "Pod", pod, {}))
    if rollout.event is not None:
        plan.events.append(rollout.event)


def _plan_service(plan: Plan, owner: Mapping[str, Any], existing: V1Service | None, desired: dict[str, Any]) -> None:
    name = desired["metadata"]["name"]
    desired = adopted(desired, owner)
    if existing is None:
        plan.writes.append(
            Write(Verb.APPLY, "Service", name, desired, Event("Normal", "Created", f"created Service {name}"))
        )
    elif not controlled_by(existing, owner["metadata"]["uid"]):
        plan.problem = conflict("Service", name, "is not controlled by this PolicyServer")
    else:
        repair = service_repair(existing, desired)
        if repair is not None:
            have = [f"{p.port}/{p.protocol or 'TCP'}" for p in (existing.spec.ports if existing.spec else None) or []]
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


def _plan_pdb(
    plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], existing: V1PodDisruptionBudget | None
) -> None:
    """A PodDisruptionBudget while replicas > 1 (applied every pass, like the Services); deleted below that."""
    name, uid = Names(spec.name).pdb, owner["metadata"]["uid"]
    if existing is not None and not controlled_by(existing, uid):
        plan.problem = conflict("PodDisruptionBudget", name, "is not controlled by this PolicyServer")
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
            Write(Verb.APPLY, "PodDisruptionBudget", name, adopted(manifests.build_pdb(spec), owner), event)
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


def _job_finished(job: V1Job) -> bool:
    return job_condition(job, "Complete", "Failed")


def _cache_jobs(observed: Observed, component: str, spec: PolicyServerSpec) -> list[V1Job]:
    """This PolicyServer's Jobs of one component for checkpoints other than the spec's."""
    return [
        j
        for j in observed.cache_jobs
        if labelled_ours(j, spec.name)
        and (meta_of(j).labels or {}).get(LABEL_COMPONENT) == component
        and (meta_of(j).labels or {}).get(LABEL_CHECKPOINT_KEY) != spec.checkpoint.key
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
        (str(meta_of(j).name) for j in _cache_jobs(observed, COMPONENT_CACHE_GC, spec) if not _job_finished(j)), None
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
            name = str(meta_of(job).name)
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
    body = adopted(manifests.build_gc_job(spec, key, cache_modes(spec, observed.pvc)), owner)
    plan.writes.append(
        Write(
            Verb.APPLY_MISSING,
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
    result.storage, grows = check_storage(spec, claims, observed.storage_class, observed.statefulset)
    claim_write, result.problem = plan_claim(spec, owner, observed.pvc)
    result.writes += [claim_write] if claim_write is not None else []
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
        meta_of(j).name
        for j in [*observed.cache_jobs, observed.job]
        if j is not None and labelled_ours(j, spec.name) and job_condition(j, "Complete")
    }
    writes = []
    for pod in observed.job_pods_all:
        pod_meta = meta_of(pod)
        owner = next((r.name for r in pod_meta.owner_references or [] if r.kind == "Job"), None)
        if owner in complete and not pod_meta.deletion_timestamp and labelled_ours(pod, spec.name):
            writes.append(Write(Verb.DELETE, "Pod", str(pod_meta.name), {}))
    return writes
