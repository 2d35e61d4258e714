"""The chart's NetworkPolicy admits exactly the operator and the listed clients to the PolicyServer pods.

Rendered by Helm's own engine; the chart-wide checks (lint, strict schema
validation, labels, namespaces) run on its value sets in tests/test_chart.py.
Here: the policy selects the pods the operator really creates (their labels
from ``manifests.build_statefulset``), on the port name the server container
really declares, and lets in the operator's own pods from the release namespace.
"""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator import manifests
from policy_operator.operator.spec import parse_spec
from tests.support.chart import CHART, NS, RELEASE, chart


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart().validate_schema(values)
    files = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NS)
    return [
        o
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for o in yaml.safe_load_all(text)
        if o
    ]


def matches(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) <= {"matchLabels"}, selector
    return all(labels.get(k) == v for k, v in selector.get("matchLabels", {}).items())


def test_off_by_default() -> None:
    assert not [o for o in render({}) if o["kind"] == "NetworkPolicy"]


def test_it_guards_the_server_pods_of_each_watched_namespace_on_their_ws_port() -> None:
    objs = render({"networkPolicy": {"enabled": True}, "watchNamespaces": ["team-a", "team-b"]})
    policies = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert sorted(p["metadata"]["namespace"] for p in policies) == ["team-a", "team-b"]
    sts = manifests.build_statefulset(
        parse_spec({"image": "i:1", "checkpoint": {"source": "hf://o/p"}}, name="ps", namespace="team-a")
    )
    pod_labels = sts["spec"]["template"]["metadata"]["labels"]
    (server,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == manifests.SERVER_CONTAINER]
    fetch_labels = manifests.build_fetch_job(
        parse_spec({"image": "i:1", "checkpoint": {"source": "hf://o/p"}}, name="ps", namespace="team-a")
    )["spec"]["template"]["metadata"]["labels"]
    operator = next(o for o in objs if o["kind"] == "Deployment")
    operator_labels = operator["spec"]["template"]["metadata"]["labels"]
    for policy in policies:
        spec = policy["spec"]
        assert matches(spec["podSelector"], pod_labels) and not matches(spec["podSelector"], fetch_labels)
        assert spec["policyTypes"] == ["Ingress"]
        (rule,) = spec["ingress"]
        assert rule["ports"] == [{"port": C.PORT_NAME, "protocol": "TCP"}]
        assert C.PORT_NAME in [p["name"] for p in server["ports"]]
        operator_peer, *clients = rule["from"]
        assert operator_peer["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": NS}}
        assert matches(operator_peer["podSelector"], operator_labels)
        assert clients == [{"podSelector": {"matchLabels": {"policyoperator.io/client": "true"}}}]


def test_all_namespaces_needs_the_namespaces_named() -> None:
    with pytest.raises(Exception, match="networkPolicy.namespaces"):
        render({"networkPolicy": {"enabled": True}, "watchAllNamespaces": True})
    objs = render(
        {"networkPolicy": {"enabled": True, "namespaces": ["team-a"], "clients": []}, "watchAllNamespaces": True}
    )
    (policy,) = [o for o in objs if o["kind"] == "NetworkPolicy"]
    assert policy["metadata"]["namespace"] == "team-a" and len(policy["spec"]["ingress"][0]["from"]) == 1


def test_lint_is_clean() -> None:
    report = helm_python.lint(
        CHART, {"networkPolicy": {"enabled": True}}, strict=True, namespace=NS, kube_version="v1.32.0"
    )
    assert report["errors"] == [] and [m for m in report["messages"] if m["severity"] >= 2] == []
