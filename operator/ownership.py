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


def controlled_by(obj: Mapping[str, Any], uid: str) -> bool:
    refs = (obj.get("metadata") or {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def labelled_ours(obj: Mapping[str, Any], name: str) -> bool:
    labels = (obj.get("metadata") or {}).get("labels") or {}
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
