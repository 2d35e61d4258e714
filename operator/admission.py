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

CEL sees one request, so a second policy on the same ServiceAccount
(``PARAM_VALIDATIONS``) reads each Job and StatefulSet against the PolicyServer
its label names, as the policy's param: its uid, its checkpoint source (where a
fetch sends its token), the Secrets, tolerations and environment its spec names.
A third policy (``AUTHOR_VALIDATIONS``, unless the chart's
``admissionPolicy.trustedAuthors``) holds every PolicyServer author, whoever
they are, to what creating a pod would give them, asking the API server's
``authorizer`` with the requesting user's rights.  docs/operator.md ("Threat
model", "Security") says who may do what and what that leaves.

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
    API_VERSION,
    CHECKPOINT_TOKEN_DIR,
    ENTRYPOINT,
    ENV_HF_TOKEN,
    GROUP,
    KIND,
    LABEL_MANAGED_BY,
    LABEL_POLICYSERVER,
    MANAGED_BY,
    PLURAL,
)
from policy_operator.operator import rbac
from policy_operator.operator.manifests import COMPILE_KEY_DATA, TOKEN_FILE, Names
from policy_operator.operator.spec import (
    COMPILE_KEY_DIR,
    OPERATOR_ENV,
    REFUSED_VOLUME_SOURCES,
    RESERVED_ENV_TEXT,
    RESERVED_MOUNT_PATHS,
    SERVER_HUB_ENV,
    reserved_env_cel,
)
from policy_operator.serve_flags import COMPILE_KEY_FLAG

# the subcommands the operator's containers run: fetch (the fetch Job, perPod init), checkpoint (verify, prune), serve
SUBCOMMANDS: Final = ("fetch", "checkpoint", "serve")

# (API group, version, resource) the policy matches; CREATE and UPDATE (a server-side apply is either)
RESOURCES: Final = (
    ("batch", "v1", "jobs"),
    ("apps", "v1", "statefulsets"),
    ("", "v1", "pods"),
    ("", "v1", "secrets"),  # create only (RBAC): a PolicyServer's compile key
)


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
    Variable("isSecret", "object.kind == 'Secret'"),
    Variable("noTemplate", "variables.isPod || variables.isSecret"),
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
            "variables.noTemplate || size(variables.allowedImages) == 0 ? [] : "
            "variables.containers.map(c, has(c.image) ? c.image : '')"
            f".filter(i, !variables.allowedImages.exists(p, {_MATCHES}))",
        ),
    )


def variables(allowed_images: str = cel_list(())) -> tuple[Variable, ...]:
    """The policy's variables; ``allowed_images`` is the allowlist's CEL list literal."""
    return (*_SHAPE_VARIABLES, *_image_variables(allowed_images))


_DECLARED = "variables.declaredSecrets"
COMPILE_KEY_SUFFIX: Final = Names("").compile_key  # "-compile-key"
_ENV_PAIRS = [f"{k}={v}" for k, v in {**OPERATOR_ENV, **SERVER_HUB_ENV}.items()]
_CHECKPOINT_TOKEN = f"{CHECKPOINT_TOKEN_DIR}/{TOKEN_FILE}"
# the flags that name a Secret's file, and the one file each may name (a stolen token must not point the checkpoint
# token or the compile key at a file of its choosing)
# (flag, the shortest prefix argparse would take for it, the file): serve and fetch have no other flag so starting
_KEY_FILES = (
    ("--token-file", "--to", _CHECKPOINT_TOKEN),
    (COMPILE_KEY_FLAG, COMPILE_KEY_FLAG[:11], f"{COMPILE_KEY_DIR}/{TOKEN_FILE}"),
)


def _key_file_once(flag: str, prefix: str, path: str) -> str:
    """CEL on container ``c``: ``flag`` never as ``flag=...`` nor an abbreviation, at most once, with ``path``."""
    stem = json.dumps(prefix)
    return (
        f"c.command.all(w, !w.startsWith({stem}) || w == {json.dumps(flag)}) && "
        f"size(c.command.filter(w, w == {json.dumps(flag)})) <= 1 && "
        f"(!({json.dumps(flag)} in c.command) || {json.dumps(path)} in c.command)"
    )


