"""The Helm chart, rendered by Helm's own engine (helm-python-sdk) for every value set that matters.

Each rendered object goes through kubernetes-validate in strict mode; custom
resources go through their CRDs (the sample PolicyServer also through the
operator's own ``parse_spec``).  The RBAC must grant exactly what
``policy_operator.operator.rbac.RULES`` lists, the operator container's
arguments must parse with the operator's real argument parser, and no value
set may ever put a CRD under ``templates/`` (LeaderWorkerSet #880: a CRD in a
release manifest is one ``helm upgrade`` away from being deleted with every
object of its kind).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import io
import json
import re
import shlex
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import helm_python
import kubernetes_validate
import pytest
import yaml

import policy_operator
from policy_operator import cli
from policy_operator import constants as C
from policy_operator.operator import main as operator_main
from policy_operator.operator import manifests, rbac
from policy_operator.operator.spec import parse_spec
from tests.support import crd_schema
from tests.support.chart import (
    CHART,
    DOCS,
    EXAMPLES,
    K8S_VERSIONS,
    LINT_KUBE_VERSION,
    NS,
    RELEASE,
    REPO,
    chart,
    code_lines,
)

CUSTOM_KINDS = {"PolicyServer", "KopfPeering", "ClusterKopfPeering", "ServiceMonitor"}

VALUE_SETS: dict[str, dict[str, Any]] = {
    "default": {},
    "two-replicas-peering": {"replicaCount": 2},
    "watch-all-namespaces": {"watchAllNamespaces": True},
    "watch-all-namespaces-two-replicas": {"watchAllNamespaces": True, "replicaCount": 2},
    "two-namespaces-two-replicas": {"watchNamespaces": ["team-a", "team-b"], "replicaCount": 2},
    "service-monitor": {"serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}},
    "service-monitor-all-namespaces": {
        "serviceMonitor": {"enabled": True, "interval": "1m"},
        "watchAllNamespaces": True,
    },
    "sample": {"samplePolicyServer": {"enabled": True}},
    "network-policy": {"networkPolicy": {"enabled": True}, "watchNamespaces": ["team-a", "team-b"]},
    "network-policy-all-namespaces": {
        "networkPolicy": {
            "enabled": True,
            "namespaces": [NS],
            "metrics": [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}],
        },
        "watchAllNamespaces": True,
    },
    "dashboard": {"dashboard": {"enabled": True, "annotations": {"grafana_folder": "Robots"}}},
    "sample-cfgp2-dp1": {
        "samplePolicyServer": {
            "enabled": True,
            "name": "policy-cfgp2-dp1",
            "namespace": "team-a",
            "image": {"tag": "0.1.0-cuda"},
            "spec": {k: v for k, v in EXAMPLES["policyserver-cfgp2-dp1.yaml"]["spec"].items() if k != "image"},
        },
        "watchNamespaces": ["team-a"],
    },
    "extra-env": {
        "extraEnv": [
            {"name": "KOPF_EXTRA", "value": "1"},
            {"name": "HTTPS_PROXY", "valueFrom": {"secretKeyRef": {"name": "proxy", "key": "url"}}},
        ]
    },
    "custom-image": {
        "image": {
            "repository": "registry.example.com:5000/robots/policy-operator",
            "tag": "v1.2.3-rc.1",
            "pullPolicy": "Always",
        },
        "imagePullSecrets": [{"name": "regcred"}],
    },
    "image-digest": {"image": {"digest": "sha256:" + "ab" * 32}},
    "scheduling": {
        "nodeSelector": {"kubernetes.io/os": "linux"},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {
            "podAntiAffinity": {
                "preferredDuringSchedulingIgnoredDuringExecution": [
                    {
                        "weight": 100,
                        "podAffinityTerm": {
                            "topologyKey": "kubernetes.io/hostname",
                            "labelSelector": {"matchLabels": {"app.kubernetes.io/name": "policy-operator"}},
                        },
                    }
                ]
            }
        },
        "priorityClassName": "system-cluster-critical",
        "podLabels": {"team": "robots"},
        "podAnnotations": {"example.com/owner": "robots"},
        "resources": {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"cpu": 1, "memory": "1Gi"}},
    },
    "tuned-operator": {
        "operator": {
            "logFormat": "plain",
            "logLevel": "debug",
            "resyncSeconds": 30,
            "probeTimeoutSeconds": 1.5,
            "healthPort": 9090,
            "extraArgs": ["--priority", "100"],
        }
    },
    "existing-service-account-no-rbac": {
        "serviceAccount": {"create": False, "name": "ops-robot"},
        "rbac": {"create": False},
    },
    "platform-assigned-uid": {
        "securityContext": {"runAsUser": None, "runAsGroup": None, "fsGroup": None},
        "fullnameOverride": "robots-operator",
    },
}


@pytest.fixture(scope="module", autouse=True)
def _quiet_helm() -> None:
    helm_python.disable_logging()


@cache
def _render(name: str) -> tuple[dict[str, str], tuple[dict[str, Any], ...]]:
    values = VALUE_SETS[name]
    chart().validate_schema(values)
    files = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NS)
    objects = tuple(
        obj
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for obj in yaml.safe_load_all(text)
        if obj
    )
    return files, objects


def objects(name: str) -> list[dict[str, Any]]:
    return copy.deepcopy(list(_render(name)[1]))


def notes(name: str) -> str:
    return _render(name)[0][f"{chart().name}/templates/NOTES.txt"]


def of_kind(objs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [o for o in objs if o["kind"] == kind]


def one(objs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    found = of_kind(objs, kind)
    assert len(found) == 1, f"expected one {kind}, got {len(found)}"
    return found[0]


def operator_container(objs: list[dict[str, Any]]) -> dict[str, Any]:
    (container,) = one(objs, "Deployment")["spec"]["template"]["spec"]["containers"]
    return container


def watched(values: dict[str, Any]) -> list[str]:
    return values.get("watchNamespaces") or [NS]


@cache
def _chart_crds() -> dict[str, dict[str, Any]]:
    return {doc["metadata"]["name"]: doc for entry in chart().crds for doc in yaml.safe_load_all(entry["data"]) if doc}


def chart_crds() -> dict[str, dict[str, Any]]:
    """The chart's CRDs by name, parsed once (the YAML is large); each caller gets its own copy."""
    return copy.deepcopy(_chart_crds())


