"""The PolicyServer CRD, the Helm chart and the operator's RBAC against a real Kubernetes control plane.

Everything here talks to the real etcd + kube-apiserver + controller-manager
+ scheduler of ``tests/support/control_plane.py`` (session fixture
``control_plane``) with the kubectl of the same release: what the real
server does at admission (structural schema, CEL rules and their cost
budget, defaults, strict field validation), ``kubectl explain``, a real
``helm install`` through the Helm SDK, and the operator running as the
chart's own ServiceAccount with RBAC enforced.  No node is needed: pods stay
Pending (the node is ``tests/support/local_node*.py``'s business).

The examples come from where users read them: valid ones from
``examples/``, invalid and accepted ones from ``docs/crd.md`` (a fenced ``yaml`` block
holding a PolicyServer whose first comment says "accepted" or "refused", else
under a heading that says "invalid", "refused" or "accepted"; the field path
the server must name is the first ``spec.…``/``metadata.…`` path written in
the block's comments, else in the prose just before it).
"""

from __future__ import annotations

import copy
import hashlib
import json
import re
import shutil
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml
from kubernetes.client import ApiException, AuthorizationV1Api, BatchV1Api, CoreV1Api, CustomObjectsApi

from policy_operator import constants as C
from policy_operator.operator import rbac
from tests.support.control_plane import ControlPlane, ControlPlaneError
from tests.support.net import free_port, wait_for

pytestmark = pytest.mark.cluster

REPO = Path(__file__).resolve().parents[1]
CRD_FILE = REPO / "crds" / "policyservers.yaml"
CRD_NAME = f"{C.PLURAL}.{C.GROUP}"
CHART = REPO / "charts" / "policy-operator"
DOC = REPO / "docs" / "crd.md"
EXAMPLES = sorted((REPO / "examples").glob("policyserver-*.yaml"))
VENV_BIN = Path(sys.executable).parent
OPERATOR_START_S = 60.0
RECONCILE_S = 90.0

# Verbs kubectl auth can-i is asked about for every resource the operator touches.
ALL_VERBS = ("get", "list", "watch", "create", "update", "patch", "delete", "deletecollection")


# --- examples -----------------------------------------------------------------------------
@dataclass(frozen=True)
class DocExample:
    title: str
    manifest: dict[str, Any]
    field_path: str | None

    def __str__(self) -> str:
        return self.title


_FENCE = re.compile(r"^```ya?ml[ \t]*\n(.*?)^```[ \t]*$", re.S | re.M)
_HEADING = re.compile(r"^#+\s+(.*)$", re.M)
_PATH = re.compile(r"\b((?:spec|metadata)(?:\.[A-Za-z][A-Za-z0-9]*(?:\[\d*\])?)+)")


def doc_examples() -> tuple[list[DocExample], list[DocExample]]:
    """The invalid and the accepted PolicyServers of docs/crd.md, read at test time so the doc and the test never
    drift.  A block's own first comment decides ("# accepted: ..." or "# refused: ..."), else its heading."""
    text = DOC.read_text()
    invalid: list[DocExample] = []
    accepted: list[DocExample] = []
    heading, previous_end = "", 0
    for match in _FENCE.finditer(text):
        prose, block = text[previous_end : match.start()], match.group(1)
        previous_end = match.end()
        headings = _HEADING.findall(prose)  # only outside fences: a YAML comment is no heading
        heading = headings[-1].strip() if headings else heading
        comments = "\n".join(line for line in block.splitlines() if line.lstrip().startswith("#"))
        verdict = re.match(r"#\s*(accepted|refused|invalid|rejected)\b", comments.lstrip(), re.I)
        said = verdict.group(1).lower() if verdict else heading.lower()
        found = accepted if said.startswith("accepted") else invalid
        if found is invalid and not re.search(r"invalid|refused|rejected", said):
            continue
        lead_in = prose.strip().split("\n\n")[-1]
        path = _PATH.search(comments) or _PATH.search(lead_in)
        for doc in yaml.safe_load_all(block):
            if isinstance(doc, dict) and doc.get("kind") == C.KIND:
                name = doc.get("metadata", {}).get("name", f"example-{len(found)}")
                where = path.group(1) if path and found is invalid else None
                found.append(DocExample(f"{name} ({where or 'no path'})" if found is invalid else name, doc, where))
    return invalid, accepted


INVALID, ACCEPTED = doc_examples()


def crd() -> dict[str, Any]:
    return yaml.safe_load(CRD_FILE.read_text())


def spec_schema() -> dict[str, Any]:
    (version,) = [v for v in crd()["spec"]["versions"] if v.get("storage")]
    return version["schema"]["openAPIV3Schema"]["properties"]["spec"]