def reserved_mount_cel(path: str) -> str:
    """CEL: the mount path expression ``path`` is at, under or above one of ``spec.RESERVED_MOUNT_PATHS``."""
    return (
        f"({path} == '/' || {json.dumps(list(RESERVED_MOUNT_PATHS))}.exists(r, {path} == r || "
        f"{path}.startsWith(r + '/') || r.startsWith({path}.endsWith('/') ? {path} : {path} + '/')))"
    )


_CONTAINER_CONTEXT = (
    "has(c.securityContext) && has(c.securityContext.allowPrivilegeEscalation) && "
    "!c.securityContext.allowPrivilegeEscalation && "
    "(!has(c.securityContext.privileged) || !c.securityContext.privileged) && "
    "(!has(c.securityContext.runAsUser) || c.securityContext.runAsUser != 0) && "
    "has(c.securityContext.capabilities) && !has(c.securityContext.capabilities.add) && "
    "has(c.securityContext.capabilities.drop) && 'ALL' in c.securityContext.capabilities.drop && "
    "(!has(c.ports) || c.ports.all(p, !has(p.hostPort)))"
)

VALIDATIONS: tuple[Validation, ...] = (
    Validation(
        f"variables.isPod || ({_labels} && object.metadata.labels[{json.dumps(LABEL_MANAGED_BY)}] "
        f"== {json.dumps(MANAGED_BY)} && {json.dumps(LABEL_POLICYSERVER)} in object.metadata.labels)",
        f"the operator's ServiceAccount creates only Jobs, StatefulSets and Secrets labelled {LABEL_MANAGED_BY}={MANAGED_BY} "
        f"and {LABEL_POLICYSERVER}",
    ),
    Validation(
        "variables.isPod || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists_one(r, "
        f"r.apiVersion.startsWith({json.dumps(GROUP + '/')}) && r.kind == {json.dumps(KIND)} && "
        "has(r.controller) && r.controller && "
        f"r.name == object.metadata.labels[{json.dumps(LABEL_POLICYSERVER)}]))",
        f"the operator's ServiceAccount creates only Jobs, StatefulSets and Secrets controlled by the {KIND} their "
        f"{LABEL_POLICYSERVER} label names",
    ),
    Validation(
        f"!variables.isSecret || (object.metadata.name == object.metadata.labels[{json.dumps(LABEL_POLICYSERVER)}] + "
        f"{json.dumps(COMPILE_KEY_SUFFIX)} && object.type == 'Opaque' && "
        f"(!has(object.data) || object.data.all(k, k == {json.dumps(COMPILE_KEY_DATA)})) && "
        f"(!has(object.stringData) || object.stringData.all(k, k == {json.dumps(COMPILE_KEY_DATA)})))",
        f"the operator's ServiceAccount creates only Opaque Secrets named <policyserver>{COMPILE_KEY_SUFFIX} holding "
        f"one key, {COMPILE_KEY_DATA} (a PolicyServer's compile key)",
    ),
    Validation(
        "!variables.isPod || (request.operation == 'UPDATE' && object.spec == oldObject.spec)",
        "the operator's ServiceAccount never creates a pod and never changes a pod's spec (it only annotates them)",
    ),
    Validation(
        "variables.noTemplate || "
        f"variables.containers.all(c, has(c.command) && size(c.command) >= 2 && c.command[0] == {json.dumps(ENTRYPOINT)}"
        f" && c.command[1] in {json.dumps(list(SUBCOMMANDS))} && (!has(c.args) || size(c.args) == 0))",
        f"every container of the operator's workloads runs `{ENTRYPOINT} {'|'.join(SUBCOMMANDS)}` (command, no args)",
    ),
    Validation(
        f"variables.noTemplate || variables.volumes.all(v, {_NO_HOST_SOURCE})",
        "the operator's workloads mount no hostPath and no other volume that reaches the node or storage by address",
    ),
    Validation(
        "variables.noTemplate || (has(variables.podSpec.automountServiceAccountToken) && "
        "!variables.podSpec.automountServiceAccountToken)",
        "the operator's workloads mount no ServiceAccount token (automountServiceAccountToken: false)",
    ),
    Validation(
        f"variables.noTemplate || variables.volumes.all(v, !has(v.secret) || v.secret.secretName in {_DECLARED}) && "
        "variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || v.projected.sources.all(s, "
        f"!has(s.secret) || s.secret.name in {_DECLARED})) && "
        "variables.containers.all(c, (!has(c.env) || c.env.all(e, !has(e.valueFrom) || "
        f"!has(e.valueFrom.secretKeyRef) || e.valueFrom.secretKeyRef.name in {_DECLARED})) && "
        f"(!has(c.envFrom) || c.envFrom.all(f, !has(f.secretRef) || f.secretRef.name in {_DECLARED})))",
        f"every Secret the pod template names must be listed in the workload's {ANNOTATION_SECRETS} annotation "
        "(the Secrets its PolicyServer's spec names)",
    ),
    Validation(
        "variables.noTemplate || ("
        "!(has(variables.podSpec.hostNetwork) && variables.podSpec.hostNetwork) && "
        "!(has(variables.podSpec.hostPID) && variables.podSpec.hostPID) && "
        "!(has(variables.podSpec.hostIPC) && variables.podSpec.hostIPC) && "
        "!(has(variables.podSpec.hostUsers) && variables.podSpec.hostUsers) && !has(variables.podSpec.nodeName) && "
        "has(variables.podSpec.securityContext) && has(variables.podSpec.securityContext.runAsNonRoot) && "
        "variables.podSpec.securityContext.runAsNonRoot && "
        "(!has(variables.podSpec.securityContext.runAsUser) || variables.podSpec.securityContext.runAsUser != 0) && "
        "(!has(variables.podSpec.tolerations) || variables.podSpec.tolerations.all(t, has(t.key) && t.key != '')) && "
        f"variables.containers.all(c, {_CONTAINER_CONTEXT}))",
        "the operator's workloads share no host namespace, name no node, tolerate no taint by an empty key, run as "
        "non-root, and every container drops ALL capabilities, adds none, is not privileged, cannot escalate and "
        "opens no host port",
    ),
    Validation(
        "variables.noTemplate || (variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || "
        "v.projected.sources.all(s, !has(s.serviceAccountToken))) && "
        f"variables.volumes.all(v, !has(v.csi) || !has(v.csi.nodePublishSecretRef) || "
        f"v.csi.nodePublishSecretRef.name in {_DECLARED}))",
        "the operator's workloads mount no projected serviceAccountToken source, and a csi volume's nodePublishSecretRef "
        f"must be listed in the {ANNOTATION_SECRETS} annotation",
    ),
    Validation(
        "variables.noTemplate || variables.containers.all(c, (!has(c.env) || c.env.all(e, "
        f"!{reserved_env_cel('e.name')} || (has(e.value) && (e.name + '=' + e.value) in {json.dumps(_ENV_PAIRS)}) || "
        f"(e.name == {json.dumps(ENV_HF_TOKEN)} && has(e.valueFrom)))) && "
        "(!has(c.volumeMounts) || c.volumeMounts.all(m, "
        f"!{reserved_mount_cel('m.mountPath')})))",
        f"the operator's containers set no environment name the interpreter or loader reads ({RESERVED_ENV_TEXT}) "
        "other than the operator's own values, and mount nothing at, under or above "
        f"{', '.join(RESERVED_MOUNT_PATHS)}",
    ),
    Validation(
        "variables.noTemplate || variables.containers.all(c, !has(c.command) || ("
        + " && ".join(_key_file_once(*key_file) for key_file in _KEY_FILES)
        + " && (size(c.command) < 3 || c.command[1] != 'checkpoint' || c.command[2] in ['verify', 'prune'])))",
        "the operator's commands pass "
        + " and ".join(f"{flag} only once, as `{flag} {path}`" for flag, _, path in _KEY_FILES)
        + " (the operator's own Secret mounts) and run `policyserver checkpoint verify|prune` only",
    ),
    Validation(
        "size(variables.refusedImages) == 0",
        f"every container's image of the operator's workloads must be one that {ALLOWED_IMAGES_VALUE} admits",
        "'image ' + variables.refusedImages.join(', ') + ' is not allowed: "
        f"{ALLOWED_IMAGES_VALUE} is [' + variables.allowedImages.join(', ') + '] "
        "(an entry ending in / admits the path below it; any other names one repository, tag or digest)'",
    ),
)


