"""Autoscaling a PolicyServer: the manifests docs/autoscaling.md gives, and an HPA and replicas: 0 on a real cluster.

The documents are held to what exists: the HPA passes Kubernetes' own schema
and targets the CRD's scale subresource; every PromQL query (the
prometheus-adapter rule and the KEDA trigger) parses and reads only metrics
and labels a running server exports.  The cluster test runs the real
HorizontalPodAutoscaler controller against a PolicyServer served by the real
operator on the local node: the HPA resolves the scale subresource
(``AbleToScale``), ``kubectl scale --replicas=0`` is accepted, the status says
``ScaledToZero`` with the cache kept, and scaling back up serves again from
that cache without a second download.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes_validate
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.crd import SCALE
from policy_operator.operator.manifests import Names
from policy_operator.source_uri import checkpoint_key
from tests.support import promql
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN, PolicyServerProcess

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane
    from tests.support.local_node_cluster import LocalCluster

REPO = Path(__file__).resolve().parents[1]
DOC = (REPO / "docs" / "autoscaling.md").read_text()
CRD = yaml.safe_load((REPO / "crds" / "policyservers.yaml").read_text())
K8S_VERSIONS = ("1.32.0", "1.37.0")


def yaml_blocks() -> list[dict[str, Any]]:
    return [yaml.safe_load(block) for block in re.findall(r"^```yaml\n(.*?)^```", DOC, re.M | re.S)]


def by_kind(kind: str) -> dict[str, Any]:
    (found,) = [d for d in yaml_blocks() if d.get("kind") == kind]
    return found


def adapter_rule() -> dict[str, Any]:
    (rules,) = [d for d in yaml_blocks() if "rules" in d]
    (rule,) = rules["rules"]["custom"]
    return rule


def adapter_query(template: str) -> str:
    """prometheus-adapter's Go templates, filled as it fills them for a pods query."""
    return template.replace("<<.GroupBy>>", "namespace, pod").replace(
        "<<.LabelMatchers>>", 'namespace="robots",pod=~"policy-cfgp2-dp1-0|policy-cfgp2-dp1-1"'
    )


# --- the documents ------------------------------------------------------------------------------


def test_crd_has_the_scale_subresource_the_doc_describes() -> None:
    (version,) = CRD["spec"]["versions"]
    assert version["subresources"]["scale"] == SCALE
    for key, path in SCALE.items():
        assert f"`{key}: {path}`" in DOC


def test_hpa_manifest_is_valid_and_targets_a_policyserver() -> None:
    hpa = by_kind("HorizontalPodAutoscaler")
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(hpa, version, strict=True)
    ref = hpa["spec"]["scaleTargetRef"]
    assert (ref["apiVersion"], ref["kind"]) == (C.API_VERSION, C.KIND)
    (metric,) = hpa["spec"]["metrics"]
    assert metric["type"] == "Pods" and metric["pods"]["metric"]["name"] == adapter_rule()["name"]["as"]
    assert hpa["spec"]["minReplicas"] >= 1  # an HPA cannot reach zero without the alpha feature gate
    assert hpa["spec"]["behavior"]["scaleDown"]["stabilizationWindowSeconds"] >= 300  # pods start slowly


def test_keda_scaled_object_targets_the_same_policyserver() -> None:
    keda = by_kind("ScaledObject")
    hpa = by_kind("HorizontalPodAutoscaler")
    assert keda["apiVersion"] == "keda.sh/v1alpha1"
    assert keda["spec"]["scaleTargetRef"] == hpa["spec"]["scaleTargetRef"]
    assert keda["metadata"] == hpa["metadata"]
    (trigger,) = keda["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    assert set(trigger["metadata"]) == {"serverAddress", "query", "threshold"}


def test_adapter_rule_and_keda_query_are_promql() -> None:
    rule = adapter_rule()
    assert rule["resources"]["overrides"] == {"namespace": {"resource": "namespace"}, "pod": {"resource": "pod"}}
    assert re.fullmatch(rule["name"]["matches"], "policy_requests_in_flight")
    for query in (
        rule["seriesQuery"],
        adapter_query(rule["metricsQuery"]),
        by_kind("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"],
    ):
        promql.usage(query)


@pytest.fixture(scope="module")
def server_metrics(shared_server: PolicyServerProcess) -> dict[str, set[str]]:
    """What the session's shared server (one replica, tests/conftest.py) exports."""
    return promql.exported_labels(shared_server.get(C.METRICS_PATH).text)


def test_every_query_reads_what_a_server_exports(server_metrics: dict[str, set[str]]) -> None:
    found = promql.Usage()
    rule = adapter_rule()
    promql.usage(rule["seriesQuery"], found)
    promql.usage(adapter_query(rule["metricsQuery"]), found)
    promql.usage(by_kind("ScaledObject")["spec"]["triggers"][0]["metadata"]["query"], found)
    assert found.metrics() >= {"policy_requests_in_flight", "policy_dp_replicas"}
    assert promql.problems(found, server_metrics) == []
    # the table of metrics in the doc names exported families only
    for name in re.findall(r"^\| `(policy_\w+)` \|", DOC, re.M):
        assert any(s == name or s.startswith(name + "_") for s in server_metrics), name


# --- on a real control plane ----------------------------------------------------------------------

NS = "autoscaling"
WAIT_S = 180.0


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, Any, int]]:
    from tests.support.http_checkpoint_server import CheckpointServer
    from tests.support.local_node_cluster import LocalCluster, free_port_on

    work = tmp_path_factory.mktemp("autoscaling")
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=0.5, gpus=2)
    try:
        lc.start()
        yield lc, source, free_port_on(["127.0.0.1", *lc.node.ips(16)])
    finally:
        lc.stop()
        source.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def condition(obj: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), {})


