"""One level-triggered pass over a PolicyServer: observe, plan, apply, probe, write status.

Every kopf handler (create, update, resume, the timer, child events) ends up
in :func:`reconcile`, which reads the current state from the API instead of
trusting the event that woke it.  That is what makes it restart-safe: all
names are deterministic, so a pass after a crash finds what the previous one
created and only does what is still missing.  :func:`plan` decides, as a
pure function of the spec and the observed objects; :func:`reconcile` does.
"""

from __future__ import annotations

import copy
import datetime
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import kopf

from policy_operator.constants import (
    ANNOTATION_CHECKPOINT_REVISION,
    ANNOTATION_CHECKPOINT_SOURCE,
    ANNOTATION_RANKS_READY,
    ANNOTATION_TEMPLATE_HASH,
    COMPONENT_FETCH,
    COND_PROGRESSING,
    LABEL_CHECKPOINT_KEY,
    LABEL_INSTANCE,
    LABEL_MANAGED_BY,
    MANAGED_BY,
)
from policy_operator.operator import conditions as cond
from policy_operator.operator import child_status, manifests, rank_probe
from policy_operator.operator.kube import AlreadyExists, KubeClient, NotFound, Rejected
from policy_operator.operator.manifests import Names, ServingCheckpoint
from policy_operator.operator.spec import PolicyServerSpec, SpecError, parse_spec

SHARED_MODES = frozenset({"ReadWriteMany", "ReadOnlyMany"})
STATUS_KEYS = ("observedGeneration", "phase", "replicas", "readyReplicas", "ready", "ranksReady", "layout",
               "selector", "endpoint", "templateHash", "checkpoint", "pods", "conditions")


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")


@dataclass
class Observed:
    """The PolicyServer's children as read from the API (None: does not exist)."""

    pvc: dict[str, Any] | None = None
    job: dict[str, Any] | None = None
    job_pods: list[dict[str, Any]] = field(default_factory=list)
    statefulset: dict[str, Any] | None = None
    service: dict[str, Any] | None = None
    headless_service: dict[str, Any] | None = None


@dataclass(frozen=True)
class Action:
    verb: str  # "create" | "patch"
    kind: str
    name: str
    body: Any
    json_patch: bool = False
    event: cond.Event | None = None


@dataclass
class Plan:
    actions: list[Action] = field(default_factory=list)
    serving: ServingCheckpoint | None = None
    problem: cond.Condition | None = None
    warnings: list[cond.Event] = field(default_factory=list)


# --- ownership --------------------------------------------------------------------------------

def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    return any(ref.get("uid") == uid and ref.get("controller") for ref in (obj.get("metadata") or {}).get("ownerReferences") or [])


def labelled_ours(obj: Mapping[str, Any], name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_INSTANCE) == name


def _conflict(kind: str, name: str, why: str) -> cond.Condition:
    return cond.Condition(COND_PROGRESSING, cond.FALSE, cond.R_CONFLICT,
                          f"{kind} {name} exists but {why}; rename or delete it")


def _adopted(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    kopf.adopt(obj, owner=owner)  # type: ignore[arg-type]
    return obj


def _owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {}}
    kopf.append_owner_reference(obj, owner=owner)  # type: ignore[arg-type]
    return obj["metadata"]["ownerReferences"][0]


def _escape(key: str) -> str:
    return key.replace("~", "~0").replace("/", "~1")


# --- the plan -----------------------------------------------------------------------------