# --- PolicyServer authors -------------------------------------------------------------------------
#
# The second policy: on every PolicyServer created, or updated with a new spec, by anyone (the operator never
# changes a spec), unless the chart says authors are trusted (admissionPolicy.trustedAuthors).  It refuses what
# would give the author more than creating a pod would: another ServiceAccount's identity, a Secret they could not
# read themselves (the API server's own authorizer answers for the requesting user), their own text written as a
# file into the pod, another PolicyServer's cache, a mount over the interpreter's code.

TRUSTED_AUTHORS_VALUE: Final = "admissionPolicy.trustedAuthors"
SERVICE_ACCOUNTS_VALUE: Final = "admissionPolicy.allowedServiceAccounts"
_SERVICE_ACCOUNTS_SLOT: Final = "ALLOWED_SERVICE_ACCOUNTS_FROM_VALUES"
_SERVICE_ACCOUNTS_TEMPLATE: Final = f"{{{{ .Values.{SERVICE_ACCOUNTS_VALUE} | default list | toJson | quote }}}}"
CACHE_CLAIM_SUFFIX: Final = "-cache"  # manifests.Names.pvc: a shared cache claim is <name>-cache
PER_POD_CLAIM_PREFIX: Final = "checkpoint-cache-"  # a perPod claim: <volumeClaimTemplate>-<name>-<ordinal>