@pytest.mark.slow
@pytest.mark.cluster
@pytest.mark.timeout(900)
def test_hpa_resolves_the_scale_subresource_and_replicas_zero_keeps_the_cache(cluster) -> None:
    from tests.support.local_node_cluster import for_local_node

    lc, source, port = cluster
    name = "scaled"
    doc = for_local_node(
        yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text()),
        source=source.url_for("ckpt/"),
        port=port,
    )
    doc["metadata"].update(name=name, namespace=NS)
    key = checkpoint_key(doc["spec"]["checkpoint"]["source"])
    lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    wait_for(lambda: lc.status(name).get("phase") == C.PHASE_READY, WAIT_S, what=f"{name} Ready")

    # the doc's HPA, aimed at this PolicyServer: no metrics API here, but the scale subresource resolves
    hpa = by_kind("HorizontalPodAutoscaler")
    hpa["metadata"].update(name=name, namespace=NS)
    hpa["spec"]["scaleTargetRef"]["name"] = name
    lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(hpa))

    def able_to_scale() -> dict[str, Any] | None:
        got = lc.get("autoscaling/v2", "horizontalpodautoscalers", name) or {}
        able = condition(got, "AbleToScale")
        return got if able.get("status") == "True" else None

    got = wait_for(able_to_scale, 120, interval=0.5, what="HPA AbleToScale=True")
    assert condition(got, "AbleToScale")["reason"] == "SucceededGetScale"
    assert got["status"]["currentReplicas"] == 1
    # without a custom metrics API the HPA cannot read the metric: it says so and leaves replicas alone
    wait_for(
        lambda: (
            condition(lc.get("autoscaling/v2", "horizontalpodautoscalers", name) or {}, "ScalingActive").get("status")
            == "False"
        ),
        120,
        interval=0.5,
        what="HPA ScalingActive=False without a metrics API",
    )
    header, row = lc.kubectl("get", "hpa", name).stdout.splitlines()[:2]
    assert header.split()[:3] == ["NAME", "REFERENCE", "TARGETS"]
    assert row.split()[:2] == [name, f"{C.KIND}/{name}"]

    # replicas: 0 through the scale subresource; the HPA stands aside (it never scales a target at zero)
    lc.kubectl("scale", f"{C.PLURAL}/{name}", "--replicas=0")
    status = {}

    def scaled_to_zero() -> bool:
        nonlocal status
        status = lc.status(name)
        return (
            condition({"status": status}, C.COND_AVAILABLE).get("reason") == "ScaledToZero"
            and status.get("replicas") == 0
        )

    wait_for(scaled_to_zero, WAIT_S, interval=0.5, what="status ScaledToZero")
    assert condition({"status": status}, C.COND_AVAILABLE)["status"] == "False"
    assert condition({"status": status}, C.COND_CHECKPOINT_READY)["status"] == "True"
    assert status["checkpoint"]["phase"] == "Ready" and status["checkpoint"]["key"] == key
    assert status["ready"] == "0/0" and status["ranksReady"] == "0/0"
    assert lc.get("apps/v1", "statefulsets", name)["spec"]["replicas"] == 0
    assert lc.get("v1", "persistentvolumeclaims", Names(name).pvc) is not None  # the cache is kept
    assert lc.get("v1", "services", Names(name).service) is not None
    wait_for(
        lambda: not lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}"),
        WAIT_S,
        what="server pods gone",
    )
    assert lc.get("autoscaling/v2", "horizontalpodautoscalers", name)["spec"]["minReplicas"] == 1
    downloads = source.count("/ckpt/model.safetensors")

    # back to one pod: served from the cache, no second fetch
    lc.kubectl("scale", f"{C.PLURAL}/{name}", "--replicas=1")
    wait_for(lambda: lc.status(name).get("phase") == C.PHASE_READY, WAIT_S, what=f"{name} Ready again")
    assert source.count("/ckpt/model.safetensors") == downloads == 1
    fetches = [
        j["metadata"]["name"]
        for j in lc.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_FETCH}")
    ]
    assert fetches in ([Names(name).job(key)], [])  # the one fetch Job (or none, once its TTL collected it)
    lc.kubectl("delete", "hpa", name)
    lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)
