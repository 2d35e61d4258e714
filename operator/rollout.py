"""Rollouts of a PolicyServer's pods, decided by the operator alone: pure, one observation at a time.

The StatefulSet runs with ``updateStrategy: OnDelete``: a new template never
replaces a pod by itself.  So an edit made behind the operator's back (a
``kubectl set env``) restarts nothing before the operator puts it back, and
every replacement happens here, where it can keep a pod serving:

- **surge**: a template change while a pod serves adds one pod with the new
  template (``replicas: N+1``: the controller creates ordinal ``start+N``
  from the update revision); only once it is Ready does an old pod go;
- **retire by ordinal** (storage mode ``shared``): the old pod goes by moving
  ``spec.ordinals.start`` one up, so the pod that stays is the one clients
  reconnect to.  At ``replicas: 1`` a robot reconnects once per rollout, and
  the StatefulSet never has more than N+1 pods, nor more than N once done;
- **in place** (storage mode ``perPod``, whose claims belong to ordinals; a
  surge pod that does not fit; nothing serving): an old pod is deleted and
  the controller recreates it from the update revision, one at a time while
  the others are Ready, all at once when none is.

``ANNOTATION_SURGE`` (``<template hash>/<phase>``) on the StatefulSet says a
surge is under way; every other fact is read from the StatefulSet and its
pods, so a pass repeated after a crash or a conflict decides the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from kubernetes.client import V1Pod, V1PodCondition, V1StatefulSet, V1StatefulSetStatus

from policy_operator.constants import (
    ANNOTATION_SURGE,
    ANNOTATION_TEMPLATE_HASH,
    LABEL_CHECKPOINT_KEY,
    LABEL_CONTROLLER_REVISION_HASH,
)
from policy_operator.operator.conditions import Event
from policy_operator.operator.kube_objects import meta_of
from policy_operator.operator.workload_state import spec_replicas, statefulset_rolled

SURGE: Final = "surge"


@dataclass(frozen=True)
class Rollout:
    """What the StatefulSet should say now, and which pods to delete (the controller recreates them updated)."""

    replicas: int
    start: int = 0  # spec.ordinals.start
    surge: str | None = None  # ANNOTATION_SURGE's value; None: no surge under way
    delete: tuple[str, ...] = ()
    event: Event | None = None
    note: str | None = None  # what this step does, for the StatefulSet's Updated Event (one Event, not two)


def surge_of(sts: V1StatefulSet | None) -> str | None:
    """The template hash the StatefulSet is surging to, from its annotation; None: not surging."""
    value = (meta_of(sts).annotations or {}).get(ANNOTATION_SURGE) or ""
    want_hash, _, phase = value.partition("/")
    return want_hash if want_hash and phase == SURGE else None


def start_ordinal(sts: V1StatefulSet | None) -> int:
    if sts is None or sts.spec is None or sts.spec.ordinals is None:
        return 0
    return sts.spec.ordinals.start or 0


def ordinal(pod: V1Pod) -> int | None:
    tail = str(meta_of(pod).name or "").rpartition("-")[2]
    return int(tail) if tail.isdigit() else None


def pod_condition(pod: V1Pod | None, kind: str) -> V1PodCondition | None:
    conditions = (pod.status.conditions if pod and pod.status else None) or []
    return next((c for c in conditions if c.type == kind), None)


def _terminating(pod: V1Pod) -> bool:
    return bool(meta_of(pod).deletion_timestamp)


def _ready(pod: V1Pod) -> bool:
    """Ready in the kubelet's view (its readinessProbe is /readyz: every rank warm) and not on its way out."""
    ready = pod_condition(pod, "Ready")
    return not _terminating(pod) and ready is not None and ready.status == "True"


def revision(pod: V1Pod) -> str | None:
    return (meta_of(pod).labels or {}).get(LABEL_CONTROLLER_REVISION_HASH)


def unschedulable(pod: V1Pod | None) -> str | None:
    """The scheduler's message when it found no node for the pod (no GPUs free, ...); None otherwise."""
    scheduled = pod_condition(pod, "PodScheduled")
    if scheduled is not None and scheduled.status == "False" and scheduled.reason == "Unschedulable":
        return str(scheduled.message or "Unschedulable")
    return None


def fully_rolled(sts: V1StatefulSet | None, key: str) -> bool:
    """Every pod of the StatefulSet runs its current template, which serves ``key``, and is ready.

    Until then an old pod may still read an old checkpoint directory, so
    nothing may be removed from the cache.
    """
    if sts is None:
        return False
    template_labels = (meta_of(sts.spec.template if sts.spec else None).labels) or {}
    status = sts.status or V1StatefulSetStatus(replicas=0)
    return (
        template_labels.get(LABEL_CHECKPOINT_KEY) == key
        and statefulset_rolled(sts)
        and bool(status.update_revision)
        and (status.ready_replicas or 0) == spec_replicas(sts)
    )


def _pod_name(pod: V1Pod) -> str:
    return str(meta_of(pod).name)


def _in_place(
    replicas: int,
    start: int,
    by_ordinal: Mapping[int, V1Pod],
    old: Sequence[V1Pod],
) -> tuple[str, ...]:
    """The old pod to delete now: every one when nothing serves, else the lowest once every other pod is Ready."""
    if not any(_ready(p) for p in by_ordinal.values()):
        return tuple(_pod_name(p) for p in old if not _terminating(p))
    candidate = min(old, key=lambda p: ordinal(p) or 0)
    others = [by_ordinal.get(k) for k in range(start, start + replicas) if k != ordinal(candidate)]
    if _terminating(candidate) or not all(p is not None and _ready(p) for p in others):
        return ()  # a replacement is still under way: one pod at a time
    return (_pod_name(candidate),)