def _readable(name: str) -> str:
    """CEL: the requesting user may get the Secret ``name`` (an expression) in the request's namespace."""
    return f"authorizer.group('').resource('secrets').namespace(request.namespace).name({name}).check('get').allowed()"


def _unreadable_volume(v: str) -> str:
    return (
        f"(has({v}.secret) && has({v}.secret.secretName) && !{_readable(f'{v}.secret.secretName')}) || "
        f"(has({v}.projected) && has({v}.projected.sources) && {v}.projected.sources.exists(s, has(s.secret) && "
        f"has(s.secret.name) && !{_readable('s.secret.name')})) || "
        f"(has({v}.csi) && has({v}.csi.nodePublishSecretRef) && !{_readable(f'{v}.csi.nodePublishSecretRef.name')})"
    )


def _author_text_as_file(items: str) -> str:
    return (
        f"{items}.exists(i, has(i.fieldRef) && (i.fieldRef.fieldPath.startsWith('metadata.annotations') || "
        "i.fieldRef.fieldPath.startsWith('metadata.labels')))"
    )


_SPEC = "object.spec"

AUTHOR_VARIABLES: tuple[Variable, ...] = (
    Variable("volumes", f"has({_SPEC}.volumes) ? {_SPEC}.volumes : []"),
    Variable("mounts", f"has({_SPEC}.volumeMounts) ? {_SPEC}.volumeMounts : []"),
    Variable(
        "env",
        f"(has({_SPEC}.runtime) && has({_SPEC}.runtime.env) ? {_SPEC}.runtime.env : []) + "
        f"(has({_SPEC}.checkpoint.fetchJob) && has({_SPEC}.checkpoint.fetchJob.env) ? "
        f"{_SPEC}.checkpoint.fetchJob.env : [])",
    ),
    Variable(
        "refSecrets",
        f"(has({_SPEC}.checkpoint.secretRef) ? [{_SPEC}.checkpoint.secretRef.name] : []) + "
        f"(has({_SPEC}.auth) && has({_SPEC}.auth.secretRef) ? [{_SPEC}.auth.secretRef.name] : []) + "
        f"(has({_SPEC}.imagePullSecrets) ? {_SPEC}.imagePullSecrets.map(r, r.name) : [])",
    ),
)