def serving_checkpoint(spec: PolicyServerSpec, checkpoint: child_status.CheckpointState,
                       sts: Mapping[str, Any] | None) -> ServingCheckpoint | None:
    """The checkpoint the pods should load: the spec's once it is downloaded, else whatever they load now."""
    if checkpoint.phase == child_status.CK_READY:
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
            plan.problem = cond.Condition(COND_PROGRESSING, cond.FALSE, "ClaimNotFound",
                                          f"storage.existingClaim {spec.storage.existing_claim} does not exist")
        return
    want_owned = not spec.storage.retain_on_delete
    if pvc is None:
        body = manifests.build_pvc(spec)
        body = _adopted(body, owner) if want_owned else body
        plan.actions.append(Action("create", "PersistentVolumeClaim", names.pvc, body,
                                   event=cond.Event("Normal", "Created", f"created PersistentVolumeClaim {names.pvc}")))
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
        plan.actions.append(Action("patch", "PersistentVolumeClaim", names.pvc,
                                   {"metadata": {"ownerReferences": wanted or None}},
                                   event=cond.Event("Normal", "Updated",
                                                    f"PersistentVolumeClaim {names.pvc} {verb} the PolicyServer "
                                                    f"(retainOnDelete={spec.storage.retain_on_delete})")))


def _plan_statefulset(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], sts: Mapping[str, Any] | None,
                      pvc: Mapping[str, Any] | None) -> None:
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    assert plan.serving is not None
    desired = _adopted(manifests.build_statefulset(spec, plan.serving), owner)
    want_hash = desired["metadata"]["annotations"][ANNOTATION_TEMPLATE_HASH]
    modes = set(((pvc or {}).get("spec") or {}).get("accessModes") or spec.storage.access_modes_for(spec.replicas))
    shared_warning = cond.Event("Warning", "CacheNotShared",
                                f"{spec.replicas} replicas share cache {manifests.claim_name(spec)} with access modes "
                                f"{sorted(modes)}: pods on different nodes cannot mount it; use ReadWriteMany storage")
    if sts is None:
        plan.actions.append(Action("create", "StatefulSet", names.statefulset, desired,
                                   event=cond.Event("Normal", "Created",
                                                    f"created StatefulSet {names.statefulset} ({spec.replicas} pods x "
                                                    f"{spec.layout.world_size} ranks, checkpoint {plan.serving.key})")))
        if spec.replicas > 1 and not modes & SHARED_MODES:
            plan.warnings.append(shared_warning)
        return
    if not controlled_by(sts, uid):
        plan.problem = _conflict("StatefulSet", names.statefulset, "is not controlled by this PolicyServer")
        return
    meta, current_spec = sts.get("metadata") or {}, sts.get("spec") or {}
    have_hash = (meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH)
    if have_hash == want_hash and current_spec.get("replicas") == spec.replicas:
        return
    ops = [
        {"op": "add", "path": "/metadata/annotations",
         "value": {**(meta.get("annotations") or {}), **desired["metadata"]["annotations"]}},
        {"op": "add", "path": "/metadata/labels", "value": {**(meta.get("labels") or {}), **desired["metadata"]["labels"]}},
        {"op": "replace", "path": "/spec/replicas", "value": spec.replicas},
    ]
    changes = []
    if have_hash != want_hash:
        ops.append({"op": "replace", "path": "/spec/template", "value": desired["spec"]["template"]})
        old_key = (meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY)
        changes.append(f"rolling pods to template {want_hash}" +
                       (f" (checkpoint {old_key} -> {plan.serving.key})" if old_key != plan.serving.key else ""))
    if current_spec.get("replicas") != spec.replicas:
        changes.append(f"scaling {current_spec.get('replicas')} -> {spec.replicas} pods")
        if spec.replicas > 1 and not modes & SHARED_MODES:
            plan.warnings.append(shared_warning)
    plan.actions.append(Action("patch", "StatefulSet", names.statefulset, ops, json_patch=True,
                               event=cond.Event("Normal", "Updated", f"StatefulSet {names.statefulset}: "
                                                                     + "; ".join(changes))))


def _plan_service(plan: Plan, spec: PolicyServerSpec, owner: Mapping[str, Any], existing: Mapping[str, Any] | None,
                  desired: dict[str, Any]) -> None:
    name = desired["metadata"]["name"]
    desired = _adopted(desired, owner)
    if existing is None:
        plan.actions.append(Action("create", "Service", name, desired,
                                   event=cond.Event("Normal", "Created", f"created Service {name}")))
    elif not controlled_by(existing, owner["metadata"]["uid"]):
        plan.problem = _conflict("Service", name, "is not controlled by this PolicyServer")
    elif manifests.service_needs_patch(existing, desired):
        ops = [{"op": "add", "path": f"/spec/{k}", "value": desired["spec"][k]} for k in ("type", "selector", "ports")]
        ops += [{"op": "add", "path": "/metadata/annotations",
                 "value": {**((existing.get("metadata") or {}).get("annotations") or {}),
                           **(desired["metadata"].get("annotations") or {})}}]
        plan.actions.append(Action("patch", "Service", name, ops, json_patch=True,
                                   event=cond.Event("Normal", "Updated", f"updated Service {name}")))