def schema_at(path: str) -> dict[str, Any]:
    node = spec_schema()
    for part in path.split(".")[1:]:
        node = node.get("items", node)["properties"][part]
    return node


def ps_api(cp: ControlPlane) -> CustomObjectsApi:
    return CustomObjectsApi(cp.api_client)


def get_ps(cp: ControlPlane, namespace: str, name: str) -> dict[str, Any]:
    obj = ps_api(cp).get_namespaced_custom_object(C.GROUP, C.VERSION, namespace, C.PLURAL, name)
    assert isinstance(obj, dict), obj  # custom objects come back as their JSON (typed object by the client)
    return obj


def apply_stdin(
    cp: ControlPlane, namespace: str, manifest: dict[str, Any], *extra: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    return cp.kubectl("apply", "-n", namespace, "-f", "-", *extra, input=json.dumps(manifest), check=check)


# --- fixtures -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane) -> ControlPlane:
    """The session's control plane with the PolicyServer CRD installed and Established."""
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD_FILE))
    wait_established(control_plane)
    return control_plane


def wait_established(cluster: ControlPlane, timeout: float = 60) -> dict[str, str]:
    """The CRD's conditions once Established.

    Not ``kubectl wait``: right after a create the CRD has no
    ``status.conditions`` yet, and kubectl 1.37's wait fails on that instead
    of waiting.
    """

    def conditions() -> dict[str, str] | None:
        stored = json.loads(cluster.kubectl("get", f"crd/{CRD_NAME}", "-o", "json").stdout)
        found = {c["type"]: c["status"] for c in stored.get("status", {}).get("conditions") or []}
        return found if found.get("Established") == "True" else None

    return wait_for(conditions, timeout, interval=0.5, what=f"{CRD_NAME} Established")


@pytest.fixture
def namespace(cluster: ControlPlane, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of this test's own, deleted afterwards without waiting (the namespace controller finishes it)."""
    digest = hashlib.sha256(request.node.nodeid.encode()).hexdigest()[:8]
    name = f"{re.sub(r'[^a-z0-9]+', '-', request.node.originalname.lower())[:40].strip('-')}-{digest}"
    cluster.create_namespace(name)
    yield name
    cluster.kubectl("delete", "namespace", name, "--wait=false", "--ignore-not-found", check=False)


@pytest.fixture(scope="module")
def admission_namespace(cluster: ControlPlane) -> Iterator[str]:
    """One namespace for the server-side dry runs (they create nothing)."""
    cluster.create_namespace("cp-admission")
    yield "cp-admission"
    cluster.kubectl("delete", "namespace", "cp-admission", "--wait=false", "--ignore-not-found", check=False)


# --- the control plane itself --------------------------------------------------------------
def test_kubectl_matches_the_server_and_every_component_runs(control_plane: ControlPlane) -> None:
    versions = json.loads(control_plane.kubectl("version", "-o", "json").stdout)
    assert versions["clientVersion"]["gitVersion"] == versions["serverVersion"]["gitVersion"], versions
    go_mod = (REPO / "tests" / "cluster" / "go.mod").read_text()
    assert re.search(rf"k8s.io/kubernetes {re.escape(versions['serverVersion']['gitVersion'])}\b", go_mod)

    assert control_plane.kubectl("get", "--raw", "/readyz").stdout == "ok"
    # controller-manager: the ServiceAccount controller fills a new namespace
    control_plane.create_namespace("cp-components")
    sa = CoreV1Api(control_plane.api_client).read_namespaced_service_account("default", "cp-components")
    assert sa.metadata is not None and sa.metadata.name == "default"
    # scheduler: with no node able to take it, a pod is marked unschedulable by the scheduler itself
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "waits"},
        "spec": {
            "nodeSelector": {"policyoperator.io/test": "no-such-node"},
            "containers": [{"name": "c", "image": "registry.invalid/none:0"}],
        },
    }
    control_plane.kubectl("apply", "-n", "cp-components", "-f", "-", input=json.dumps(pod))
    control_plane.kubectl(
        "wait", "-n", "cp-components", "pod/waits", "--for=condition=PodScheduled=false", "--timeout=60s"
    )
    status = CoreV1Api(control_plane.api_client).read_namespaced_pod("waits", "cp-components").status
    assert status is not None and status.conditions is not None
    (scheduled,) = [c for c in status.conditions if c.type == "PodScheduled"]
    assert scheduled.reason == "Unschedulable", scheduled
    control_plane.kubectl("delete", "namespace", "cp-components", "--wait=false")

    # everything on loopback: no component listens anywhere else
    assert shutil.which("ss"), "iproute2's ss lists listening sockets"
    ss = subprocess.run(["ss", "-Htlnp"], capture_output=True, text=True, check=True).stdout
    assert any(f"pid={control_plane.components[0].pid}," in line for line in ss.splitlines()), ss
    pids = {str(c.pid) for c in control_plane.components}
    for line in ss.splitlines():
        if any(f"pid={pid}," in line for pid in pids):
            assert line.split()[3].startswith("127.0.0.1:"), line