def author_variables(allowed_service_accounts: str = cel_list(())) -> tuple[Variable, ...]:
    return (Variable("allowedServiceAccounts", allowed_service_accounts), *AUTHOR_VARIABLES, *UNREADABLE_VARIABLES)


_WHO = "request.userInfo.username"

# the Secrets the requesting user may not get (authorizer is not available to a messageExpression: the
# messages are fixed texts naming the fields)
UNREADABLE_VARIABLES: tuple[Variable, ...] = (
    Variable("unreadableRefs", f"variables.refSecrets.filter(n, !{_readable('n')})"),
    Variable(
        "unreadableEnv",
        "variables.env.filter(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef) && "
        f"!{_readable('e.valueFrom.secretKeyRef.name')}).map(e, e.name)",
    ),
    Variable("unreadableVolumes", f"variables.volumes.filter(v, {_unreadable_volume('v')}).map(v, v.name)"),
)

AUTHOR_VALIDATIONS: tuple[Validation, ...] = (
    Validation(
        f"!has({_SPEC}.serviceAccountName) || {_SPEC}.serviceAccountName in variables.allowedServiceAccounts",
        f"spec.serviceAccountName: the pods run as the namespace's default ServiceAccount unless "
        f"{SERVICE_ACCOUNTS_VALUE} lists the one named (a PolicyServer must not lend its author another identity)",
        f"'spec.serviceAccountName: ' + {_SPEC}.serviceAccountName + ' is not in {SERVICE_ACCOUNTS_VALUE} [' + "
        "variables.allowedServiceAccounts.join(', ') + ']: a PolicyServer must not lend its author the identity of "
        "another ServiceAccount'",
    ),
    Validation(
        "size(variables.unreadableRefs) == 0",
        "spec.checkpoint.secretRef, spec.auth.secretRef, spec.imagePullSecrets: a Secret the requesting user may "
        "not get themselves",
    ),
    Validation(
        "size(variables.unreadableEnv) == 0",
        "spec.runtime.env, spec.checkpoint.fetchJob.env: valueFrom.secretKeyRef of a Secret the requesting user "
        "may not get themselves",
    ),
    Validation(
        "size(variables.unreadableVolumes) == 0",
        "spec.volumes: a secret, projected secret or csi nodePublishSecretRef the requesting user may not get "
        "themselves",
    ),
    Validation(
        "!variables.volumes.exists(v, (has(v.downwardAPI) && has(v.downwardAPI.items) && "
        f"{_author_text_as_file('v.downwardAPI.items')}) || (has(v.projected) && has(v.projected.sources) && "
        "v.projected.sources.exists(s, has(s.downwardAPI) && has(s.downwardAPI.items) && "
        f"{_author_text_as_file('s.downwardAPI.items')})))",
        "spec.volumes: a downwardAPI file of the pod's annotations or labels: the PolicyServer's author writes them "
        "(podAnnotations, podLabels), and their text must not become a file the pod can be told to run",
    ),
    Validation(
        "variables.volumes.all(v, !has(v.projected) || !has(v.projected.sources) || "
        "v.projected.sources.all(s, !has(s.serviceAccountToken)))",
        "spec.volumes: a projected serviceAccountToken: the pods need no API access, and a token would lend the "
        "PolicyServer's author the ServiceAccount's identity",
    ),
    Validation(
        "variables.volumes.all(v, !has(v.persistentVolumeClaim) || "
        f"!(v.persistentVolumeClaim.claimName.endsWith({json.dumps(CACHE_CLAIM_SUFFIX)}) || "
        f"v.persistentVolumeClaim.claimName.startsWith({json.dumps(PER_POD_CLAIM_PREFIX)}))) && "
        f"(!has({_SPEC}.storage) || !has({_SPEC}.storage.existingClaim) || "
        f"{_SPEC}.storage.existingClaim == object.metadata.name + {json.dumps(CACHE_CLAIM_SUFFIX)} || "
        f"!({_SPEC}.storage.existingClaim.endsWith({json.dumps(CACHE_CLAIM_SUFFIX)}) || "
        f"{_SPEC}.storage.existingClaim.startsWith({json.dumps(PER_POD_CLAIM_PREFIX)})))",
        f"spec.volumes[].persistentVolumeClaim, spec.storage.existingClaim: a claim named like a PolicyServer's "
        f"cache (<name>{CACHE_CLAIM_SUFFIX}, {PER_POD_CLAIM_PREFIX}*) holds another PolicyServer's checkpoints and "
        "compile artifacts: rename your own claim",
    ),
    Validation(
        f"!variables.mounts.exists(m, {reserved_mount_cel('m.mountPath')})",
        "spec.volumeMounts: a mount at, under or above a directory the interpreter or the loader reads code from "
        f"({', '.join(RESERVED_MOUNT_PATHS)})",
    ),
)