def parse_operator_args(argv: list[str]) -> argparse.Namespace:
    """The operator's own parser; its usage errors become test failures that quote argparse."""
    parser = argparse.ArgumentParser(prog="policyserver operator")
    operator_main.add_arguments(parser)
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            return parser.parse_args(argv)
        except SystemExit:
            raise AssertionError(f"policyserver operator rejects {argv}: {err.getvalue().strip()}") from None


# --- the chart as a whole ---------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_lint_strict_has_no_findings_above_info(name: str) -> None:
    report = helm_python.lint(
        CHART, copy.deepcopy(VALUE_SETS[name]), strict=True, namespace=NS, kube_version=LINT_KUBE_VERSION
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


def test_app_version_is_the_package_version_and_the_default_image_tag() -> None:
    meta = chart().metadata
    assert meta["appVersion"] == policy_operator.__version__
    assert (
        operator_container(objects("default"))["image"]
        == f"ghcr.io/policy-operator/policy-operator:{meta['appVersion']}"
    )


@pytest.mark.parametrize("name", VALUE_SETS)
def test_every_builtin_object_passes_kubernetes_validate_strict(name: str) -> None:
    objs = objects(name)
    assert objs
    for obj in objs:
        if obj["kind"] in CUSTOM_KINDS:
            continue
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)


@pytest.mark.parametrize("name", VALUE_SETS)
def test_custom_resources_pass_their_crds(name: str) -> None:
    crds = {(d["spec"]["group"], d["spec"]["names"]["kind"]): d for d in chart_crds().values()}
    assert {kind for _, kind in crds} <= CUSTOM_KINDS  # no custom kind slips into the built-in check
    for obj in objects(name):
        if obj["kind"] not in CUSTOM_KINDS:
            continue
        if obj["kind"] == "ServiceMonitor":
            continue  # no CRD here: checked field by field in test_service_monitor_*
        group, version = obj["apiVersion"].split("/")
        crd = crds[(group, obj["kind"])]
        assert ("namespace" in obj["metadata"]) == (crd["spec"]["scope"] == "Namespaced"), obj["metadata"]
        body = obj
        if "metadata" not in crd_schema.version_schema(crd, version).get("properties", {}):
            # apiVersion, kind and metadata are implicit in every CRD; kopf's peering schema lists only status
            body = {k: v for k, v in obj.items() if k not in ("apiVersion", "kind", "metadata")}
        assert crd_schema.validate(crd, body, version) == []