def test_a_second_control_plane_starts_and_stops_exactly_its_own_processes(
    control_plane: ControlPlane, tmp_path: Path
) -> None:
    """An apiserver alone (no controllers, no scheduler) next to the session's; stop() leaves the other running."""
    with ControlPlane(tmp_path, controllers=False, scheduler=False) as alone:
        components = list(alone.components)
        assert [c.name for c in components] == ["etcd", "kube-apiserver"]
        assert alone.url != control_plane.url
        names = alone.kubectl("get", "namespaces", "-o", "name").stdout.split()
        assert {"namespace/default", "namespace/kube-system"} <= set(names), names
    assert not any(c.alive() for c in components)
    assert not _processes_with_cwd(tmp_path)
    assert all(c.alive() for c in control_plane.components)
    assert control_plane.kubectl("get", "--raw", "/readyz").stdout == "ok"


def test_a_failed_start_leaves_no_process(tmp_path: Path) -> None:
    """etcd cannot bind a port that is taken: start() raises with etcd's log, and nothing it started survives."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        cp = ControlPlane(tmp_path, controllers=False, scheduler=False, ports={"etcd_client": taken.getsockname()[1]})
        with pytest.raises(ControlPlaneError, match="etcd exited while starting") as failure:
            cp.start()
    assert "address already in use" in str(failure.value)
    assert cp.components == []
    assert not _processes_with_cwd(tmp_path)


def _processes_with_cwd(path: Path) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if Path(entry / "cwd").resolve() == path.resolve():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


# --- the CRD ----------------------------------------------------------------------------
def test_the_crd_is_established_and_explained(cluster: ControlPlane) -> None:
    conditions = wait_established(cluster)
    # NonStructuralSchema would be a condition here; the CEL cost estimator refuses at create instead
    assert conditions.get("Established") == "True" and conditions.get("NamesAccepted") == "True", conditions
    assert "NonStructuralSchema" not in conditions

    # the apiserver publishes a new CRD's OpenAPI (what explain reads) a moment after Established
    explained = wait_for(
        lambda: cluster.kubectl("explain", f"{C.SINGULAR}.spec.parallelism").stdout,
        60,
        interval=0.5,
        what="kubectl explain once the CRD's OpenAPI is published",
    )
    description = schema_at("spec.parallelism")["description"]
    assert _words(description)[:8] == _words(explained.split("DESCRIPTION:")[1])[:8], explained
    for field in schema_at("spec.parallelism")["properties"]:
        assert re.search(rf"^\s+{field}\s+<", explained, re.M), (field, explained)
    short = cluster.kubectl("explain", f"{C.SHORT_NAME}.spec.parallelism.cfgp").stdout
    assert (
        _words(schema_at("spec.parallelism.cfgp")["description"])[:6] == _words(short.split("DESCRIPTION:")[1])[:6]
    ), short


def _words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z0-9]+", text)


def test_the_apiserver_really_checks_crd_schemas_and_cel_cost(cluster: ControlPlane) -> None:
    """The same server refuses a non-structural schema and a CEL rule over its cost budget (no stand-in does)."""

    def probe_crd(schema: dict[str, Any], validations: list[dict[str, str]] | None = None) -> str:
        spec = dict(schema, **({"x-kubernetes-validations": validations} if validations else {}))
        body = {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": {"name": "probes.cost.policyoperator.io"},
            "spec": {
                "group": "cost.policyoperator.io",
                "scope": "Namespaced",
                "names": {"plural": "probes", "singular": "probe", "kind": "Probe"},
                "versions": [
                    {
                        "name": "v1",
                        "served": True,
                        "storage": True,
                        "schema": {"openAPIV3Schema": {"type": "object", "properties": {"spec": spec}}},
                    }
                ],
            },
        }
        result = cluster.kubectl("create", "--dry-run=server", "-f", "-", input=json.dumps(body), check=False)
        assert result.returncode != 0, "the apiserver accepted a CRD it must refuse"
        return result.stderr

    unbounded: dict[str, Any] = {
        "type": "object",
        "properties": {"items": {"type": "array", "items": {"type": "string"}}},
    }
    quadratic = [{"rule": "self.items.all(a, self.items.all(b, a.matches(b)))"}]
    assert "exceeds budget" in probe_crd(unbounded, quadratic)
    bounded = copy.deepcopy(unbounded)
    bounded["properties"]["items"].update(maxItems=4, items={"type": "string", "maxLength": 8})
    # the same rule with bounded lists passes the estimator: the budget is what refused it
    body_ok = cluster.kubectl(
        "create",
        "--dry-run=server",
        "-o",
        "name",
        "-f",
        "-",
        check=False,
        input=json.dumps(
            {
                "apiVersion": "apiextensions.k8s.io/v1",
                "kind": "CustomResourceDefinition",
                "metadata": {"name": "probes.cost.policyoperator.io"},
                "spec": {
                    "group": "cost.policyoperator.io",
                    "scope": "Namespaced",
                    "names": {"plural": "probes", "singular": "probe", "kind": "Probe"},
                    "versions": [
                        {
                            "name": "v1",
                            "served": True,
                            "storage": True,
                            "schema": {
                                "openAPIV3Schema": {
                                    "type": "object",
                                    "properties": {"spec": dict(bounded, **{"x-kubernetes-validations": quadratic})},
                                }
                            },
                        }
                    ],
                },
            }
        ),
    )
    assert body_ok.returncode == 0, body_ok.stderr
    assert "type" in probe_crd({"properties": {"x": {"type": "string"}}})  # no type at the root: not structural


# --- admission --------------------------------------------------------------------------
def test_docs_crd_md_has_invalid_examples_with_field_paths() -> None:
    assert INVALID, f"{DOC.relative_to(REPO)} has no invalid PolicyServer example (see this module's docstring)"
    assert all(e.field_path for e in INVALID), [str(e) for e in INVALID if not e.field_path]


@pytest.mark.parametrize("example", INVALID, ids=str)
def test_invalid_doc_example_is_refused_at_admission(
    cluster: ControlPlane, admission_namespace: str, example: DocExample
) -> None:
    result = apply_stdin(cluster, admission_namespace, example.manifest, "--dry-run=server", check=False)
    assert result.returncode != 0, f"accepted by the apiserver: {example}\n{yaml.safe_dump(example.manifest)}"
    message = result.stderr
    assert (
        "is invalid" in message
        or "Invalid value" in message
        or "Unsupported value" in message
        or "unknown field" in message
    ), message
    assert example.field_path and example.field_path in message, (example.field_path, message)


def test_docs_crd_md_has_accepted_examples() -> None:
    """The reader is not blind: the doc's "Accepted" section is read as accepted, the rest of it as refused."""
    assert ACCEPTED and {"many-robots", "lerobot-eager"} <= {str(e) for e in ACCEPTED}, [str(e) for e in ACCEPTED]
    assert not {str(e) for e in ACCEPTED} & {e.manifest["metadata"]["name"] for e in INVALID}