def _author_body(allowed_service_accounts: str) -> dict[str, object]:
    return {
        "matchConstraints": {
            "resourceRules": [
                {
                    "apiGroups": [GROUP],
                    "apiVersions": ["*"],
                    "resources": [PLURAL],
                    "operations": ["CREATE", "UPDATE"],
                }
            ]
        },
        # a metadata-only update (kopf's finalizer, labels) changes no pod: only a new spec is checked
        "matchConditions": [
            {
                "name": "spec-changes",
                "expression": "request.operation == 'CREATE' || object.spec != oldObject.spec",
            }
        ],
        "variables": [{"name": v.name, "expression": v.expression} for v in author_variables(allowed_service_accounts)],
        "validations": [_validation(v) for v in AUTHOR_VALIDATIONS],
    }


def author_policy_body(allowed_service_accounts: Sequence[str] = ()) -> dict[str, object]:
    """The PolicyServer authors' policy for this ServiceAccount allowlist."""
    return _author_body(cel_list(allowed_service_accounts))


# --- the PolicyServer a child names ----------------------------------------------------------------
#
# A second policy on the operator's ServiceAccount reads its Jobs and StatefulSets against the PolicyServer their
# label names, its param (paramKind PolicyServer; the binding selects every PolicyServer of the request's
# namespace and each is one evaluation, so each rule below holds trivially for all but the one named).  A policy of
# its own: a binding with params finds none in a namespace without PolicyServers, and there it must admit
# (parameterNotFoundAction Allow) while the first policy still checks every request.  CEL over the request alone cannot tell where a fetch sends its token nor whose Secrets a
# workload declares; with the PolicyServer it can: the fetch's source is the PolicyServer's own (the token goes
# nowhere else), every declared Secret is one its spec names (or its compile key), every toleration one it lists,
# every environment entry one it sets.

_MINE = (
    f"has(object.metadata.labels) && {json.dumps(LABEL_POLICYSERVER)} in object.metadata.labels && "
    f"object.metadata.labels[{json.dumps(LABEL_POLICYSERVER)}] == params.metadata.name"
)
_PS = "params.spec"


def _names_secret(n: str) -> str:
    """CEL: the param PolicyServer's spec names the Secret ``n`` (or it is its compile key)."""
    return (
        f"{n} == params.metadata.name + {json.dumps(COMPILE_KEY_SUFFIX)} || "
        f"(has({_PS}.checkpoint.secretRef) && {_PS}.checkpoint.secretRef.name == {n}) || "
        f"(has({_PS}.auth) && has({_PS}.auth.secretRef) && {_PS}.auth.secretRef.name == {n}) || "
        f"variables.psVolumes.exists(v, (has(v.secret) && has(v.secret.secretName) && v.secret.secretName == {n}) || "
        f"(has(v.projected) && has(v.projected.sources) && v.projected.sources.exists(s, has(s.secret) && "
        f"has(s.secret.name) && s.secret.name == {n})) || (has(v.csi) && has(v.csi.nodePublishSecretRef) && "
        f"v.csi.nodePublishSecretRef.name == {n})) || "
        f"variables.psEnv.exists(e, has(e.valueFrom) && has(e.valueFrom.secretKeyRef) && "
        f"e.valueFrom.secretKeyRef.name == {n})"
    )