def plan(spec: PolicyServerSpec, owner: Mapping[str, Any], observed: Observed,
         checkpoint: child_status.CheckpointState) -> Plan:
    """What to create or patch, in order: cache PVC, fetch Job, then (checkpoint ready) StatefulSet and Services."""
    result = Plan()
    _plan_pvc(result, spec, owner, observed.pvc)
    if result.problem and result.problem.reason == cond.R_CONFLICT:
        return result
    job_name = Names(spec.name).job(spec.checkpoint.key)
    if observed.job is not None and not labelled_ours(observed.job, spec.name):
        result.problem = _conflict("Job", job_name, "was not created for this PolicyServer")
        return result
    if observed.job is None and checkpoint.phase != child_status.CK_READY:
        result.actions.append(Action("create", "Job", job_name, _adopted(manifests.build_fetch_job(spec), owner),
                                     event=cond.Event("Normal", "Created",
                                                      f"created fetch Job {job_name} for {spec.checkpoint.source}")))
    result.serving = serving_checkpoint(spec, checkpoint, observed.statefulset)
    if result.serving is None:
        return result
    _plan_statefulset(result, spec, owner, observed.statefulset, observed.pvc)
    if result.problem and result.problem.reason == cond.R_CONFLICT:
        return result
    _plan_service(result, spec, owner, observed.headless_service, manifests.build_headless_service(spec))
    _plan_service(result, spec, owner, observed.service, manifests.build_service(spec))
    return result


# --- doing it -------------------------------------------------------------------------------

@dataclass
class Outcome:
    status: dict[str, Any]
    events: list[cond.Event]
    spec_error: SpecError | None = None
    deleted: bool = False


def observe_children(kube: KubeClient, spec: PolicyServerSpec) -> Observed:
    ns, names = spec.namespace, Names(spec.name)
    job_name = names.job(spec.checkpoint.key)
    job = kube.get("Job", ns, job_name)
    job_pods = kube.list("Pod", ns, {**manifests.selector_labels(spec.name, COMPONENT_FETCH),
                                     LABEL_CHECKPOINT_KEY: spec.checkpoint.key}) if job else []
    return Observed(
        pvc=kube.get("PersistentVolumeClaim", ns, manifests.claim_name(spec)),
        job=job,
        job_pods=job_pods,
        statefulset=kube.get("StatefulSet", ns, names.statefulset),
        service=kube.get("Service", ns, names.service),
        headless_service=kube.get("Service", ns, names.headless_service),
    )


def apply(kube: KubeClient, namespace: str, the_plan: Plan, events: list[cond.Event]) -> dict[str, dict[str, Any]]:
    """Run the actions in order; returns the API's answers by kind/name. Stops at the first rejection."""
    results: dict[str, dict[str, Any]] = {}
    for action in the_plan.actions:
        try:
            if action.verb == "create":
                try:
                    results[f"{action.kind}/{action.name}"] = kube.create(action.body)
                except AlreadyExists:  # created by an earlier pass that died before seeing the answer
                    existing = kube.get(action.kind, namespace, action.name)
                    if existing is not None:
                        results[f"{action.kind}/{action.name}"] = existing
                    continue
            else:
                results[f"{action.kind}/{action.name}"] = kube.patch(action.kind, namespace, action.name, action.body,
                                                                     json_patch=action.json_patch)
        except Rejected as exc:
            the_plan.problem = cond.Condition(COND_PROGRESSING, cond.FALSE, cond.R_APPLY_FAILED,
                                              f"{action.verb} {action.kind} {action.name} was rejected: {exc}")
            break
        if action.event:
            events.append(action.event)
    events.extend(the_plan.warnings)
    return results