def test_every_object_carries_the_standard_labels_and_lands_in_the_right_namespace() -> None:
    for name, values in VALUE_SETS.items():
        allowed_ns = set(watched(values)) | {NS} | {values.get("samplePolicyServer", {}).get("namespace") or NS}
        for obj in objects(name):
            labels = obj["metadata"]["labels"]
            for key in (
                C.LABEL_NAME,
                C.LABEL_INSTANCE,
                C.LABEL_VERSION,
                C.LABEL_MANAGED_BY,
                C.LABEL_PART_OF,
                C.LABEL_COMPONENT,
                "helm.sh/chart",
            ):
                assert labels.get(key), (name, obj["kind"], key)
            assert labels[C.LABEL_MANAGED_BY] == "Helm" and labels[C.LABEL_INSTANCE] == RELEASE
            assert labels[C.LABEL_VERSION] == chart().metadata["appVersion"]
            if "namespace" in obj["metadata"]:
                assert obj["metadata"]["namespace"] in allowed_ns, (name, obj["kind"])


# --- CRDs: crds/ only, one source of truth, never templated -------------------------------


def test_chart_crds_are_the_repository_crds() -> None:
    """The chart's crds/ are symlinks to crds/ (Helm follows them and packages the target), so they cannot drift."""
    chart_dir = CHART / "crds"
    assert sorted(p.name for p in chart_dir.iterdir()) == sorted(p.name for p in (REPO / "crds").glob("*.yaml"))
    for link in chart_dir.iterdir():
        assert link.is_symlink(), f"{link} must be a symlink into crds/"
        assert link.resolve() == (REPO / "crds" / link.name).resolve()
    loaded = {Path(e["filename"]).name: e["data"] for e in chart().crds}
    assert loaded == {p.name: p.read_text() for p in (REPO / "crds").glob("*.yaml")}


def test_chart_crds_are_valid_and_name_what_the_operator_uses() -> None:
    crds = chart_crds()
    assert set(crds) == {f"{C.PLURAL}.{C.GROUP}", "kopfpeerings.kopf.dev", "clusterkopfpeerings.kopf.dev"}
    for crd in crds.values():
        for version in K8S_VERSIONS:
            kubernetes_validate.validate(crd, version, strict=True)
    # the RBAC rules for kopf's peering name exactly these resources
    kopf_rules = {r.resource: r for r in rbac.RULES if r.api_group == "kopf.dev"}
    for crd_name, scope in (("kopfpeerings.kopf.dev", "Namespaced"), ("clusterkopfpeerings.kopf.dev", "Cluster")):
        spec = crds[crd_name]["spec"]
        assert spec["scope"] == scope and spec["names"]["plural"] in kopf_rules
        assert kopf_rules[spec["names"]["plural"]].cluster_scoped == (scope == "Cluster")
        assert [v["name"] for v in spec["versions"] if v["served"] and v["storage"]] == ["v1"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_no_value_set_templates_a_crd_or_a_hook(name: str) -> None:
    for obj in objects(name):
        assert obj["kind"] != "CustomResourceDefinition"
        assert not obj["apiVersion"].startswith("apiextensions.k8s.io/")
        # no hook may delete or replace anything behind the release's back; a `helm test` Pod runs only on request
        hooks = {k: v for k, v in (obj["metadata"].get("annotations") or {}).items() if k.startswith("helm.sh/hook")}
        assert not hooks or (obj["kind"] == "Pod" and hooks["helm.sh/hook"] == "test"), hooks


def test_template_sources_never_mention_crds() -> None:
    for template in chart().templates:
        assert not re.search(r"kind:\s*CustomResourceDefinition", template["data"]), template["name"]


# --- RBAC: exactly rbac.RULES ---------------------------------------------------------------


def triples(rules: list[dict[str, Any]]) -> set[tuple[str, str, str]]:
    return {(g, r, v) for rule in rules for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]}