@pytest.mark.parametrize("example", ACCEPTED, ids=str)
def test_accepted_doc_example_is_admitted(cluster: ControlPlane, admission_namespace: str, example: DocExample) -> None:
    result = apply_stdin(cluster, admission_namespace, example.manifest, "--dry-run=server", check=False)
    assert result.returncode == 0, f"refused by the apiserver: {example}\n{result.stderr}"


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_valid_example_is_accepted_and_defaulted(cluster: ControlPlane, namespace: str, path: Path) -> None:
    manifest = yaml.safe_load(path.read_text())
    cluster.kubectl("apply", "-n", namespace, "-f", str(path))  # kubectl's default: strict field validation
    stored = get_ps(cluster, namespace, manifest["metadata"]["name"])
    # the server filled in exactly the CRD's defaults, nested ones included, and kept everything given
    assert stored["spec"] == with_defaults(spec_schema(), manifest["spec"])
    assert stored["spec"]["parallelism"]["cfgp"] * stored["spec"]["parallelism"]["dp"] >= 1


def with_defaults(schema: dict[str, Any], value: Any) -> Any:
    """``value`` with the schema's ``default``s filled in top-down, as the apiserver's structural defaulting does."""
    if isinstance(value, dict) and "properties" in schema:
        out = dict(value)
        for name, sub in schema["properties"].items():
            if name not in out and "default" in sub:
                out[name] = copy.deepcopy(sub["default"])
            if name in out:
                out[name] = with_defaults(sub, out[name])
        return out
    if isinstance(value, list) and "items" in schema:
        return [with_defaults(schema["items"], item) for item in value]
    return value


