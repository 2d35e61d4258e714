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

The image is the one thing of that shape a PolicyServer chooses freely, so
the chart's ``admissionPolicy.allowedImages`` (empty: any image) is checked
against every container and init container too.  An entry matches exactly
what :data:`IMAGE_ENTRY_RULES` says (docs/operator.md quotes it): an entry
ending in ``/`` admits every repository under that path, nested ones
included; an entry ending in ``:`` or ``@`` admits any tag or digest of that
repository; an entry that names a tag or a digest admits that reference only
(no digest after an allowed tag: with one, the runtime pulls the digest and
the tag means nothing); any other entry is one repository and admits it bare,
with a tag, a digest or both, never a repository nested under it nor another
port's registry.  The image is compared as the spec writes it (``busybox`` is
not ``docker.io/library/busybox``).  The list is templated
into the policy as a CEL list literal (the ``allowedImages`` variable, from the
value through ``toJson``) rather than read from a ``paramKind`` resource: it
needs no second object and no ``paramRef`` on the binding, it changes only with
the release (a params ConfigMap would be one more object whose editors widen
the list), and it is plain ``admissionregistration.k8s.io/v1`` that any
Kubernetes >= 1.30 accepts.  The refusal's ``messageExpression`` names the
refused images and the allowed entries.

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
from collections.abc import Sequence
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
    message: str  # the API server's fallback when message_expression fails
    message_expression: str = ""


# the chart value the allowlist comes from, and what stands for it in the generated chart section
ALLOWED_IMAGES_VALUE: Final = "admissionPolicy.allowedImages"
_ALLOWED_IMAGES_SLOT: Final = "ALLOWED_IMAGES_FROM_VALUES"
_ALLOWED_IMAGES_TEMPLATE: Final = f"{{{{ .Values.{ALLOWED_IMAGES_VALUE} | default list | toJson | quote }}}}"


def cel_list(items: Sequence[str]) -> str:
    """``items`` as a CEL list literal: JSON, as Helm's ``toJson`` writes it."""
    return json.dumps(list(items), separators=(",", ":"))


# What one entry of admissionPolicy.allowedImages admits: the docs (docs/operator.md, values.yaml) quote these lines.
IMAGE_ENTRY_RULES: Final = (
    "an entry ending in `/` admits every image under that path, nested repositories included",
    "an entry ending in `:` or `@` admits that repository with any tag or digest after it",
    "an entry that names a tag or a digest admits exactly that reference (no digest after an allowed tag)",
    "any other entry is one repository: it admits the repository bare, with a tag, a digest or a tag and a "
    "digest, and no repository nested under it nor another port's registry",
)

# p (an entry) admits i (an image), clause by clause as IMAGE_ENTRY_RULES reads; a tag is a `:` in the last path
# component, so `host:5000/app` is a repository and `registry.example.com` does not admit `registry.example.com:5000/x`
_MATCHES = (
    "i == p || (p.endsWith('/') && i.startsWith(p)) || "
    "((p.endsWith(':') || p.endsWith('@')) && i.startsWith(p) && !i.substring(size(p)).contains('/')) || "
    "(!p.endsWith('/') && !p.contains('@') && !p.substring(p.lastIndexOf('/') + 1).contains(':') && "
    "(i.startsWith(p + ':') || i.startsWith(p + '@')) && !i.substring(size(p)).contains('/'))"
)


_labels = f"has(object.metadata.labels) && {json.dumps(LABEL_MANAGED_BY)} in object.metadata.labels"

_NO_HOST_SOURCE = " && ".join(f"!has(v.{source})" for source in REFUSED_VOLUME_SOURCES)


_SHAPE_VARIABLES: tuple[Variable, ...] = (
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


def _image_variables(allowed_images: str) -> tuple[Variable, ...]:
    return (
        Variable("allowedImages", allowed_images),
        Variable(
            "refusedImages",
            "variables.isPod || size(variables.allowedImages) == 0 ? [] : "
            "variables.containers.map(c, has(c.image) ? c.image : '')"
            f".filter(i, !variables.allowedImages.exists(p, {_MATCHES}))",
        ),
    )


def variables(allowed_images: str = cel_list(())) -> tuple[Variable, ...]:
    """The policy's variables; ``allowed_images`` is the allowlist's CEL list literal."""
    return (*_SHAPE_VARIABLES, *_image_variables(allowed_images))


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
    Validation(
        "size(variables.refusedImages) == 0",
        f"every container's image of the operator's workloads must be one that {ALLOWED_IMAGES_VALUE} admits",
        "'image ' + variables.refusedImages.join(', ') + ' is not allowed: "
        f"{ALLOWED_IMAGES_VALUE} is [' + variables.allowedImages.join(', ') + '] "
        "(an entry ending in / admits the path below it; any other names one repository, tag or digest)'",
    ),
)


# --- the chart's copy ------------------------------------------------------------------------------

_GENERATED: Final = re.compile(
    r"({{/\* BEGIN GENERATED: admission [^\n]*\*/}}\n)(.*?)({{/\* END GENERATED: admission \*/}})", re.S
)


def _validation(v: Validation) -> dict[str, str]:
    message = {"messageExpression": v.message_expression} if v.message_expression else {}
    return {"expression": v.expression, "message": v.message, **message, "reason": "Forbidden"}


def policy_body(allowed_images: Sequence[str] = ()) -> dict[str, object]:
    """The policy's matchConstraints, variables and validations for this allowlist (the chart adds the
    ServiceAccount's matchCondition)."""
    return _body(cel_list(allowed_images))


def _body(allowed_images: str) -> dict[str, object]:
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
        "variables": [{"name": v.name, "expression": v.expression} for v in variables(allowed_images)],
        "validations": [_validation(v) for v in VALIDATIONS],
    }


def chart_section() -> str:
    """The ``define`` block of the chart: the policy's spec without its matchConditions, the allowlist templated
    from the chart's value."""
    body = yaml.safe_dump(_body(_ALLOWED_IMAGES_SLOT), sort_keys=False, width=100000)
    if body.count(_ALLOWED_IMAGES_SLOT) != 1:
        raise AssertionError(
            f"the allowlist's slot must appear once in the policy, not {body.count(_ALLOWED_IMAGES_SLOT)}"
        )
    body = body.replace(_ALLOWED_IMAGES_SLOT, _ALLOWED_IMAGES_TEMPLATE)
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
