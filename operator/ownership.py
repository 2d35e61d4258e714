"""Whether an existing child is this PolicyServer's, and how a new one is made its own.

Every child's name is deterministic, so an object of that name may be someone
else's: the operator changes only objects that carry its labels (the cache
claim, the Jobs) or its controller reference (the StatefulSet, the Services,
the PodDisruptionBudget).  Anything else is a ``NameConflict``, never
overwritten.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import kopf

from policy_operator.constants import COND_PROGRESSING, LABEL_INSTANCE, LABEL_MANAGED_BY, MANAGED_BY
from policy_operator.operator.conditions import FALSE, Condition, Reason
from policy_operator.operator.kube_objects import HasMetadata, meta_of


def controlled_by(obj: HasMetadata, uid: str) -> bool:
    return any(ref.uid == uid and ref.controller for ref in meta_of(obj).owner_references or [])


def labelled_ours(obj: HasMetadata, name: str) -> bool:
    labels = meta_of(obj).labels or {}
    return labels.get(LABEL_MANAGED_BY) == MANAGED_BY and labels.get(LABEL_INSTANCE) == name


def conflict(kind: str, name: str, why: str) -> Condition:
    return Condition(
        COND_PROGRESSING, FALSE, Reason.NAME_CONFLICT, f"{kind} {name} exists but {why}; rename or delete it"
    )


def adopted(obj: dict[str, Any], owner: Mapping[str, Any]) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    kopf.adopt(obj, owner=owner)  # type: ignore[arg-type]
    return obj


def owner_reference(owner: Mapping[str, Any]) -> dict[str, Any]:
    obj: dict[str, Any] = {"metadata": {}}
    kopf.append_owner_reference(obj, owner=owner)  # type: ignore[arg-type]
    return obj["metadata"]["ownerReferences"][0]