def test_kubectl_delete_all_leaves_policyservers_alone(cluster: ControlPlane, namespace: str) -> None:
    """Not in the category ``all`` (nor are KServe's, the NIM Operator's or LeaderWorkerSet's resources): a
    ``kubectl delete all --all`` meant for a namespace's pods and Services keeps every PolicyServer."""
    manifest = yaml.safe_load(EXAMPLES[0].read_text())
    apply_stdin(cluster, namespace, manifest)
    listed = cluster.kubectl("get", "all", "-n", namespace, "-o", "name").stdout
    assert C.PLURAL not in listed and C.GROUP not in listed, listed
    cluster.kubectl("delete", "all", "--all", "-n", namespace, "--wait=false")
    assert get_ps(cluster, namespace, manifest["metadata"]["name"])["metadata"].get("deletionTimestamp") is None


def test_an_unknown_field_in_the_spec_is_refused_with_its_path(cluster: ControlPlane, namespace: str) -> None:
    manifest = yaml.safe_load(EXAMPLES[0].read_text())
    manifest["spec"]["parallelism"] = {"cfgp": 1, "gpusPerRank": 2}
    result = apply_stdin(cluster, namespace, manifest, check=False)
    assert result.returncode != 0
    assert 'unknown field "spec.parallelism.gpusPerRank"' in result.stderr, result.stderr


def test_pass_through_fields_do_what_the_crd_says(cluster: ControlPlane, namespace: str) -> None:
    """``affinity`` and ``env[].valueFrom`` are Kubernetes types passed through to pods.

    What the real server does depends only on the CRD's schema for them:
    with ``x-kubernetes-preserve-unknown-fields`` it keeps anything (the
    StatefulSet the operator makes from it is checked later, by the server,
    when the operator applies it); with the core/v1 types in the schema it
    refuses unknown or malformed fields at once, naming the full path.  The
    test reads which one the CRD chose and holds the server to it.
    """
    base = yaml.safe_load(EXAMPLES[0].read_text())
    cases = [  # (schema path, spec field, value, path the server names, what it says)
        (
            "spec.affinity",
            "affinity",
            {"nodeAffinity": {"requiredDuringScheduling": {"bogus": True}}},
            "spec.affinity.nodeAffinity.requiredDuringScheduling",
            "unknown field",
        ),
        (
            "spec.runtime.env",
            "runtime",
            {"env": [{"name": "A", "valueFrom": {"secretKeyRef": "not-an-object"}}]},
            "spec.runtime.env[0].valueFrom.secretKeyRef",
            "must be of type object",
        ),
        (
            "spec.runtime.env",
            "runtime",
            {"env": [{"name": "A", "valueFrom": {"secretKeyRef": {"name": "s"}}}]},
            "spec.runtime.env[0].valueFrom.secretKeyRef.key",
            "Required value",
        ),
    ]
    for i, (schema_path, field, value, error_path, says) in enumerate(cases):
        manifest = copy.deepcopy(base)
        manifest["metadata"]["name"] = f"pass-through-{i}"
        manifest["spec"][field] = value
        result = apply_stdin(cluster, namespace, manifest, check=False)
        schema = schema_at(schema_path)
        schema = schema.get("items", schema)
        opaque = schema.get("x-kubernetes-preserve-unknown-fields") or schema.get("properties", {}).get(
            "valueFrom", {}
        ).get("x-kubernetes-preserve-unknown-fields")
        if opaque:
            assert result.returncode == 0, (error_path, result.stderr)
            assert get_ps(cluster, namespace, manifest["metadata"]["name"])["spec"][field] == value
        else:
            assert result.returncode != 0, f"{error_path}: a malformed value was accepted"
            assert error_path in result.stderr and says in result.stderr, (error_path, result.stderr)


def test_immutable_fields_of_the_children_are_enforced(cluster: ControlPlane, namespace: str) -> None:
    """The rules the operator has to live with when a spec change reaches a child it already made."""
    children = [
        {
            "apiVersion": "v1",
            "kind": "PersistentVolumeClaim",
            "metadata": {"name": "cache"},
            "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
        },
        {
            "apiVersion": "apps/v1",
            "kind": "StatefulSet",
            "metadata": {"name": "server"},
            "spec": {
                "replicas": 0,
                "serviceName": "server",
                "selector": {"matchLabels": {"app": "server"}},
                "template": {
                    "metadata": {"labels": {"app": "server"}},
                    "spec": {"containers": [{"name": "c", "image": "registry.invalid/none:0"}]},
                },
                "volumeClaimTemplates": [
                    {
                        "metadata": {"name": "cache"},
                        "spec": {"accessModes": ["ReadWriteOnce"], "resources": {"requests": {"storage": "1Gi"}}},
                    }
                ],
            },
        },
        {
            "apiVersion": "batch/v1",
            "kind": "Job",
            "metadata": {"name": "fetch"},
            "spec": {
                "suspend": True,
                "template": {
                    "spec": {
                        "restartPolicy": "Never",
                        "containers": [{"name": "c", "image": "registry.invalid/none:0"}],
                    }
                },
            },
        },
    ]
    for child in children:
        cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(child))
    changes = [  # (kind/name, merge patch, the field the server names, what it says)
        ("pvc/cache", '{"spec": {"accessModes": ["ReadWriteMany"]}}', "spec", "spec is immutable after creation"),
        (
            "statefulset/server",
            '{"spec": {"volumeClaimTemplates": [{"metadata": {"name": "cache"}, "spec": '
            '{"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}}}]}}',
            "spec.volumeClaimTemplates",
            "field is immutable",
        ),
        (
            "job/fetch",
            '{"spec": {"template": {"spec": {"containers": [{"name": "c", "image": "other:1"}]}}}}',
            "spec.template.spec",
            "field is immutable",
        ),
    ]
    for target, patch, field, says in changes:
        result = cluster.kubectl("patch", target, "-n", namespace, "--type=merge", "-p", patch, check=False)
        assert result.returncode != 0, f"{target}: the change was accepted"
        assert f"{field}:" in result.stderr and says in result.stderr, (target, result.stderr)


