"""The chart's Grafana dashboard: it loads, it lays out, and every query reads what a running server exports.

The metric test reads a real ``policyserver serve`` (tiny checkpoint, the session's shared server), sends
it one good request and one bad frame (so the labelled series exist), and
checks every PromQL query of the dashboard, parsed by a real PromQL parser,
against that server's ``/metrics``: each metric name, each label matched,
grouped or joined on, is exported by the server or added by the scrape of the
chart's ServiceMonitor.  It also fails when the server exports a family that
no panel shows.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import helm_python
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator import manifests
from policy_operator.operator.spec import parse_spec
from tests.support import promql
from tests.support.chart import CHART, EXAMPLES, NS, RELEASE, chart
from tests.support.servers import PolicyServerProcess

DASHBOARD_FILE = CHART / "dashboards" / "policy-server.json"
VARIABLES = ("datasource", "namespace", "policyserver", "pod")
# families of the server's registry that no panel needs to show, and why
NOT_ON_THE_DASHBOARD: dict[str, str] = {
    "policy_batch_bucket_seconds": "set once at warm-up, and only by a server with --latency-budget-ms: a constant per "
    "pod that `kubectl get --raw` or a scrape answers, not a time series to watch",
}


@pytest.fixture(scope="module", autouse=True)
def _quiet_helm() -> None:
    helm_python.disable_logging()


def dashboard() -> dict[str, Any]:
    return json.loads(DASHBOARD_FILE.read_text())


def panels(dash: dict[str, Any]) -> list[dict[str, Any]]:
    return [p for p in dash["panels"] if p["type"] != "row"]


def queries(dash: dict[str, Any]) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target."""
    return [(f"{p['title']} / {t['refId']}", t["expr"]) for p in panels(dash) for t in p["targets"]]


def variables(dash: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dash["templating"]["list"]}


def dashboard_usage(dash: dict[str, Any]) -> promql.Usage:
    found = promql.Usage()
    for _, expr in queries(dash):
        promql.usage(promql.substitute_grafana(expr), found)
    for var in variables(dash).values():
        if var["type"] == "query":
            promql.variable_usage(promql.substitute_grafana(var["query"]["query"]), found)
    return found


# --- the JSON itself ------------------------------------------------------------------------


def test_dashboard_is_grafana_json_with_unique_ids_and_a_layout_that_fits() -> None:
    dash = dashboard()
    assert dash["uid"] == "policy-server" and dash["title"] and dash["schemaVersion"] >= 36
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    cells: set[tuple[int, int]] = set()
    for p in dash["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] >= 1 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    for p in panels(dash):
        assert p["description"] and p["targets"], p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
        assert p["fieldConfig"]["defaults"]["unit"], p["title"]


def test_template_variables_select_a_policyserver_and_its_pods() -> None:
    dash = dashboard()
    found = variables(dash)
    assert tuple(found) == VARIABLES  # each one's query may use the ones before it
    assert found["datasource"]["type"] == "datasource" and found["datasource"]["query"] == "prometheus"
    assert found["policyserver"]["multi"] and found["pod"]["multi"]
    # every query is filtered by all three: a panel never mixes PolicyServers the viewer did not pick
    for where, expr in queries(dash):
        for name in ("namespace", "policyserver", "pod"):
            assert f"${name}" in expr, f"{where} ignores ${name}"
    # $policyserver reads the scrape's `service` label: the ClusterIP Service the ServiceMonitor scrapes through,
    # which the operator names after the PolicyServer
    assert "service)" in found["policyserver"]["query"]["query"].replace(" ", "")
    spec = parse_spec(EXAMPLES["policyserver-cfgp2-dp1.yaml"]["spec"], name="policy-cfgp2-dp1", namespace="robots")
    assert manifests.build_service(spec)["metadata"]["name"] == spec.name


def test_every_query_is_promql() -> None:
    dash = dashboard()
    for where, expr in queries(dash):
        try:
            promql.usage(promql.substitute_grafana(expr))
        except ValueError as exc:
            raise AssertionError(f"{where}: {exc}\n{expr}") from None


# --- against a running server -----------------------------------------------------------------


@pytest.fixture(scope="module")
def metrics_text(shared_server: PolicyServerProcess) -> str:
    """The session's shared server's /metrics after one good request and one bad frame of this fixture's own."""
    from websockets.sync.client import connect

    from policy_operator.runtime.probe import canned_observation, check_metadata
    from policy_operator.runtime.serving import wire

    server = shared_server
    with connect(server.url) as ws:
        meta = wire.unpackb(ws.recv(timeout=30))
        ws.send(wire.packb(canned_observation(check_metadata(meta))))
        assert "actions" in wire.unpackb(ws.recv(timeout=60))
    with connect(server.url) as ws:  # a bad frame: the error counter gets its `kind` label
        ws.recv(timeout=30)
        ws.send("not msgpack")
        reply = ws.recv(timeout=30)
        assert isinstance(reply, str) and reply.startswith("bad_frame")
    return server.get(C.METRICS_PATH).text


@pytest.fixture(scope="module")
def server_metrics(metrics_text: str) -> dict[str, set[str]]:
    return promql.exported_labels(metrics_text)


def test_every_metric_and_label_the_dashboard_reads_is_exported(server_metrics: dict[str, set[str]]) -> None:
    found = dashboard_usage(dashboard())
    assert found.metrics(), "no query names a metric"
    assert promql.problems(found, server_metrics) == []


def test_every_family_the_server_exports_is_on_the_dashboard(metrics_text: str) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    shown = dashboard_usage(dashboard()).metrics()
    # *_created: prometheus_client's creation timestamp of each counter and histogram, not a family of its own
    families = {
        f.name
        for f in text_string_to_metric_families(metrics_text)
        if f.name.startswith("policy_") and not f.name.endswith("_created")
    }
    assert len(families) >= 10
    missing = {f for f in families if not any(m == f or m.startswith(f + "_") for m in shown)}
    assert missing - set(NOT_ON_THE_DASHBOARD) == set()


def test_the_check_catches_a_metric_or_label_the_server_does_not_have(server_metrics: dict[str, set[str]]) -> None:
    """The check itself can fail: a renamed metric, a label only a different server has, a wrong grouping."""
    for expr, words in (
        ('rate(policy_request_latency_total{namespace="a"}[5m])', "metric policy_request_latency_total is not"),
        ('sum(rate(policy_requests_total{kind="x"}[5m]))', "policy_requests_total has no label(s) ['kind']"),
        ("sum by (replica) (policy_requests_in_flight)", "grouping by ['replica']"),
        ("max(policy_requests_in_flight) / on (gpu) max(policy_connections)", "grouping by ['gpu']"),
    ):
        assert any(words in p for p in promql.problems(promql.usage(expr), server_metrics)), expr


# --- the chart's ConfigMap ------------------------------------------------------------------------


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart().validate_schema(copy.deepcopy(values))
    files = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NS)
    return [
        o
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]


