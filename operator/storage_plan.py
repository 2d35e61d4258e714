"""The cache claims of a PolicyServer against ``spec.storage``: the shared claim, and what StorageReady says.

The shared claim is created once and never re-applied: its spec is immutable
after binding except its size.  So a spec that asks for other access modes
or another class gets a False StorageReady saying so instead of silence, a
larger ``storage.size`` grows every claim the operator made (perPod claims
too) when their StorageClass allows expansion, and a smaller one never
shrinks a claim.  An ``existingClaim`` is the user's: only read.  Pure, like
``plan.py``, which calls it; ``status.storage_condition`` words StorageReady.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kubernetes.client import (
    V1PersistentVolumeClaim,
    V1PersistentVolumeClaimSpec,
    V1StatefulSet,
    V1StorageClass,
)

from policy_operator.constants import COND_PROGRESSING
from policy_operator.operator import manifests
from policy_operator.operator.conditions import FALSE, Condition, Event, Reason
from policy_operator.operator.kube_objects import api_json, meta_of
from policy_operator.operator.manifests import Names
from policy_operator.operator.ownership import adopted, conflict, controlled_by, labelled_ours, owner_reference
from policy_operator.operator.spec import PolicyServerSpec
from policy_operator.operator.writes import Verb, Write


@dataclass(frozen=True)
class StorageCheck:
    """The cache claims against spec.storage, as planning found them: what is wrong, and what grows.

    ``status.storage_condition`` turns it into StorageReady, next to the other conditions.
    """

    problems: tuple[tuple[Reason, str], ...] = ()  # (reason, message), the first one's reason wins
    growing: tuple[str, ...] = ()  # claims patched to a larger size by this pass


def plan_claim(
    spec: PolicyServerSpec, owner: Mapping[str, Any], pvc: V1PersistentVolumeClaim | None
) -> tuple[Write | None, Condition | None]:
    """The shared cache claim: made when missing, its owner reference set as retainOnDelete says; or why it cannot be
    (an existingClaim that does not exist, a claim of that name that is not this PolicyServer's)."""
    names, uid = Names(spec.name), owner["metadata"]["uid"]
    if spec.storage.per_pod:
        return None, None  # the StatefulSet controller makes one claim per pod from the volumeClaimTemplate
    if spec.storage.existing_claim:
        if pvc is None:
            return None, Condition(
                COND_PROGRESSING,
                FALSE,
                Reason.CLAIM_NOT_FOUND,
                f"storage.existingClaim {spec.storage.existing_claim} does not exist",
            )
        return None, None
    want_owned = not spec.storage.retain_on_delete
    if pvc is None:
        body = manifests.build_pvc(spec)
        body = adopted(body, owner) if want_owned else body
        return Write(
            Verb.APPLY_MISSING,
            "PersistentVolumeClaim",
            names.pvc,
            body,
            Event("Normal", "Created", f"created PersistentVolumeClaim {names.pvc}"),
        ), None
    if not labelled_ours(pvc, spec.name):
        return None, conflict("PersistentVolumeClaim", names.pvc, "was not created for this PolicyServer")
    # retainOnDelete decides whether garbage collection may take the cache with the PolicyServer
    refs = meta_of(pvc).owner_references or []
    others = [api_json(r) for r in refs if r.uid != uid]
    wanted = others + ([owner_reference(owner)] if want_owned else [])
    if len(wanted) != len(refs) or (want_owned and not controlled_by(pvc, uid)):
        verb = "owned by" if want_owned else "released from"
        return Write(
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
        ), None
    return None, None


Problem = tuple[Reason, str]  # a reason of StorageReady=False and its message


def _bytes(quantity: Any) -> Any:
    from kubernetes.utils import parse_quantity

    return parse_quantity(quantity) if quantity is not None else None


def _expandable(storage_class: V1StorageClass | None) -> bool | None:
    """The StorageClass's allowVolumeExpansion; None when it could not be read (the apiserver then decides)."""
    if storage_class is None:
        return None
    return bool(storage_class.allow_volume_expansion)


def check_storage(
    spec: PolicyServerSpec,
    claims: Sequence[V1PersistentVolumeClaim],
    storage_class: V1StorageClass | None,
    sts: V1StatefulSet | None,
) -> tuple[StorageCheck, list[Write]]:
    """What StorageReady says, and the writes that grow claims (run last: a refused growth must not stop the rest).

    A claim's access modes and class cannot change after it is made: an
    explicit spec that differs gets a Warning and a False condition instead of
    silence.  A larger storage.size grows every cache claim the operator made
    when their StorageClass allows expansion; a smaller one never shrinks a
    claim.  An existingClaim is the user's: only read.
    """
    problems = [*mode_change(spec, sts), *terminating(claims)]
    grows: list[Write] = []
    if not spec.storage.existing_claim:
        for claim in claims:
            problems += immutable_changes(spec, claim)
            size_problem, grow = growth(spec, claim, storage_class)
            problems += size_problem
            grows += grow
        problems += cache_not_shared(spec, claims)
    return StorageCheck(tuple(problems), tuple(w.name for w in grows)), grows


def mode_change(spec: PolicyServerSpec, sts: V1StatefulSet | None) -> list[Problem]:
    """storage.mode changed under an existing StatefulSet, whose volumeClaimTemplates cannot change."""
    if sts is None:
        return []
    has_templates = bool(sts.spec.volume_claim_templates if sts.spec else None)
    if has_templates == spec.storage.per_pod:
        return []
    was = "perPod" if has_templates else "shared"
    return [
        (
            Reason.IMMUTABLE_CHANGE,
            f"storage.mode {spec.storage.mode} cannot replace {was} on an existing PolicyServer (a "
            f"StatefulSet's volumeClaimTemplates are immutable); the pods are left as they are: set "
            f"it back to {was}, or delete and recreate the PolicyServer",
        )
    ]


def terminating(claims: Sequence[V1PersistentVolumeClaim]) -> list[Problem]:
    """Cache claims being deleted: the checkpoint goes with them."""
    return [
        (
            Reason.CLAIM_TERMINATING,
            f"PersistentVolumeClaim {meta_of(claim).name} is being deleted: it goes once no pod uses it "
            f"(kubernetes.io/pvc-protection), then a new, empty claim is made and the checkpoint is "
            f"fetched again",
        )
        for claim in claims
        if meta_of(claim).deletion_timestamp
    ]


def immutable_changes(spec: PolicyServerSpec, claim: V1PersistentVolumeClaim) -> list[Problem]:
    """An explicit accessModes or storageClassName the claim, made with others, cannot take."""
    storage, name = spec.storage, str(meta_of(claim).name)
    claim_spec = claim.spec or V1PersistentVolumeClaimSpec()
    modes = sorted(claim_spec.access_modes or [])
    problems: list[Problem] = []
    if storage.access_modes and modes != sorted(storage.access_modes):
        problems.append(
            (
                Reason.IMMUTABLE_CHANGE,
                f"PersistentVolumeClaim {name} has access modes {modes}, the spec asks for "
                f"{sorted(storage.access_modes)}: access modes cannot change after creation; "
                f"delete the claim (the checkpoint downloads again) or restore the spec",
            )
        )
    if storage.storage_class_name and claim_spec.storage_class_name != storage.storage_class_name:
        problems.append(
            (
                Reason.IMMUTABLE_CHANGE,
                f"PersistentVolumeClaim {name} has StorageClass {claim_spec.storage_class_name}, "
                f"the spec asks for {storage.storage_class_name}: a claim's class cannot change; "
                f"delete the claim (the checkpoint downloads again) or restore the spec",
            )
        )
    return problems


def growth(
    spec: PolicyServerSpec, claim: V1PersistentVolumeClaim, storage_class: V1StorageClass | None
) -> tuple[list[Problem], list[Write]]:
    """storage.size against what the claim requests: grow it (its class allowing), or say why it stays."""
    storage, name = spec.storage, str(meta_of(claim).name)
    requested = manifests.claim_storage(claim)
    want, have = _bytes(storage.size), _bytes(requested)
    if have is None or want == have:
        return [], []
    if want < have:
        return [
            (
                Reason.IMMUTABLE_CHANGE,
                f"PersistentVolumeClaim {name} requests {requested}"
                f"; storage.size {storage.size} is smaller and a claim never shrinks",
            )
        ], []
    if _expandable(storage_class) is False:
        return [
            (
                Reason.EXPANSION_NOT_ALLOWED,
                f"PersistentVolumeClaim {name} stays at {requested}"
                f": StorageClass {meta_of(storage_class).name} does not "
                f"allow volume expansion (allowVolumeExpansion is not true)",
            )
        ], []
    grow = Write(
        Verb.PATCH,
        "PersistentVolumeClaim",
        name,
        manifests.grown_claim_patch(storage.size),
        Event("Normal", "Expanding", f"PersistentVolumeClaim {name}: {requested} -> {storage.size}"),
    )
    return [], [grow]


def cache_not_shared(spec: PolicyServerSpec, claims: Sequence[V1PersistentVolumeClaim]) -> list[Problem]:
    """Several replicas on one ReadWriteOnce shared cache: they fit only on one node."""
    shared_claim = claims[0] if claims and not spec.storage.per_pod else None
    if shared_claim is None or spec.replicas <= 1:
        return []
    modes = (shared_claim.spec.access_modes if shared_claim.spec else None) or []
    if manifests.cache_is_shared(modes):
        return []
    return [
        (
            Reason.CACHE_NOT_SHARED,
            f"{spec.replicas} replicas share the ReadWriteOnce cache "
            f"{meta_of(shared_claim).name}: a pod affinity keeps them all "
            f"on one node (they fit only if one node has room for all of them); use "
            f"ReadWriteMany storage or storage.mode perPod",
        )
    ]


def cache_modes(spec: PolicyServerSpec, pvc: V1PersistentVolumeClaim | None) -> tuple[str, ...]:
    """The shared cache claim's access modes as they are (a claim keeps those it was made with), else the spec's."""
    return tuple((pvc.spec.access_modes if pvc and pvc.spec else None) or spec.access_modes)