# --- the chart, RBAC and the operator as its ServiceAccount ---------------------------------
@dataclass
class Release:
    namespace: str
    service_account: str
    token: str
    kubeconfig: Path


@pytest.fixture(scope="module")
def release(cluster: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Release]:
    """``helm install`` of the chart (Helm SDK, real apiserver) into its own namespace, watching that namespace.

    The operator Deployment's pod can never be scheduled (no node matches its
    nodeSelector): the operator runs as a local process instead, with the
    token of the chart's ServiceAccount.
    """
    helm_python.disable_logging()
    ns = "cp-release"
    cluster.create_namespace(ns)
    config = helm_python.Config(kubeconfig_path=cluster.kubeconfig, namespace=ns)
    values = {"watchNamespaces": [ns], "nodeSelector": {"policyoperator.io/test": "no-such-node"}}
    installed = helm_python.Chart.load(CHART)
    release = config.install(installed, "po", values, namespace=ns, timeout=120)
    assert release["status"] == "deployed", {k: v for k, v in release.items() if k != "manifest"}
    manifest = [d for d in yaml.safe_load_all(release["manifest"]) if d]
    (sa,) = [d["metadata"]["name"] for d in manifest if d["kind"] == "ServiceAccount"]
    token = cluster.kubectl("create", "token", sa, "-n", ns, "--duration=1h").stdout.strip()
    kubeconfig = cluster.kubeconfig_for_token(token, tmp_path_factory.mktemp("operator") / "kubeconfig")
    yield Release(ns, sa, token, kubeconfig)
    config.uninstall("po", timeout=60, ignore_not_found=True)
    cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def test_helm_install_created_the_chart_objects(cluster: ControlPlane, release: Release) -> None:
    objects = json.loads(
        cluster.kubectl(
            "get",
            "deployment,serviceaccount,role,rolebinding",
            "-n",
            release.namespace,
            "-l",
            "app.kubernetes.io/instance=po",
            "-o",
            "json",
        ).stdout
    )["items"]
    kinds = sorted(o["kind"] for o in objects)
    assert kinds == ["Deployment", "Role", "RoleBinding", "ServiceAccount"], kinds
    # helm installs the chart's crds/ only when absent: the CRD stays the one applied above, Established
    assert wait_established(cluster, timeout=10)["NamesAccepted"] == "True"


def _can_i(cluster: ControlPlane, release: Release, verb: str, api_group: str, resource: str, namespace: str) -> bool:
    """The apiserver's authorizer asked about the chart's ServiceAccount (a SubjectAccessReview, as the admin)."""
    name, _, subresource = resource.partition("/")
    # the client sends a plain dict body as it is (its stubs ask for a V1SubjectAccessReview)
    review = AuthorizationV1Api(cluster.api_client).create_subject_access_review(
        {  # type: ignore[arg-type]
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": f"system:serviceaccount:{release.namespace}:{release.service_account}",
                "groups": [
                    "system:serviceaccounts",
                    f"system:serviceaccounts:{release.namespace}",
                    "system:authenticated",
                ],
                "resourceAttributes": {
                    "namespace": namespace,
                    "verb": verb,
                    "group": api_group,
                    "resource": name,
                    "subresource": subresource,
                },
            },
        }
    )
    assert review.status is not None, review
    return bool(review.status.allowed)


