"""Whether the StatefulSet has rolled: converged on its own spec, every pod on the update revision.

Pure functions of the StatefulSet, its pods and its Events as read, so every
state a rollout can be in is a unit test.  Ready pods before the roll is done
may be old pods, and Ready must not be claimed on their behalf.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policy_operator.constants import ANNOTATION_TEMPLATE_HASH, LABEL_CHECKPOINT_KEY
from policy_operator.operator.pod_problems import failed_create


def spec_replicas(sts: Mapping[str, Any]) -> int:
    """The StatefulSet's spec.replicas (the apiserver defaults it to 1)."""
    replicas = (sts.get("spec") or {}).get("replicas")
    return 1 if replicas is None else int(replicas)


def statefulset_rolled(sts: Mapping[str, Any]) -> bool:
    """The StatefulSet controller has seen the latest spec and every pod it counts runs the update revision.

    That is: observedGeneration is current, as many pods exist as spec.replicas
    asks and all of them are updated, and the current revision *is* the update
    revision (once the controller reports one).  Ready pods before that may be
    old pods.  ``workload_state`` (Ready) and ``rollout.fully_rolled`` (the cache
    cleanup) both start from this one check.
    """
    meta, status = sts.get("metadata") or {}, sts.get("status") or {}
    replicas = spec_replicas(sts)
    update = status.get("updateRevision")
    return (
        int(status.get("observedGeneration") or 0) >= int(meta.get("generation") or 1)
        and int(status.get("replicas") or 0) == replicas
        and int(status.get("updatedReplicas") or 0) == replicas
        and (not update or status.get("currentRevision") == update)
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
    sts: Mapping[str, Any] | None,
    desired: int,
    events: Sequence[Mapping[str, Any]] = (),
    pods: Sequence[Mapping[str, Any]] = (),
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
    meta, status = sts.get("metadata") or {}, sts.get("status") or {}
    replicas = spec_replicas(sts)
    current = status.get("replicas") or 0
    rolling = not statefulset_rolled(sts) or replicas != desired
    live = [p for p in pods if not (p.get("metadata") or {}).get("deletionTimestamp")]
    refused = failed_create(sts, events, pods) if len(live) < replicas else ""
    return WorkloadState(
        exists=True,
        desired=desired,
        current=current,
        rolling=rolling,
        serving_key=(meta.get("labels") or {}).get(LABEL_CHECKPOINT_KEY),
        template_hash=(meta.get("annotations") or {}).get(ANNOTATION_TEMPLATE_HASH),
        update_revision=status.get("updateRevision") or None,
        updated=status.get("updatedReplicas") or 0,
        failed_create=refused,
    )
