"""Fields of the operator's children that another manager wrote, and the patches that put them back.

The StatefulSet and the Services are server-side applied on every pass, which
takes back every field the operator sets.  What apply cannot take back is a
field it never set that another manager added (an env entry of ``kubectl set
env``, a Service port edited into another key): those are found in
managedFields and replaced whole by a merge patch first, with a ``Repaired``
Warning.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

from kubernetes.client import V1Service, V1ServiceSpec, V1StatefulSet

from policy_operator.operator.conditions import Event
from policy_operator.operator.kube import foreign_managers
from policy_operator.operator.kube_objects import api_json, meta_of
from policy_operator.operator.writes import Verb, Write


def replacement_patch(live: Any, desired: Any) -> Any:
    """A merge patch that turns ``live`` into ``desired``: every map key only ``live`` has set to null.

    Lists are replaced whole by a merge patch; a key the API server had
    defaulted comes back with its default, so the result is ``desired`` as
    the API server stores it, whoever wrote the rest.
    """
    if not isinstance(live, dict) or not isinstance(desired, dict):
        return copy.deepcopy(desired)
    out: dict[str, Any] = {key: None for key in live if key not in desired}
    for key, value in desired.items():
        out[key] = replacement_patch(live.get(key), value)
    return out


def template_repair(name: str, sts: V1StatefulSet, desired: Mapping[str, Any]) -> Write | None:
    """The patch that puts the pod template back whole when another manager wrote into it (a PATCH before the
    apply); None: nobody did."""
    managers = foreign_managers(meta_of(sts).managed_fields, "spec", "template")
    if not managers:
        return None
    live = api_json(sts.spec.template) if sts.spec is not None else {}
    return Write(
        Verb.PATCH,
        "StatefulSet",
        name,
        {"spec": {"template": replacement_patch(live, desired["spec"]["template"])}},
        Event(
            "Warning",
            "Repaired",
            f"StatefulSet {name}: the pod template had fields written by "
            f"{', '.join(managers)}; put back as the PolicyServer says "
            f"(no pod was replaced for them)",
        ),
    )


def service_repair(existing: V1Service, desired: Mapping[str, Any]) -> dict[str, Any] | None:
    """The merge patch removing ports and selector keys another manager added to a Service; None: none.

    Service ports are a list map keyed by (port, protocol): a port edited by
    hand is another key, owned by its editor, which server-side apply keeps
    next to the operator's, and two ports named ``ws`` are refused (422
    ``Duplicate value``) on every later apply.  A merge patch replaces the list
    whole (a port kept keeps its nodePort).
    """
    managed = meta_of(existing).managed_fields
    if not foreign_managers(managed, "spec", "ports") and not foreign_managers(managed, "spec", "selector"):
        return None  # a spec change: server-side apply moves the operator's own port
    have, want = existing.spec or V1ServiceSpec(), desired["spec"]
    patch: dict[str, Any] = {}
    keys = {(p.port, p.protocol or "TCP"): p for p in have.ports or []}
    if set(keys) != {(p["port"], p.get("protocol", "TCP")) for p in want["ports"]}:
        patch["ports"] = [
            {**p, **({"nodePort": node_port} if (node_port := keys[key].node_port if key in keys else None) else {})}
            for p in want["ports"]
            for key in [(p["port"], p.get("protocol", "TCP"))]
        ]
    extra = set(have.selector or {}) - set(want["selector"])
    if extra:
        patch["selector"] = {**dict.fromkeys(sorted(extra)), **want["selector"]}
    return {"spec": patch} if patch else None