def test_the_service_account_may_do_exactly_what_rbac_py_lists(cluster: ControlPlane, release: Release) -> None:
    wrong: list[str] = []
    granted = {(r.api_group, r.resource, v) for r in rbac.rules(all_namespaces=False) for v in r.verbs}
    for rule in rbac.rules(all_namespaces=False):
        for verb in ALL_VERBS:
            allowed = _can_i(cluster, release, verb, rule.api_group, rule.resource, release.namespace)
            if allowed != (verb in rule.verbs):
                wrong.append(f"{verb} {rule.api_group}/{rule.resource}: {'yes' if allowed else 'no'}")
    for api_group, resource in (
        ("", "secrets"),
        ("", "configmaps"),
        ("apps", "deployments"),
        ("rbac.authorization.k8s.io", "roles"),
        ("", "pods/exec"),
    ):
        for verb in ("get", "list", "create"):
            if (api_group, resource, verb) in granted:  # secrets: create only (a PolicyServer's compile key)
                continue
            if _can_i(cluster, release, verb, api_group, resource, release.namespace):
                wrong.append(f"{verb} {api_group}/{resource}: yes")
    if _can_i(cluster, release, "list", C.GROUP, C.PLURAL, "default"):
        wrong.append(f"list {C.PLURAL} in a namespace it does not watch: yes")
    for rule in rbac.rules(all_namespaces=True):
        if rule.cluster_scoped and _can_i(
            cluster, release, rule.verbs[0], rule.api_group, rule.resource, release.namespace
        ):
            wrong.append(f"{rule.verbs[0]} {rule.resource} (only for --all-namespaces): yes")
    assert not wrong, wrong


def test_kubectl_auth_can_i_as_the_service_account(cluster: ControlPlane, release: Release) -> None:
    """What an administrator types to check the chart's grant: one allowed and one refused verb per rule."""
    as_sa = f"--as=system:serviceaccount:{release.namespace}:{release.service_account}"
    for rule in rbac.rules(all_namespaces=False):
        name, _, subresource = rule.resource.partition("/")
        target = f"{name}.{rule.api_group}" if rule.api_group else name
        extra = [f"--subresource={subresource}"] if subresource else []
        refused = next(v for v in ALL_VERBS if v not in rule.verbs)
        for verb, expected in ((rule.verbs[0], "yes"), (refused, "no")):
            result = cluster.kubectl("auth", "can-i", verb, target, "-n", release.namespace, *extra, as_sa, check=False)
            assert result.stdout.strip() == expected, (verb, rule.resource, result.stdout, result.stderr)


def test_real_requests_with_the_token_are_authorized_per_rbac(cluster: ControlPlane, release: Release) -> None:
    import kubernetes.config

    client = kubernetes.config.new_client_from_config(config_file=str(release.kubeconfig))
    try:
        ps = CustomObjectsApi(client).list_namespaced_custom_object(C.GROUP, C.VERSION, release.namespace, C.PLURAL)
        assert isinstance(ps, dict) and ps["items"] == []
        assert BatchV1Api(client).list_namespaced_job(release.namespace).items == []
        for forbidden in (
            lambda: CoreV1Api(client).list_namespaced_secret(release.namespace),
            lambda: CoreV1Api(client).list_namespaced_pod("default"),
            lambda: BatchV1Api(client).delete_collection_namespaced_job(release.namespace),
        ):
            with pytest.raises(ApiException) as denied:
                forbidden()
            assert denied.value.status == 403, denied.value
            assert denied.value.body is not None, denied.value
            assert f"system:serviceaccount:{release.namespace}:{release.service_account}" in denied.value.body
    finally:
        client.close()


class OperatorProcess:
    """``policyserver operator --namespace NS --standalone`` with a given kubeconfig; its log in a file."""

    def __init__(self, kubeconfig: Path, namespace: str, log: Path, env: dict[str, str]) -> None:
        self.log, self.liveness = log, f"http://127.0.0.1:{free_port()}/healthz"
        with log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(VENV_BIN / "policyserver"),
                    "operator",
                    "--namespace",
                    namespace,
                    "--standalone",
                    "--resync-seconds",
                    "1",
                    "--liveness",
                    self.liveness,
                    "--log-format",
                    "plain",
                ],
                env={**env, "KUBECONFIG": str(kubeconfig)},
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_for(self.probe, OPERATOR_START_S, what=f"operator liveness (log: {log})")

    def probe(self) -> bool:
        assert self.proc.poll() is None, f"the operator exited:\n{self.text()}"
        with urllib.request.urlopen(self.liveness, timeout=2):
            return True

    def passes(self) -> int:
        """Reconcile passes so far, from the liveness endpoint's own count."""
        with urllib.request.urlopen(self.liveness, timeout=2) as response:
            return int(json.loads(response.read())["reconciler"]["passes"])

    def settle(self, passes: int = 3, timeout: float = 60.0) -> None:
        """Wait (bounded) until the resync timer has run ``passes`` more full passes."""
        start = self.passes()
        wait_for(lambda: self.passes() >= start + passes, timeout, what=f"{passes} reconcile passes (log: {self.log})")

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)