def configmaps(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in render(values) if o["kind"] == "ConfigMap"]


def test_configmap_only_when_enabled_and_off_by_default() -> None:
    assert chart().values["dashboard"]["enabled"] is False
    assert configmaps({}) == []
    assert len(configmaps({"dashboard": {"enabled": True}})) == 1


def test_configmap_carries_the_json_unchanged_with_the_sidecar_label() -> None:
    (cm,) = configmaps({"dashboard": {"enabled": True}})
    assert cm["metadata"]["namespace"] == NS
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"  # kube-prometheus-stack's sidecar default
    assert cm["metadata"]["labels"][C.LABEL_COMPONENT] == "dashboard"
    assert list(cm["data"]) == [DASHBOARD_FILE.name]
    assert json.loads(cm["data"][DASHBOARD_FILE.name]) == dashboard()


def test_configmap_namespace_labels_and_annotations_follow_the_values() -> None:
    (cm,) = configmaps(
        {
            "dashboard": {
                "enabled": True,
                "namespace": "monitoring",
                "labels": {"grafana_dashboard": "robots"},
                "annotations": {"grafana_folder": "Robots"},
            }
        }
    )
    assert cm["metadata"]["namespace"] == "monitoring"
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "robots"
    assert cm["metadata"]["annotations"] == {"grafana_folder": "Robots"}


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"dashboard": {"enabled": "yes"}}, "/dashboard/enabled"),
        ({"dashboard": {"namespace": "Monitoring"}}, "/dashboard/namespace"),
        ({"dashboard": {"labels": {"grafana_dashboard": 1}}}, "/dashboard/labels/grafana_dashboard"),
        ({"dashboard": {"json": "{}"}}, "/dashboard"),
    ],
)
def test_schema_rejects_bad_dashboard_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as exc:
        chart().validate_schema(copy.deepcopy(values))
    assert where in str(exc.value)


# --- the start-up panels show real numbers ---------------------------------------------------------


@pytest.mark.slow  # a throttled download (8 s) before its own server loads
def test_a_server_fetching_its_own_checkpoint_exports_progress_load_and_warmup(tmp_path: Path) -> None:
    """``serve --checkpoint URL``: rank 0 downloads while /metrics is up, then loads and warms up."""
    import subprocess

    from tests.support.http_checkpoint_server import CheckpointServer
    from tests.support.servers import VENV_BIN, PolicyServerProcess

    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(tmp_path / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    size = sum(p.stat().st_size for p in (tmp_path / "src" / "ckpt").rglob("*") if p.is_file())
    with CheckpointServer(tmp_path / "src", throttle_bps=max(size // 8, 1)) as source:
        server = PolicyServerProcess(source.url_for("ckpt/"), "--steps", "2", "--cache-dir", str(tmp_path / "cache"))
        with server.start(wait="listening"):

            def downloading() -> tuple[float, float] | None:
                done = server.metric("policy_checkpoint_downloaded_bytes")
                total = server.metric("policy_checkpoint_size_bytes")
                return (done, total) if done and 0 < done < size and total else None

            done, total = server.wait_until(downloading, 60, "a partial download in /metrics")
            assert total == size and server.readyz().status == 503
            server.wait_ready()
            assert server.metric("policy_checkpoint_downloaded_bytes") == size
            load, warmup = server.metric("policy_load_seconds"), server.metric("policy_warmup_seconds")
            assert load is not None and warmup is not None and load > 0 and warmup > 0
            assert server.metric("policy_world_size") == 1 and server.metric("policy_dp_replicas") == 1
