"""The API access the operator needs, and nothing more: the source of truth for the Helm chart's RBAC.

Each rule says why it exists.  ``rules(all_namespaces=False)`` fits a
namespaced Role (kopf's namespace/CRD scanning is disabled in that mode);
``all_namespaces=True`` adds the cluster-scoped reads kopf then performs.
The operator never reads Secrets (it only names them in pod specs, and creates
each PolicyServer's compile key without reading it back) nor any
pod's log (``pods/log``): with the right to create Jobs, reading logs would
read any Secret.  What it may create is narrowed further by the chart's
admission policy (``admission.py``).

The chart's rules (``charts/policy-operator/templates/_helpers.tpl``, between
the ``BEGIN GENERATED: rbac`` markers) are rendered from ``RULES`` by
:func:`render_chart_helpers`, which ``make crd`` runs with the CRD's
generation; ``tests/test_crd.py`` fails while the chart lags this list.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from policy_operator.constants import GROUP, PLURAL


@dataclass(frozen=True)
class Rule:
    api_group: str
    resource: str
    verbs: tuple[str, ...]
    why: str
    cluster_scoped: bool = False  # only needed with --all-namespaces (cluster-scoped objects)

    def as_policy_rule(self) -> dict[str, list[str]]:
        return {"apiGroups": [self.api_group], "resources": [self.resource], "verbs": list(self.verbs)}


RULES: tuple[Rule, ...] = (
    Rule(
        GROUP,
        PLURAL,
        ("get", "list", "watch", "patch"),
        "watch PolicyServers; kopf patches its finalizer and progress annotations",
    ),
    Rule(GROUP, f"{PLURAL}/status", ("get", "patch"), "write status (phase, conditions, per-rank readiness)"),
    Rule(
        "",
        "persistentvolumeclaims",
        ("get", "list", "watch", "create", "patch"),
        "create the checkpoint cache (server-side apply); adopt/release it as retainOnDelete changes; grow it (and "
        "list and grow the per-pod claims of storage.mode perPod) when storage.size increases; watch them, so a "
        "pass at rest reads nothing from the API (operator/informer.py)",
    ),
    Rule(
        "batch",
        "jobs",
        ("get", "list", "watch", "create", "patch", "delete"),
        "create the fetch and cleanup Jobs (a server-side apply: PATCH that creates) and react to their "
        "completion; delete a finished fetch Job before a cleanup may remove its checkpoint",
    ),
    Rule(
        "apps",
        "statefulsets",
        ("get", "list", "watch", "create", "patch"),
        "run, roll and scale the server pods; react to their rollout",
    ),
    Rule(
        "",
        "services",
        ("get", "list", "watch", "create", "patch"),
        "server-side apply the ClusterIP and headless Services every pass (drift is put back); watch them",
    ),
    Rule(
        "policy",
        "poddisruptionbudgets",
        ("get", "list", "watch", "create", "patch", "delete"),
        "server-side apply the PodDisruptionBudget while replicas > 1; delete it below that; watch them",
    ),
    Rule(
        "",
        "pods",
        ("get", "list", "watch", "patch", "delete"),
        "find server pods to poll /readyz and the running fetch pod to poll /progress, read fetch pods' termination "
        "messages, annotate rank readiness; "
        "replace a server pod in a rollout (the StatefulSet's updateStrategy is OnDelete); delete the pods of "
        "completed fetch and cleanup Jobs (they would keep a deleted cache claim alive)",
    ),
    Rule(
        "",
        "secrets",
        ("create",),
        "create each PolicyServer's compile key Secret once (a POST; an existing one is kept): never get, list, "
        "watch, update or patch, so no Secret of the namespace is read or changed; the admission policy admits only "
        "that Secret's shape",
    ),
    Rule(
        "",
        "events",
        ("create", "patch", "list"),
        "post Events on every transition (kopf.event); list the Job's and StatefulSet's FailedCreate Events "
        "(a pod refused by a ResourceQuota, PodSecurity or a missing PriorityClass) to say so in status",
    ),
    Rule(
        "kopf.dev",
        "kopfpeerings",
        ("get", "list", "watch", "patch"),
        "leader election between operator replicas (kopf peering, namespaced)",
    ),
    Rule(
        "kopf.dev",
        "clusterkopfpeerings",
        ("get", "list", "watch", "patch"),
        "leader election between operator replicas (kopf peering, cluster-wide)",
        cluster_scoped=True,
    ),
    Rule(
        "",
        "namespaces",
        ("get", "list", "watch"),
        "kopf follows namespaces when watching all of them",
        cluster_scoped=True,
    ),
    Rule(
        "apiextensions.k8s.io",
        "customresourcedefinitions",
        ("get", "list", "watch"),
        "kopf notices CRD changes when watching all namespaces",
        cluster_scoped=True,
    ),
    Rule(
        "storage.k8s.io",
        "storageclasses",
        ("get",),
        "read allowVolumeExpansion before growing a cache claim (without it, a namespaced operator lets the "
        "apiserver's resize admission decide)",
        cluster_scoped=True,
    ),
)


def rules(*, all_namespaces: bool) -> list[Rule]:
    return [r for r in RULES if all_namespaces or not r.cluster_scoped]


def policy_rules(*, all_namespaces: bool) -> list[dict[str, list[str]]]:
    """Kubernetes PolicyRule dicts, one per (group, resource)."""
    return [r.as_policy_rule() for r in rules(all_namespaces=all_namespaces)]


def allows(granted: list[dict[str, list[str]]], api_group: str, resource: str, verb: str) -> bool:
    """Whether a list of PolicyRules grants one verb (wildcards included): what a chart test needs."""
    for rule in granted:
        groups, resources, verbs = rule.get("apiGroups") or [], rule.get("resources") or [], rule.get("verbs") or []
        if (
            (api_group in groups or "*" in groups)
            and (resource in resources or "*" in resources)
            and (verb in verbs or "*" in verbs)
        ):
            return True
    return False


def missing(granted: list[dict[str, list[str]]], *, all_namespaces: bool) -> list[str]:
    """The "group/resource:verb" triples the operator needs and ``granted`` lacks."""
    return [
        f"{r.api_group or 'core'}/{r.resource}:{v}"
        for r in rules(all_namespaces=all_namespaces)
        for v in r.verbs
        if not allows(granted, r.api_group, r.resource, v)
    ]


# --- the chart's copy ------------------------------------------------------------------------------

CHART_HELPERS: Final = Path(__file__).resolve().parents[1] / "charts" / "policy-operator" / "templates" / "_helpers.tpl"
_GENERATED: Final = re.compile(
    r"({{/\* BEGIN GENERATED: rbac [^\n]*\*/}}\n)(.*?)({{/\* END GENERATED: rbac \*/}})", re.S
)


def _yaml_rules(rules: list[Rule]) -> str:
    """PolicyRules as YAML, each after a comment saying why it exists (the rendered Role carries it)."""
    lines = []
    for rule in rules:
        group = f'"{rule.api_group}"' if not rule.api_group else rule.api_group
        lines += [
            f"# {rule.why}",
            f"- apiGroups: [{group}]",
            f"  resources: [{rule.resource}]",
            f"  verbs: [{', '.join(rule.verbs)}]",
        ]
    return "\n".join(lines)


def chart_rules_section() -> str:
    """The two ``define`` blocks of the chart: a namespaced Role's rules, and what --all-namespaces adds."""
    namespaced = [r for r in RULES if not r.cluster_scoped]
    cluster = [r for r in RULES if r.cluster_scoped]
    return (
        f'{{{{- define "policy-operator.rules.namespaced" -}}}}\n{_yaml_rules(namespaced)}\n{{{{- end }}}}\n'
        f'{{{{- define "policy-operator.rules.cluster" -}}}}\n{_yaml_rules(cluster)}\n{{{{- end }}}}\n'
    )


def render_chart_helpers(text: str) -> str:
    """``text`` (the chart's _helpers.tpl) with the generated RBAC section replaced; a missing marker is an error."""
    text, count = _GENERATED.subn(lambda m: f"{m[1]}{chart_rules_section()}{m[3]}", text)
    if count != 1:
        raise ValueError(
            f"{CHART_HELPERS.name} needs one '{{{{/* BEGIN GENERATED: rbac ... */}}}}' ... "
            f"'{{{{/* END GENERATED: rbac */}}}}' pair, found {count}"
        )
    return text
