"""One level-triggered pass over a PolicyServer: observe -> plan -> apply -> status.

Every kopf handler (create, update, resume, the timer, child events) ends up
here.  Each step has its module: ``observe`` reads, ``plan`` decides the
children (pure), ``apply`` writes them, ``status`` decides the conditions
(pure) and writes them.  This function is only the order of the steps and
what flows between them.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kubernetes.client import V1StatefulSet

from policy_operator.operator import download_state, observe, workload_state
from policy_operator.operator import status as st
from policy_operator.operator.apply import apply
from policy_operator.operator.conditions import Event
from policy_operator.operator.kube import Kube
from policy_operator.operator.kube_objects import typed
from policy_operator.operator.manifests import Names
from policy_operator.operator.plan import plan
from policy_operator.operator.rank_probe import PROBE_TIMEOUT_S
from policy_operator.operator.resource import PolicyServerStatus
from policy_operator.operator.spec import SpecError, parse_spec


@dataclass
class Outcome:
    status: PolicyServerStatus
    events: list[Event]
    spec_error: SpecError | None = None


def reconcile(
    kube: Kube,
    namespace: str,
    name: str,
    *,
    post_event: Callable[[dict[str, Any], Event], None],
    probe_timeout: float = PROBE_TIMEOUT_S,
) -> Outcome | None:
    """One full pass; None when the PolicyServer is gone or being deleted (garbage collection does the rest)."""
    owner = kube.get("PolicyServer", namespace, name)
    if owner is None or (owner.get("metadata") or {}).get("deletionTimestamp"):
        return None
    generation = int(owner["metadata"].get("generation") or 1)
    previous = owner.get("status") or {}
    try:
        spec = parse_spec(owner.get("spec"), name=name, namespace=namespace)
    except SpecError as exc:  # only Valid and the phase change: whatever already runs keeps running
        update = st.invalid_status(exc, previous=previous, generation=generation, now=st.now_rfc3339())
        st.write_status(kube, namespace, name, previous, update.status, full=False)
        for event in update.events:
            post_event(owner, event)
        return Outcome(update.status, update.events, spec_error=exc)

    # observe
    observed = observe.children(kube, spec)
    checkpoint = download_state.checkpoint_state(
        spec,
        observed.job,
        observed.job_pods,
        previous.get("checkpoint"),
        observed.fetch_progress,
        observe.job_events(kube, namespace, observed.job, observed.job_pods),
        now=datetime.datetime.now(datetime.UTC),
        claim=observed.pvc,
    )
    # plan + apply
    planned = plan(spec, owner, observed, checkpoint)
    applied = apply(kube, planned, namespace)
    for event in applied.events:  # before anything else can fail: these objects now exist
        post_event(owner, event)

    # what the writes changed, then the pods
    names = Names(spec.name)
    written = applied.results.get(f"StatefulSet/{names.statefulset}")
    sts = typed(V1StatefulSet, written) if written is not None else observed.statefulset
    if observed.job is None and f"Job/{checkpoint.job_name}" in applied.results:
        checkpoint = download_state.waiting_for_fetch_pod(checkpoint.job_name)  # created by this pass: no pod yet
    pods, healths = observe.ranks(kube, spec, sts, probe_timeout=probe_timeout, claims=observe.cache_claims(observed))

    # status
    st.annotate_pods(kube, namespace, pods, healths)
    workload = workload_state.workload_state(
        sts, spec.replicas, observe.statefulset_events(kube, namespace, sts, pods), pods
    )
    update = st.build_status(
        spec,
        checkpoint=checkpoint,
        workload=workload,
        pods=healths,
        service_exists=observed.service is not None or f"Service/{names.service}" in applied.results,
        previous=previous,
        generation=generation,
        now=st.now_rfc3339(),
        problem=applied.problem,
        storage=planned.storage,
    )
    st.write_status(kube, namespace, name, previous, update.status, full=True)
    for event in update.events:
        post_event(owner, event)
    return Outcome(update.status, applied.events + update.events)