@pytest.mark.parametrize("name", [n for n, v in VALUE_SETS.items() if v.get("rbac", {}).get("create", True)])
def test_rbac_grants_exactly_what_the_operator_calls(name: str) -> None:
    values, objs = VALUE_SETS[name], objects(name)
    everywhere = bool(values.get("watchAllNamespaces"))
    sa = one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"]
    if everywhere:
        assert not of_kind(objs, "Role") and not of_kind(objs, "RoleBinding")
        grants = [(one(objs, "ClusterRole"), one(objs, "ClusterRoleBinding"))]
    else:
        assert not of_kind(objs, "ClusterRole") and not of_kind(objs, "ClusterRoleBinding")
        roles = {r["metadata"]["namespace"]: r for r in of_kind(objs, "Role")}
        bindings = {b["metadata"]["namespace"]: b for b in of_kind(objs, "RoleBinding")}
        assert sorted(roles) == sorted(bindings) == sorted(watched(values))
        grants = [(roles[ns], bindings[ns]) for ns in roles]
    allowed = triples(rbac.policy_rules(all_namespaces=everywhere))
    for role, binding in grants:
        rules = role["rules"]
        assert rbac.missing(rules, all_namespaces=everywhere) == []
        assert triples(rules) <= allowed, f"granted beyond rbac.RULES: {sorted(triples(rules) - allowed)}"
        assert all(set(rule) == {"apiGroups", "resources", "verbs"} for rule in rules)  # no resourceNames/URLs
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io",
            "kind": role["kind"],
            "name": role["metadata"]["name"],
        }
        assert binding["subjects"] == [{"kind": "ServiceAccount", "name": sa, "namespace": NS}]


def test_namespaced_rules_fall_short_of_all_namespaces() -> None:
    """The Role really is the smaller grant: it misses exactly the cluster-scoped reads."""
    (role,) = of_kind(objects("default"), "Role")
    cluster_only = {
        f"{r.api_group or 'core'}/{r.resource}:{v}" for r in rbac.RULES if r.cluster_scoped for v in r.verbs
    }
    assert set(rbac.missing(role["rules"], all_namespaces=True)) == cluster_only