def annotate_pods(kube: KubeClient, namespace: str, pods: list[dict[str, Any]], healths: list[rank_probe.PodHealth]) -> None:
    """Mirror each pod's rank readiness into an annotation, so `kubectl get pods` users see it too."""
    by_name = {(p.get("metadata") or {}).get("name"): p for p in pods}
    for h in healths:
        pod = by_name.get(h.name)
        if pod is None or h.phase == "Terminating":
            continue
        if ((pod.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_RANKS_READY) != h.ranks_text:
            try:
                kube.patch("Pod", namespace, h.name, {"metadata": {"annotations": {ANNOTATION_RANKS_READY: h.ranks_text}}})
            except (NotFound, Rejected):  # a pod that just vanished is not worth failing the pass
                pass


def status_patch(previous: Mapping[str, Any], new: Mapping[str, Any], *, full: bool) -> dict[str, Any] | None:
    """A merge patch from ``previous`` to ``new`` status (None when nothing changed); ``full`` drops stale keys."""
    patch = {k: v for k, v in new.items() if previous.get(k) != v}
    if full:
        patch.update({k: None for k in STATUS_KEYS if k in previous and k not in new})
    return patch or None


def reconcile(kube: KubeClient, namespace: str, name: str, *, post_event: Callable[[dict[str, Any], cond.Event], None],
              probe_timeout: float = rank_probe.PROBE_TIMEOUT_S) -> Outcome | None:
    """One full pass; None when the PolicyServer is gone or being deleted (garbage collection does the rest)."""
    owner = kube.get("PolicyServer", namespace, name)
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return None
    meta = owner["metadata"]
    generation = int(meta.get("generation") or 1)
    previous = owner.get("status") or {}
    events: list[cond.Event] = []
    try:
        spec = parse_spec(owner.get("spec"), name=name, namespace=namespace)
    except SpecError as exc:
        update = cond.invalid_status(exc, previous=previous, generation=generation, now=now_rfc3339())
        _write_status(kube, namespace, name, previous, update.status, full=False)
        for event in update.events:
            post_event(owner, event)
        return Outcome(update.status, update.events, spec_error=exc)

    observed = observe_children(kube, spec)
    checkpoint = child_status.checkpoint_state(spec, observed.job, observed.job_pods, previous.get("checkpoint"))
    the_plan = plan(spec, owner, observed, checkpoint)
    results = apply(kube, namespace, the_plan, events)
    for event in events:  # before anything else can fail: these objects now exist
        post_event(owner, event)

    names = Names(spec.name)
    sts = results.get(f"StatefulSet/{names.statefulset}", observed.statefulset)
    if observed.job is None and f"Job/{checkpoint.job_name}" in results:
        checkpoint = child_status.checkpoint_state(spec, results[f"Job/{checkpoint.job_name}"], [], previous.get("checkpoint"))
    workload = child_status.workload_state(sts, spec.replicas)
    pods = kube.list("Pod", namespace, manifests.selector_labels(spec.name)) if sts is not None else []
    healths = rank_probe.poll_pods(pods, spec.service.port, spec.layout.world_size, timeout=probe_timeout)
    annotate_pods(kube, namespace, pods, healths)
    service_exists = observed.service is not None or f"Service/{names.service}" in results
    update = cond.build_status(spec, checkpoint=checkpoint, workload=workload, pods=healths,
                               service_exists=service_exists, previous=previous, generation=generation,
                               now=now_rfc3339(), problem=the_plan.problem)
    _write_status(kube, namespace, name, previous, update.status, full=True)
    for event in update.events:
        post_event(owner, event)
    return Outcome(update.status, events + update.events)


def _write_status(kube: KubeClient, namespace: str, name: str, previous: Mapping[str, Any],
                  status: Mapping[str, Any], *, full: bool) -> None:
    patch = status_patch(previous, status, full=full)
    if patch is not None:
        kube.patch("PolicyServer", namespace, name, {"status": patch}, subresource="status")
