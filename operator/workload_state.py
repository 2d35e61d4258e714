"""Whether the StatefulSet has rolled: converged on its own spec, every pod on the update revision.

Pure functions of the StatefulSet, its pods and its Events as read, so every
state a rollout can be in is a unit test.  Ready pods before the roll is done
may be old pods, and Ready must not be claimed on their behalf.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kubernetes.client import CoreV1Event, V1Pod, V1StatefulSet, V1StatefulSetStatus

from policy_operator.constants import ANNOTATION_TEMPLATE_HASH, LABEL_CHECKPOINT_KEY
from policy_operator.operator.kube_objects import meta_of
from policy_operator.operator.pod_problems import failed_create


def spec_replicas(sts: V1StatefulSet) -> int:
    """The StatefulSet's spec.replicas (the apiserver defaults it to 1)."""
    replicas = sts.spec.replicas if sts.spec else None
    return 1 if replicas is None else replicas


def statefulset_rolled(sts: V1StatefulSet) -> bool:
    """The StatefulSet controller has seen the latest spec and every pod it counts runs the update revision.

    That is: observedGeneration is current, as many pods exist as spec.replicas
    asks and all of them are updated, and the current revision *is* the update
    revision (once the controller reports one).  Ready pods before that may be
    old pods.  ``workload_state`` (Ready) and ``rollout.fully_rolled`` (the cache
    cleanup) both start from this one check.
    """
    status = sts.status or V1StatefulSetStatus(replicas=0)
    replicas = spec_replicas(sts)
    update = status.update_revision
    return (
        (status.observed_generation or 0) >= (meta_of(sts).generation or 1)
        and (status.replicas or 0) == replicas
        and (status.updated_replicas or 0) == replicas
        and (not update or status.current_revision == update)
    )


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


def workload_state(
    sts: V1StatefulSet | None,
    desired: int,
    events: Sequence[CoreV1Event] = (),
    pods: Sequence[V1Pod] = (),
) -> WorkloadState:
    """Whether the StatefulSet is still converging on its own spec (rolling out or scaling).

    "Rolled" means the controller has seen the latest spec (observedGeneration),
    counts every replica as updated, and the current revision *is* the update
    revision: ready pods before that may be old pods, and Ready must not be
    claimed on their behalf.  ``events`` and ``pods`` (the StatefulSet's) say
    whether a missing pod is one the API server refused to create.
    """
    if sts is None:
        return WorkloadState(exists=False, desired=desired, rolling=desired > 0)
    meta, status = meta_of(sts), sts.status or V1StatefulSetStatus(replicas=0)
    replicas = spec_replicas(sts)
    current = status.replicas or 0
    rolling = not statefulset_rolled(sts) or replicas != desired
    live = [p for p in pods if not meta_of(p).deletion_timestamp]
    refused = failed_create(sts, events, pods) if len(live) < replicas else ""
    return WorkloadState(
        exists=True,
        desired=desired,
        current=current,
        rolling=rolling,
        serving_key=(meta.labels or {}).get(LABEL_CHECKPOINT_KEY),
        template_hash=(meta.annotations or {}).get(ANNOTATION_TEMPLATE_HASH),
        update_revision=status.update_revision or None,
        updated=status.updated_replicas or 0,
        failed_create=refused,
    )
