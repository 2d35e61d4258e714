"""What a plan asks of the apply step: the writes, in order, each with the Event worth posting once it succeeded.

The planning modules (``plan.py``, ``storage_plan.py``, ``drift.py``) decide and ``apply.py`` only carries
out, so the vocabulary between them is a module of its own that every one of them can import.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from policy_operator.operator.conditions import Event


class Verb(StrEnum):
    """How ``apply.py`` writes; the value names the write in an ``ApplyFailed`` message."""

    APPLY = "apply"  # server-side apply, every pass (a hand edit is put back)
    APPLY_MISSING = "create"  # server-side apply too, planned only while the object is missing (claims, Jobs)
    CREATE = "create once"  # a POST that never overwrites (a compile key Secret, which the operator cannot read)
    PATCH = "patch"  # a merge patch of a few fields
    DELETE = "delete"  # an owned child the spec no longer asks for


@dataclass(frozen=True)
class Write:
    verb: Verb
    kind: str
    name: str
    body: dict[str, Any]
    event: Event | None = None  # posted once the write succeeded; None: nothing a human needs to hear