def plan_rollout(
    replicas: int,
    sts: V1StatefulSet | None,
    want_hash: str,
    pods: Sequence[V1Pod],
    *,
    retire_by_ordinal: bool,
    drifted: bool = False,
) -> Rollout:
    """The next step towards ``replicas`` pods of template ``want_hash``, from the StatefulSet and its pods as read.

    ``retire_by_ordinal``: an old pod goes by moving ``ordinals.start`` (storage mode shared); False: it is
    replaced in place once the surge pod serves, and the surge pod goes at the end (perPod: claims per ordinal).
    ``drifted``: the template holds fields another manager wrote, put back by this pass; its update revision is
    nobody's spec, so no pod is replaced for it.
    """
    start = start_ordinal(sts)
    if sts is None or replicas == 0:
        return Rollout(replicas, start)
    meta, status = meta_of(sts), sts.status or V1StatefulSetStatus(replicas=0)
    name = str(meta.name or "?")
    by_ordinal = {k: p for p in pods if (k := ordinal(p)) is not None}
    extra_name = f"{name}-{start + replicas}"
    if (meta.annotations or {}).get(ANNOTATION_TEMPLATE_HASH) != want_hash:
        # the template changes with this pass's apply: every pod now is an old one
        if any(_ready(p) for p in pods):
            return Rollout(
                replicas + 1,
                start,
                f"{want_hash}/{SURGE}",
                note=(f"surge: {extra_name} starts with the new template, the serving pod(s) go only once it is Ready"),
            )
        return Rollout(replicas, start)  # nothing serves that a surge could keep serving: in place, next pass
    surging = surge_of(sts) == want_hash
    current_replicas = (sts.spec.replicas if sts.spec else None) or 0
    update = status.update_revision
    if drifted or (status.observed_generation or 0) < (meta.generation or 1) or not update:
        # the controller has not seen the last write: its update revision is not the template's yet
        return Rollout(current_replicas if surging else replicas, start, f"{want_hash}/{SURGE}" if surging else None)
    live = [p for k, p in by_ordinal.items() if start <= k < start + current_replicas]
    old = sorted((p for p in live if revision(p) != update), key=lambda p: ordinal(p) or 0)
    if not surging:
        return Rollout(replicas, start, delete=_in_place(replicas, start, by_ordinal, old) if old else ())
    return _surge_step(
        _Surge(replicas, start, want_hash, name, by_ordinal, old, update, current_replicas), retire_by_ordinal
    )


@dataclass(frozen=True)
class _Surge:
    """A surge under way, as read: the StatefulSet's pods by ordinal, those not on its update revision."""

    replicas: int
    start: int
    want_hash: str
    name: str
    by_ordinal: Mapping[int, V1Pod]
    old: list[V1Pod]
    update: str
    current_replicas: int

    @property
    def extra_name(self) -> str:
        return f"{self.name}-{self.start + self.replicas}"

    @property
    def extra(self) -> V1Pod | None:
        """The surge pod (ordinal start + replicas)."""
        return self.by_ordinal.get(self.start + self.replicas)

    def step(self, *, start: int | None = None, delete: tuple[str, ...] = ()) -> Rollout:
        """N+1 pods surging (``start`` moved one up, or not), deleting ``delete``."""
        return Rollout(
            self.replicas + 1, self.start if start is None else start, f"{self.want_hash}/{SURGE}", delete=delete
        )


def _surge_step(s: _Surge, retire_by_ordinal: bool) -> Rollout:
    """The next step of a surge: start the surge pod, wait for it, retire or replace an old pod, or finish."""
    extra = s.extra
    if not s.old or s.old == [extra]:
        return _surge_done(s)
    if extra is not None and revision(extra) != s.update and not _terminating(extra):
        return s.step(delete=(s.extra_name,))  # an older surge pod
    why = unschedulable(extra)
    if why is not None:
        return Rollout(
            s.replicas,
            s.start,
            event=Event(
                "Warning",
                "SurgeUnschedulable",
                f"{s.extra_name} does not fit ({why}); replacing the pod(s) in place "
                f"instead: each stops before its successor is Ready",
            ),
        )
    if extra is None or not _ready(extra):
        return s.step()  # the surge pod is starting
    lowest = s.by_ordinal.get(s.start)
    if retire_by_ordinal and lowest is not None and lowest in s.old:
        if len(s.old) == 1:  # the last old pod: the pod that serves its clients now is the one that stays
            return Rollout(
                s.replicas,
                s.start + 1,
                event=Event(
                    "Normal",
                    "SurgeComplete",
                    f"{s.extra_name} is Ready with the new template; {s.name}-{s.start} goes",
                ),
            )
        # one old pod goes, the next surge pod starts: never more than N+1 pods, never fewer than N Ready
        return s.step(start=s.start + 1)
    return s.step(delete=_in_place(s.replicas + 1, s.start, s.by_ordinal, [p for p in s.old if p is not extra]))


def _surge_done(s: _Surge) -> Rollout:
    """No old pod left but, perhaps, the surge pod itself: remove a surge pod of an older template, or the
    extra pod once every pod was replaced in place (perPod)."""
    extra = s.extra
    if s.old and extra is not None and not _terminating(extra):  # a surge pod of an older template
        return s.step(delete=(s.extra_name,))
    if s.current_replicas > s.replicas:  # perPod: every pod replaced in place; the surge pod goes
        return Rollout(
            s.replicas,
            s.start,
            event=Event(
                "Normal", "SurgeComplete", f"every pod runs the new template; removing the extra pod {s.extra_name}"
            ),
        )
    return Rollout(s.replicas, s.start)