def test_the_operator_as_its_service_account_reconciles_the_minimal_example(
    cluster: ControlPlane, release: Release, tmp_path: Path
) -> None:
    """Everything up to the fetch pod, which stays Pending: no node can take it here."""
    example = yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text())
    name, ns = example["metadata"]["name"], release.namespace
    # keep the fetch pod off any node another test may have registered in this session, and its claim unbound by
    # any provisioner one left behind (a claim a provisioner is binding is a wait, not Unschedulable)
    example["spec"]["nodeSelector"] = {"policyoperator.io/test": "no-such-node"}
    example["spec"]["storage"] = {**example["spec"].get("storage", {}), "storageClassName": "no-such-class"}
    operator = OperatorProcess(release.kubeconfig, ns, tmp_path / "operator.log", cluster.env)
    try:
        apply_stdin(cluster, ns, example)
        core, batch = CoreV1Api(cluster.api_client), BatchV1Api(cluster.api_client)

        def job_name() -> str | None:
            return get_ps(cluster, ns, name).get("status", {}).get("checkpoint", {}).get("jobName")

        job = wait_for(job_name, RECONCILE_S, what=f"status.checkpoint.jobName (log: {operator.log})")
        fetch_job = batch.read_namespaced_job(job, ns)
        assert fetch_job.spec is not None and fetch_job.spec.template.spec is not None
        assert fetch_job.spec.template.spec.node_selector == example["spec"]["nodeSelector"]
        pvc = core.read_namespaced_persistent_volume_claim(f"{name}-cache", ns)
        assert pvc.metadata is not None and pvc.metadata.owner_references is not None
        assert pvc.metadata.owner_references[0].name == name
        # the real Job controller made the pod; the real scheduler found no node for it
        pods = wait_for(
            lambda: core.list_namespaced_pod(ns, label_selector=f"job-name={job}").items,
            RECONCILE_S,
            what="the fetch Job's pod (real Job controller)",
        )
        assert pods[0].status is not None and pods[0].status.phase == "Pending"
        assert pods[0].metadata is not None and pods[0].metadata.name is not None
        fetch_pod = pods[0].metadata.name

        def unschedulable() -> bool:
            status = core.read_namespaced_pod(fetch_pod, ns).status
            assert status is not None
            return any(c.type == "PodScheduled" and c.reason == "Unschedulable" for c in status.conditions or [])

        wait_for(unschedulable, RECONCILE_S, what="the scheduler's Unschedulable on the fetch pod")

        # the Job counts its Pending pod as active: that is no download, and status says what the scheduler says
        def checkpoint_condition() -> dict[str, Any]:
            conds = {c["type"]: c for c in get_ps(cluster, ns, name).get("status", {}).get("conditions") or []}
            ck = conds.get(C.COND_CHECKPOINT_READY) or {}
            return conds if ck.get("reason") == "Unschedulable" else {}

        conditions = wait_for(
            checkpoint_condition, RECONCILE_S, what=f"CheckpointReady=False Unschedulable (log: {operator.log})"
        )
        status = get_ps(cluster, ns, name)["status"]
        assert status["phase"] == C.PHASE_PENDING and status["checkpoint"]["phase"] == "Pending", status
        assert conditions[C.COND_VALID]["status"] == "True", conditions
        assert conditions[C.COND_CHECKPOINT_READY]["status"] == "False", conditions
        message = conditions[C.COND_CHECKPOINT_READY]["message"]  # the scheduler's words, whatever nodes exist now
        assert "cannot be scheduled: " in message and "nodes available" in message.replace(
            "nodes are available", "nodes available"
        ), message
        assert (conditions[C.COND_PROGRESSING]["status"], conditions[C.COND_PROGRESSING]["reason"]) == (
            "True",
            "Unschedulable",
        ), conditions
        warned = wait_for(
            lambda: [
                e
                for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
                if e.type == "Warning"
            ],
            RECONCILE_S,
            what="a Warning Event about the unschedulable fetch pod",
        )
        operator.settle()  # a few more resync passes: any later RBAC failure would show in the log
        assert [
            (e.reason, e.count or 1)
            for e in core.list_namespaced_event(ns, field_selector=f"involvedObject.name={name}").items
            if e.type == "Warning"
        ] == [(warned[0].reason, 1)], "one Warning, not one per pass"
        log = operator.text()
        assert not re.search(r"\b403\b|[Ff]orbidden", log), log
        assert "Traceback" not in log, log
    finally:
        operator.stop()
        cluster.kubectl("delete", C.PLURAL, name, "-n", ns, "--wait=false", "--ignore-not-found", check=False)