def test_bring_your_own_service_account_and_rbac() -> None:
    objs = objects("existing-service-account-no-rbac")
    kinds = {o["kind"] for o in objs}
    assert not kinds & {"ServiceAccount", "Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
    assert one(objs, "Deployment")["spec"]["template"]["spec"]["serviceAccountName"] == "ops-robot"


# --- the operator Deployment ------------------------------------------------------------------


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_args_parse_with_the_operator_parser_and_mean_what_the_values_say(name: str) -> None:
    values, objs = VALUE_SETS[name], objects(name)
    deployment = one(objs, "Deployment")
    container = operator_container(objs)
    assert container["command"] == ["policyserver", "operator"]
    args = parse_operator_args(container["args"])
    full = cli.build_parser().parse_args(container["command"][1:] + container["args"])
    assert cli.COMMANDS[full.command][0] == operator_main.__name__

    if values.get("watchAllNamespaces"):
        assert args.all_namespaces and args.namespace is None
    else:
        assert not args.all_namespaces and args.namespace == watched(values)
        assert not any(set("*?[!") & set(ns) for ns in args.namespace)  # exact names: a Role suffices
    replicas = values.get("replicaCount", 1)
    assert deployment["spec"]["replicas"] == replicas
    peerings = of_kind(objs, "KopfPeering") + of_kind(objs, "ClusterKopfPeering")
    if replicas == 1:
        assert args.standalone and args.peering is None and not peerings
        assert deployment["spec"]["strategy"] == {"type": "Recreate"}  # never two standalone operators at once
    else:
        assert not args.standalone and args.peering == C.PEERING_NAME
        if values.get("watchAllNamespaces"):
            assert [(p["kind"], p["metadata"]["name"]) for p in peerings] == [("ClusterKopfPeering", C.PEERING_NAME)]
        else:
            assert sorted((p["kind"], p["metadata"]["name"], p["metadata"]["namespace"]) for p in peerings) == sorted(
                ("KopfPeering", C.PEERING_NAME, ns) for ns in watched(values)
            )
        assert deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    op = values.get("operator", {})
    assert args.log_format == op.get("logFormat", "json")
    assert (args.verbose, args.debug) == (op.get("logLevel") == "verbose", op.get("logLevel") == "debug")
    assert args.resync_seconds == op.get("resyncSeconds") and args.probe_timeout == op.get("probeTimeoutSeconds")
    if "extraArgs" in op:
        assert container["args"][-len(op["extraArgs"]) :] == op["extraArgs"]


@pytest.mark.parametrize("name", VALUE_SETS)
def test_probes_hit_the_liveness_endpoint_the_operator_serves(name: str) -> None:
    container = operator_container(objects(name))
    liveness = urlsplit(parse_operator_args(container["args"]).liveness)
    assert liveness.path == urlsplit(operator_main.DEFAULT_LIVENESS).path == C.HEALTHZ_PATH
    assert liveness.hostname == "0.0.0.0"  # the kubelet probes the pod IP
    (port,) = container["ports"]
    assert port["containerPort"] == liveness.port == VALUE_SETS[name].get("operator", {}).get("healthPort", 8080)
    for probe in (container["livenessProbe"], container["readinessProbe"]):
        assert probe["httpGet"] == {"path": C.HEALTHZ_PATH, "port": port["name"]}


@pytest.mark.parametrize("name", VALUE_SETS)
def test_operator_pod_is_locked_down(name: str) -> None:
    pod = one(objects(name), "Deployment")["spec"]["template"]["spec"]
    container = operator_container(objects(name))
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    sc = container["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["runAsNonRoot"] is True and sc["privileged"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
    # the read-only root filesystem needs a writable HOME: /tmp, an emptyDir
    env = {e["name"]: e for e in container["env"]}
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    assert env[C.ENV_HOME]["value"] == "/tmp" and "emptyDir" in {v["name"]: v for v in pod["volumes"]}[mounts["/tmp"]]
    # kopf's peering identity is the pod name
    assert env["POD_ID"]["valueFrom"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    expected_uid = VALUE_SETS[name].get("securityContext", {}).get("runAsUser", 1000)
    assert pod["securityContext"].get("runAsUser") == expected_uid


def test_image_reference_forms() -> None:
    assert (
        operator_container(objects("custom-image"))["image"]
        == "registry.example.com:5000/robots/policy-operator:v1.2.3-rc.1"
    )
    assert operator_container(objects("custom-image"))["imagePullPolicy"] == "Always"
    assert one(objects("custom-image"), "Deployment")["spec"]["template"]["spec"]["imagePullSecrets"] == [
        {"name": "regcred"}
    ]
    assert (
        operator_container(objects("image-digest"))["image"]
        == "ghcr.io/policy-operator/policy-operator@sha256:" + "ab" * 32
    )


def test_extra_env_scheduling_and_resources_reach_the_pod() -> None:
    env = operator_container(objects("extra-env"))["env"]
    assert env[-2:] == VALUE_SETS["extra-env"]["extraEnv"]
    assert [e["name"] for e in env[:-2]] == [e["name"] for e in operator_container(objects("default"))["env"]]
    values = VALUE_SETS["scheduling"]
    deployment = one(objects("scheduling"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    for key in ("nodeSelector", "tolerations", "affinity", "priorityClassName"):
        assert pod[key] == values[key]
    assert operator_container(objects("scheduling"))["resources"] == values["resources"]
    meta = deployment["spec"]["template"]["metadata"]
    assert meta["labels"]["team"] == "robots" and meta["annotations"] == values["podAnnotations"]
    for absent in ("nodeSelector", "tolerations", "affinity", "priorityClassName", "imagePullSecrets"):
        assert absent not in one(objects("default"), "Deployment")["spec"]["template"]["spec"]


def test_deployment_selector_never_matches_policyserver_pods() -> None:
    deployment = one(objects("default"), "Deployment")
    selector = deployment["spec"]["selector"]["matchLabels"]
    assert selector.items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    for component in (C.COMPONENT_SERVER, C.COMPONENT_FETCH):
        # a PolicyServer named like the release must still not be selected
        assert not selector.items() <= manifests.labels(RELEASE, component).items()


# --- ServiceMonitor -----------------------------------------------------------------------------


def policyserver_services(namespace: str) -> list[dict[str, Any]]:
    spec = parse_spec(EXAMPLES["policyserver-cfgp2-dp1.yaml"]["spec"], name="policy-cfgp2-dp1", namespace=namespace)
    return [manifests.build_service(spec), manifests.build_headless_service(spec)]


def test_service_monitor_only_when_enabled() -> None:
    for name, values in VALUE_SETS.items():
        assert len(of_kind(objects(name), "ServiceMonitor")) == int(
            values.get("serviceMonitor", {}).get("enabled", False)
        )


@pytest.mark.parametrize("name", ["service-monitor", "service-monitor-all-namespaces"])
def test_service_monitor_scrapes_each_policyserver_pod_once(name: str) -> None:
    values, sm = VALUE_SETS[name], one(objects(name), "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    spec = sm["spec"]
    assert set(spec) <= {"jobLabel", "selector", "namespaceSelector", "endpoints"}
    # the selector is a valid LabelSelector by the official schema (checked through a kind that embeds one)
    kubernetes_validate.validate(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": {"name": "x"},
            "spec": {"maxUnavailable": 1, "selector": spec["selector"]},
        },
        K8S_VERSIONS[0],
        strict=True,
    )
    if values.get("watchAllNamespaces"):
        assert spec["namespaceSelector"] == {"any": True}
    else:
        assert spec["namespaceSelector"] == {"matchNames": watched(values)}
    (endpoint,) = spec["endpoints"]
    assert endpoint["port"] == C.PORT_NAME and endpoint["path"] == C.METRICS_PATH and endpoint["scheme"] == "http"
    assert endpoint["interval"] == values["serviceMonitor"].get("interval", "30s")
    scraped = []
    for svc in policyserver_services(watched(values)[0]):
        if not spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items():
            continue
        assert C.PORT_NAME in [p["name"] for p in svc["spec"]["ports"]]
        meta = {"__meta_kubernetes_service_cluster_ip": svc["spec"].get("clusterIP", "10.0.0.10")}
        dropped = any(
            r["action"] == "drop" and re.fullmatch(r["regex"], ";".join(meta.get(s, "") for s in r["sourceLabels"]))
            for r in endpoint["relabelings"]
        )
        if not dropped:
            scraped.append(svc["metadata"]["name"])
    assert scraped == ["policy-cfgp2-dp1"]  # the ClusterIP Service, not also the headless one
    assert sm["metadata"]["labels"].items() >= values["serviceMonitor"].get("labels", {}).items()


# --- the sample PolicyServer ------------------------------------------------------------------


@pytest.mark.parametrize("name", ["sample", "sample-cfgp2-dp1"])
def test_sample_policyserver_is_accepted_by_the_crd_and_the_operator(name: str) -> None:
    values = VALUE_SETS[name]["samplePolicyServer"]
    ps = one(objects(name), C.KIND)
    assert ps["apiVersion"] == C.API_VERSION
    assert ps["metadata"]["name"] == values.get("name", "policy-sample")
    assert ps["metadata"]["namespace"] == (values.get("namespace") or watched(VALUE_SETS[name])[0])
    assert ps["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"  # helm uninstall leaves it serving
    assert crd_schema.validate(chart_crds()[f"{C.PLURAL}.{C.GROUP}"], ps) == []
    spec = parse_spec(ps["spec"], name=ps["metadata"]["name"], namespace=ps["metadata"]["namespace"])
    tag = values.get("image", {}).get("tag") or chart().metadata["appVersion"]
    assert spec.image == f"ghcr.io/policy-operator/policy-server:{tag}"
    if "spec" in values:
        assert {k: v for k, v in ps["spec"].items() if k != "image"} == {
            k: v for k, v in values["spec"].items() if k != "image"
        }


def test_sample_keeps_an_explicit_spec_image() -> None:
    values = copy.deepcopy(VALUE_SETS["sample"])
    values["samplePolicyServer"]["spec"] = {"image": "registry.example/policy:7", "checkpoint": {"source": "hf://a/b"}}
    files = chart().render(values, name=RELEASE, namespace=NS)
    ps = yaml.safe_load(files[f"{chart().name}/templates/sample-policyserver.yaml"])
    assert ps["spec"]["image"] == "registry.example/policy:7"


# --- values.yaml and values.schema.json ---------------------------------------------------------


def test_every_value_set_and_the_defaults_pass_the_schema() -> None:
    chart().validate_schema(chart().values)
    for values in VALUE_SETS.values():
        chart().validate_schema(copy.deepcopy(values))


BAD_VALUES = [
    ({"replicaCount": 3}, "/replicaCount"),
    ({"replicaCount": 0}, "/replicaCount"),
    ({"replicaCount": "2"}, "/replicaCount"),
    ({"replicas": 2}, "replicas"),
    ({"image": {"tag": 1.0}}, "/image/tag"),
    ({"image": {"tag": "has space"}}, "/image/tag"),
    ({"image": {"tag": "-leading-dash"}}, "/image/tag"),
    ({"image": {"repository": "Upper/Case"}}, "/image/repository"),
    ({"image": {"repository": "repo:tag"}}, "/image/repository"),
    ({"image": {"digest": "sha256:123"}}, "/image/digest"),
    ({"image": {"pullPolicy": "Sometimes"}}, "/image/pullPolicy"),
    ({"watchAllNamespaces": "yes"}, "/watchAllNamespaces"),
    ({"watchNamespaces": ["team-*"]}, "/watchNamespaces/0"),
    ({"watchNamespaces": ["Team_A"]}, "/watchNamespaces/0"),
    ({"watchNamespaces": ["a", "a"]}, "/watchNamespaces"),
    ({"watchAllNamespaces": True, "watchNamespaces": ["a"]}, "/watchNamespaces"),
    ({"peering": {"name": "Not Valid"}}, "/peering/name"),
    ({"operator": {"logFormat": "xml"}}, "/operator/logFormat"),
    ({"operator": {"logLevel": "trace"}}, "/operator/logLevel"),
    ({"operator": {"resyncSeconds": 0}}, "/operator/resyncSeconds"),
    ({"operator": {"probeTimeoutSeconds": -1}}, "/operator/probeTimeoutSeconds"),
    ({"operator": {"healthPort": 80}}, "/operator/healthPort"),
    ({"operator": {"healthPort": 70000}}, "/operator/healthPort"),
    ({"operator": {"extraArgs": ["--priority", 100]}}, "/operator/extraArgs/1"),
    ({"extraEnv": [{"value": "x"}]}, "/extraEnv/0"),
    ({"extraEnv": [{"name": "A", "value": "1", "valueFrom": {}}]}, "/extraEnv/0"),
    ({"extraEnv": [{"name": "A", "value": 1}]}, "/extraEnv/0/value"),
    ({"extraEnv": {"A": "1"}}, "/extraEnv"),
    ({"resources": {"limits": {"memory": "lots"}}}, "/resources/limits/memory"),
    ({"resources": {"request": {}}}, "/resources"),
    ({"livenessProbe": {"successThreshold": 2}}, "/livenessProbe"),
    ({"livenessProbe": {"httpGet": {"path": "/"}}}, "/livenessProbe"),
    ({"securityContext": {"runAsUser": 0}}, "/securityContext/runAsUser"),
    ({"securityContext": {"privileged": True}}, "/securityContext"),
    ({"tolerations": [{"operator": "Sometimes"}]}, "/tolerations/0/operator"),
    ({"nodeSelector": {"gpu": True}}, "/nodeSelector/gpu"),
    ({"serviceAccount": {"create": False}}, "/serviceAccount"),
    ({"serviceMonitor": {"interval": "30 seconds"}}, "/serviceMonitor/interval"),
    ({"serviceMonitor": {"enabled": "true"}}, "/serviceMonitor/enabled"),
    ({"samplePolicyServer": {"name": "Policy_Sample"}}, "/samplePolicyServer/name"),
    ({"samplePolicyServer": {"name": "p" * 41}}, "/samplePolicyServer/name"),
    ({"samplePolicyServer": {"spec": {"replicas": 1, "checkpoint": None}}}, "/samplePolicyServer/spec"),
    ({"terminationGracePeriodSeconds": -1}, "/terminationGracePeriodSeconds"),
    ({"admissionPolicy": {"allowedImages": "ghcr.io/policy-operator/"}}, "/admissionPolicy/allowedImages"),
    ({"admissionPolicy": {"allowedImages": [""]}}, "/admissionPolicy/allowedImages/0"),
]


@pytest.mark.parametrize(("values", "where"), BAD_VALUES, ids=[json.dumps(v)[:60] for v, _ in BAD_VALUES])
def test_schema_rejects_bad_values_naming_the_key(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as exc:
        chart().validate_schema(copy.deepcopy(values))
    assert where in str(exc.value)
    with pytest.raises(helm_python.HelmValuesError):  # and nothing renders from them
        chart().render(copy.deepcopy(values), name=RELEASE, namespace=NS)


def _value_lines() -> list[tuple[int, str, bool, bool]]:
    """(indent, key, documented, leaf) per key line of values.yaml; a key is documented by a comment right above it."""
    out, previous = [], ""
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if not stripped:
            previous = ""
            continue
        match = re.match(r"^( *)([A-Za-z][A-Za-z0-9]*):(.*)$", line)
        if match:
            rest = match.group(3).split(" #")[0].strip()
            out.append((len(match.group(1)), match.group(2), previous.startswith("#"), rest != ""))
        previous = stripped
    return out


def test_values_yaml_is_documented_line_by_line() -> None:
    """Every leaf value has a comment above it or under a commented parent block."""
    stack: list[tuple[int, bool]] = []
    undocumented = []
    for indent, key, documented, leaf in _value_lines():
        while stack and stack[-1][0] >= indent:
            stack.pop()
        covered = documented or any(d for _, d in stack)
        if leaf and not covered:
            undocumented.append(key)
        stack.append((indent, documented))
    assert undocumented == []


def test_schema_covers_exactly_the_values() -> None:
    def keys(schema: dict[str, Any], values: dict[str, Any], path: str = "") -> list[str]:
        problems = []
        props = schema.get("properties", {})
        for key, value in values.items():
            if key not in props:
                problems.append(f"{path}{key} not in schema")
            elif isinstance(value, dict) and value and "properties" in props[key]:
                problems += keys(props[key], value, f"{path}{key}.")
        problems += [f"{path}{k} in schema but not in values.yaml" for k in props if k not in values and k != "global"]
        return problems

    schema = json.loads((CHART / "values.schema.json").read_text())
    assert keys(schema, yaml.safe_load((CHART / "values.yaml").read_text())) == []
    assert schema["properties"]["peering"]["properties"]["name"]
    assert chart().values["peering"]["name"] == C.PEERING_NAME


# --- NOTES.txt ---------------------------------------------------------------------------------------


def test_notes_tell_the_next_commands_with_real_names() -> None:
    text = notes("default")
    for path in re.findall(r"apply -f (\S+)", text):
        assert (REPO / path).is_file(), path
    assert {f"examples/{n}" for n in EXAMPLES if n != "policyserver-minimal.yaml"} <= set(
        re.findall(r"apply -f (\S+)", text)
    )
    assert f"get {C.SHORT_NAME} -w" in text
    (waited,) = re.findall(rf"wait --for=condition={C.COND_AVAILABLE} {C.SINGULAR}/(\S+)", text)
    assert waited == EXAMPLES["policyserver-cfgp2-dp1.yaml"]["metadata"]["name"]
    assert f"kubectl -n {NS} get {C.SHORT_NAME} -w" in text
    assert "kubectl apply --server-side --force-conflicts -f crds/" in text
    deployment = one(objects("default"), "Deployment")["metadata"]["name"]
    assert f"deployment/{deployment}" in text
    assert re.search(r"policyserver client --url ws://127\.0\.0\.1:8000", text)


def test_notes_follow_the_sample_and_the_watch_scope() -> None:
    sample = VALUE_SETS["sample-cfgp2-dp1"]["samplePolicyServer"]
    text = notes("sample-cfgp2-dp1")
    assert f"-n {sample['namespace']} wait --for=condition={C.COND_AVAILABLE} {C.SINGULAR}/{sample['name']}" in text
    assert "every namespace" in notes("watch-all-namespaces")
    assert "kopf peering" in notes("two-replicas-peering") and "standalone" in notes("default")


# --- docs/install.md and docs/upgrades.md say what the chart does --------------------------------


@pytest.mark.parametrize("doc", DOCS)
def test_docs_set_only_values_the_chart_has(doc: str) -> None:
    defaults = chart().values
    keys = re.findall(r"--set '?([A-Za-z][\w.]*)=", DOCS[doc])
    for key in keys:
        node: Any = defaults
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"{doc}: --set {key} is not a chart value"
            node = node[part]
    if doc == "install.md":
        assert {
            "watchNamespaces",
            "replicaCount",
            "watchAllNamespaces",
            "serviceMonitor.enabled",
            "samplePolicyServer.enabled",
            "image.repository",
        } <= set(keys)


def test_install_doc_commands_name_real_files_objects_and_flags() -> None:
    lines = code_lines(DOCS["install.md"])
    applied = [m for line in lines for m in re.findall(r"apply -f (examples/\S+)", line)]
    assert sorted(applied) == sorted(f"examples/{n}" for n in EXAMPLES if n != "policyserver-minimal.yaml")
    waited = [m for line in lines for m in re.findall(rf"--for=condition={C.COND_AVAILABLE} {C.SINGULAR}/(\S+)", line)]
    assert sorted(waited) == sorted(EXAMPLES[p.split("/")[1]]["metadata"]["name"] for p in applied)
    parsed = 0
    for line in lines:
        if line.startswith("policyserver ") and not re.search(r"[A-Z]{3,}", line):
            args = cli.build_parser().parse_args(shlex.split(line)[1:])
            assert args.command in cli.COMMANDS
            parsed += 1
    assert parsed >= 3
    for line in lines:
        if line.startswith("helm install"):
            assert "charts/policy-operator" in shlex.split(line)


def test_upgrade_doc_matches_the_notes_and_the_operator() -> None:
    text = DOCS["upgrades.md"]
    assert "kubectl apply --server-side --force-conflicts -f crds/" in text
    assert "kubectl apply --server-side --force-conflicts -f crds/" in notes("default")
    assert C.FINALIZER in text
    for crd in chart_crds():
        assert crd in text
    for path in re.findall(r"crds/[\w.-]+\.yaml", text):
        assert (REPO / path).is_file(), path
