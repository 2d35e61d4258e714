"""The apply step of a reconcile pass: carry out a plan's writes, in order, and say what happened.

Stops at the first write the API server rejects (a 4xx it will give again):
later writes depend on earlier ones (pods need their claim), and the
rejection becomes a ``Progressing=False ApplyFailed`` condition instead of a
retry storm.  Transient errors propagate to the handler, which retries the
whole pass with backoff.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from policy_operator.constants import COND_PROGRESSING
from policy_operator.operator.conditions import FALSE, Condition, Event, Reason
from policy_operator.operator.kube import Kube, Rejected
from policy_operator.operator.plan import Plan
from policy_operator.operator.writes import Verb


@dataclass
class Applied:
    results: dict[str, dict[str, Any]] = field(default_factory=dict)  # "Kind/name" -> the API's answer
    events: list[Event] = field(default_factory=list)
    problem: Condition | None = None


def apply(kube: Kube, plan: Plan, namespace: str) -> Applied:
    applied = Applied(problem=plan.problem)
    for write in plan.writes:
        try:
            if write.verb is Verb.PATCH:
                answer = kube.merge_patch(write.kind, namespace, write.name, write.body)
            elif write.verb is Verb.DELETE:
                answer = kube.delete(write.kind, namespace, write.name) or {}
            elif write.verb is Verb.CREATE:
                answer = kube.create(write.body)
            else:  # APPLY and APPLY_MISSING: both a server-side apply of the whole object
                answer = kube.apply(write.body)
        except Rejected as exc:
            applied.problem = Condition(
                COND_PROGRESSING,
                FALSE,
                Reason.APPLY_FAILED,
                f"{write.verb.value} {write.kind} {write.name} was rejected: {exc}",
            )
            break
        applied.results[f"{write.kind}/{write.name}"] = answer
        if write.event and not answer.get("existed"):  # a create-once that found its object made nothing
            applied.events.append(write.event)
    applied.events.extend(plan.events)
    return applied
