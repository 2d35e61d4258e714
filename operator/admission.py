"""What the operator's ServiceAccount may create, as the API server checks it: the chart's admission policy.

RBAC cannot say "Jobs, but only the fetch Job": a grant to create Jobs and
StatefulSets is a grant to run any pod that mounts any Secret of the
namespace.  The operator never reads a Secret and holds no ``pods/log``, but a
stolen token of its ServiceAccount could still start a pod that mounts one.
This policy, bound to requests made as that ServiceAccount only, admits the
shape the operator produces (``manifests.py``) and nothing else: a child
labelled as the operator's and controlled by the PolicyServer it names, whose
every container runs the ``policyserver`` entrypoint, with no host or
network-storage volume, no ServiceAccount token, and a Secret only where the
workload declares it in ``policyoperator.io/secrets``; server pods it may
annotate but never change.

What it cannot check (CEL sees one request, not other objects): that the
PolicyServer named in the owner reference exists, nor that its spec names the
Secrets declared.  docs/operator.md ("Security") says what that leaves.

The chart's policy (``charts/policy-operator/templates/_helpers.tpl``, between
the ``BEGIN GENERATED: admission`` markers) is rendered from ``VALIDATIONS`` by
:func:`render_chart_helpers`, which ``make crd`` runs;
``tests/test_crd.py`` fails while the chart lags this module.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Final

import yaml

from policy_operator.constants import (
    ANNOTATION_SECRETS,
    ENTRYPOINT,
    GROUP,
    KIND,
    LABEL_MANAGED_BY,
    LABEL_POLICYSERVER,
    MANAGED_BY,
)
from policy_operator.operator import rbac
from policy_operator.operator.spec import REFUSED_VOLUME_SOURCES

# the subcommands the operator's containers run: fetch (the fetch Job, perPod init), checkpoint (verify, prune), serve
SUBCOMMANDS: Final = ("fetch", "checkpoint", "serve")

# (API group, version, resource) the policy matches; CREATE and UPDATE (a server-side apply is either)
RESOURCES: Final = (("batch", "v1", "jobs"), ("apps", "v1", "statefulsets"), ("", "v1", "pods"))


@dataclass(frozen=True)
class Variable:
    name: str
    expression: str


@dataclass(frozen=True)
class Validation:
    expression: str
    message: str


_labels = f"has(object.metadata.labels) && {json.dumps(LABEL_MANAGED_BY)} in object.metadata.labels"

_NO_HOST_SOURCE = " && ".join(f"!has(v.{source})" for source in REFUSED_VOLUME_SOURCES)

VARIABLES: tuple[Variable, ...] = (
    Variable("isPod", "object.kind == 'Pod'"),
    Variable("template", "variables.isPod ? object : object.spec.template"),
    Variable("podSpec", "variables.template.spec"),
    Variable(
        "containers",
        "variables.podSpec.containers + "
        "(has(variables.podSpec.initContainers) ? variables.podSpec.initContainers : [])",
    ),
    Variable("volumes", "has(variables.podSpec.volumes) ? variables.podSpec.volumes : []"),
    Variable(
        "declaredSecrets",
        f"has(object.metadata.annotations) && {json.dumps(ANNOTATION_SECRETS)} in object.metadata.annotations "
        f"? object.metadata.annotations[{json.dumps(ANNOTATION_SECRETS)}].split(',') : []",
    ),
)


_DECLARED = "variables.declaredSecrets"

VALIDATIONS: tuple[Validation, ...] = (
    Validation(
        f"variables.isPod || ({_labels} && object.metadata.labels[{json.dumps(LABEL_MANAGED_BY)}] "
        f"== {json.dumps(MANAGED_BY)} && {json.dumps(LABEL_POLICYSERVER)} in object.metadata.labels)",
        f"the operator's ServiceAccount creates only Jobs and StatefulSets labelled {LABEL_MANAGED_BY}={MANAGED_BY} "
        f"and {LABEL_POLICYSERVER}",
    ),
    Validation(
        "variables.isPod || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists_one(r, "
        f"r.apiVersion.startsWith({json.dumps(GROUP + '/')}) && r.kind == {json.dumps(KIND)} && "
        "has(r.controller) && r.controller && "
        f"r.name == object.metadata.labels[{json.dumps(LABEL_POLICYSERVER)}]))",
        f"the operator's ServiceAccount creates only Jobs and StatefulSets controlled by the {KIND} their "
        f"{LABEL_POLICYSERVER} label names",
    ),
    Validation(
        "!variables.isPod || (request.operation == 'UPDATE' && object.spec == oldObject.spec)",
        "the operator's ServiceAccount never creates a pod and never changes a pod's spec (it only annotates them)",
    ),
    Validation(
        "variables.isPod || "
        f"variables.containers.all(c, has(c.command) && size(c.command) >= 2 && c.command[0] == {json.dumps(ENTRYPOINT)}"
        f" && c.command[1] in {json.dumps(list(SUBCOMMANDS))} && (!has(c.args) || size(c.args) == 0))",
        f"every container of the operator's workloads runs `{ENTRYPOINT} {'|'.join(SUBCOMMANDS)}` (command, no args)",
    ),
    Validation(
        f"variables.isPod || variables.volumes.all(v, {_NO_HOST_SOURCE})",
        "the operator's workloads mount no hostPath and no other volume that reaches the node or storage by address",
    ),
    Validation(
        "variables.isPod || (has(variables.podSpec.automountServiceAccountToken) && "
        "!variables.podSpec.automountServiceAccountToken)",
        "the operator's workloads mount no ServiceAccount token (automountServiceAccountToken: false)",
    ),
    Validation(
        f"variables.isPod || variables.volumes.all(v, !has(v.secret) || v.secret.secretName in {_DECLARED}) && "
        "variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, "
        f"!has(s.secret) || s.secret.name in {_DECLARED})) && "
        "variables.containers.all(c, (!has(c.env) || c.env.all(e, !has(e.valueFrom) || "
        f"!has(e.valueFrom.secretKeyRef) || e.valueFrom.secretKeyRef.name in {_DECLARED})) && "
        f"(!has(c.envFrom) || c.envFrom.all(f, !has(f.secretRef) || f.secretRef.name in {_DECLARED})))",
        f"every Secret the pod template names must be listed in the workload's {ANNOTATION_SECRETS} annotation "
        "(the Secrets its PolicyServer's spec names)",
    ),
)


# --- the chart's copy ------------------------------------------------------------------------------

_GENERATED: Final = re.compile(
    r"({{/\* BEGIN GENERATED: admission [^\n]*\*/}}\n)(.*?)({{/\* END GENERATED: admission \*/}})", re.S
)


def policy_body() -> dict[str, object]:
    """The policy's matchConstraints, variables and validations (the chart adds the ServiceAccount's matchCondition)."""
    return {
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": [group],
                    "apiVersions": [version],
                    "resources": [resource],
                    "operations": ["CREATE", "UPDATE"],
                }
                for group, version, resource in RESOURCES
            ]
        },
        "variables": [{"name": v.name, "expression": v.expression} for v in VARIABLES],
        "validations": [{"expression": v.expression, "message": v.message, "reason": "Forbidden"} for v in VALIDATIONS],
    }


def chart_section() -> str:
    """The ``define`` block of the chart: the policy's spec without its matchConditions."""
    body = yaml.safe_dump(policy_body(), sort_keys=False, width=100000)
    return f'{{{{- define "policy-operator.admission.spec" -}}}}\n{body}{{{{- end }}}}\n'


def render_chart_helpers(text: str) -> str:
    """``text`` (the chart's _helpers.tpl) with the generated admission section replaced; a missing marker is an
    error."""
    text, count = _GENERATED.subn(lambda m: f"{m[1]}{chart_section()}{m[3]}", text)
    if count != 1:
        raise ValueError(
            f"{rbac.CHART_HELPERS.name} needs one '{{{{/* BEGIN GENERATED: admission ... */}}}}' ... "
            f"'{{{{/* END GENERATED: admission */}}}}' pair, found {count}"
        )
    return text