PARAM_VARIABLES: tuple[Variable, ...] = (
    Variable("mine", f"!variables.noTemplate && {_MINE}"),
    Variable("psVolumes", f"has({_PS}.volumes) ? {_PS}.volumes : []"),
    Variable(
        "psEnv",
        f"(has({_PS}.runtime) && has({_PS}.runtime.env) ? {_PS}.runtime.env : []) + "
        f"(has({_PS}.checkpoint.fetchJob) && has({_PS}.checkpoint.fetchJob.env) ? {_PS}.checkpoint.fetchJob.env : [])",
    ),
)

PARAM_VALIDATIONS: tuple[Validation, ...] = (
    Validation(
        "!variables.mine || (has(object.metadata.ownerReferences) && object.metadata.ownerReferences.exists(r, "
        "has(r.controller) && r.controller && r.uid == params.metadata.uid))",
        f"the operator's workloads are controlled by the {KIND} their {LABEL_POLICYSERVER} label names (its uid)",
    ),
    Validation(
        "!variables.mine || variables.containers.all(c, !has(c.command) || size(c.command) < 3 || "
        f"c.command[1] != 'fetch' || c.command[2] == {_PS}.checkpoint.source)",
        f"a fetch downloads the {KIND}'s own spec.checkpoint.source (its token goes to no other host)",
    ),
    Validation(
        f"!variables.mine || variables.declaredSecrets.all(n, {_names_secret('n')})",
        f"every Secret a workload declares ({ANNOTATION_SECRETS}) is one its {KIND}'s spec names, or its compile key",
    ),
    Validation(
        "!variables.mine || !has(variables.podSpec.tolerations) || variables.podSpec.tolerations.all(t, "
        f"has({_PS}.tolerations) && {_PS}.tolerations.exists(p, p == t))",
        f"every toleration of the operator's workloads is one its {KIND}'s spec.tolerations lists",
    ),
    Validation(
        "!variables.mine || variables.containers.all(c, !has(c.env) || c.env.all(e, "
        f"{reserved_env_cel('e.name')} || variables.psEnv.exists(p, p.name == e.name && "
        "(has(p.value) ? has(e.value) && p.value == e.value : !has(e.value)))))",
        f"every environment entry of the operator's workloads is the operator's own or one its {KIND}'s spec sets "
        "(runtime.env, checkpoint.fetchJob.env)",
    ),
)


def param_policy_body() -> dict[str, object]:
    """The children policy: the operator's Jobs and StatefulSets read against their PolicyServer (the chart adds
    the ServiceAccount's matchCondition and a binding that selects every PolicyServer of the namespace; with none
    there, nothing is read and the first policy still holds)."""
    return {
        "paramKind": {"apiVersion": API_VERSION, "kind": KIND},
        "matchConstraints": {
            "resourceRules": [
                {"apiGroups": [g], "apiVersions": [v], "resources": [r], "operations": ["CREATE", "UPDATE"]}
                for g, v, r in RESOURCES
                if r in ("jobs", "statefulsets")
            ]
        },
        "variables": [{"name": v.name, "expression": v.expression} for v in (*_SHAPE_VARIABLES, *PARAM_VARIABLES)],
        "validations": [_validation(v) for v in PARAM_VALIDATIONS],
    }


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
    authors = yaml.safe_dump(_author_body(_SERVICE_ACCOUNTS_SLOT), sort_keys=False, width=100000)
    if authors.count(_SERVICE_ACCOUNTS_SLOT) != 1:
        raise AssertionError("the ServiceAccount allowlist's slot must appear once in the authors' policy")
    authors = authors.replace(_SERVICE_ACCOUNTS_SLOT, _SERVICE_ACCOUNTS_TEMPLATE)
    params = yaml.safe_dump(param_policy_body(), sort_keys=False, width=100000)
    return (
        f'{{{{- define "policy-operator.admission.spec" -}}}}\n{body}{{{{- end }}}}\n'
        f'{{{{- define "policy-operator.admission.authors" -}}}}\n{authors}{{{{- end }}}}\n'
        f'{{{{- define "policy-operator.admission.children" -}}}}\n{params}{{{{- end }}}}\n'
    )


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
