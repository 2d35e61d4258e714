"""The Kubernetes API emulator behaves like kube-apiserver where kmock 0.8 does not (one test per gap).

Every test talks HTTP to a real server on 127.0.0.1 -- through the ``kubernetes``
client, raw urllib streams, the real kubectl or the real kopf operator.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kopf
import kubernetes.client
import kubernetes.watch
import pytest
import yaml
from kopf.testing import KopfRunner

from tests.support import kube_patches, kube_schema, kube_selectors, kube_tables
from tests.support.kube_emulator import KubeEmulator, KubectlError, api_path
from tests.support.kube_fixtures import kube, kube_module  # noqa: F401 - the fixtures
from tests.support.net import wait_for

GV = "example.test/v1"
WIDGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "widgets.example.test"},
    "spec": {
        "group": "example.test",
        "scope": "Namespaced",
        "names": {"plural": "widgets", "singular": "widget", "kind": "Widget", "shortNames": ["wd"], "categories": ["all"]},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {
                    "status": {},
                    "scale": {
                        "specReplicasPath": ".spec.replicas",
                        "statusReplicasPath": ".status.replicas",
                        "labelSelectorPath": ".status.selector",
                    },
                },
                "additionalPrinterColumns": [
                    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas"},
                    {"name": "Ready", "type": "string", "jsonPath": '.status.conditions[?(@.type=="Ready")].status'},
                    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
                ],
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {
                                "type": "object",
                                "properties": {
                                    "replicas": {"type": "integer", "default": 1, "minimum": 0},
                                    "size": {"type": "string", "enum": ["small", "big"]},
                                    "port": {"x-kubernetes-int-or-string": True},
                                },
                            },
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}
# A CRD without a status subresource: .status is then an ordinary field of the main resource.
GADGET_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "gadgets.example.test"},
    "spec": {
        "group": "example.test",
        "scope": "Cluster",
        "names": {"plural": "gadgets", "singular": "gadget", "kind": "Gadget"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {"openAPIV3Schema": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
            }
        ],
    },
}


def write_yaml(path: Path, *docs: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump_all(docs))
    return path


def widget(name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": GV, "kind": "Widget", "metadata": {"name": name}, "spec": spec}


def configmap(name: str, labels: dict[str, str] | None = None, **data: str) -> dict[str, Any]:
    return {"metadata": {"name": name, "labels": labels or {}}, "data": data}


def status_of(exc: pytest.ExceptionInfo[kubernetes.client.ApiException]) -> dict[str, Any]:
    return json.loads(exc.value.body)


@contextlib.contextmanager
def watch(kube: KubeEmulator, path: str, **params: str) -> Iterator[tuple[Any, Iterator[dict[str, Any]]]]:
    """A raw watch stream: (the HTTP response, an iterator of decoded JSON lines); reads time out after 10s."""
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    response = opener.open(f"{kube.url}{path}?{urllib.parse.urlencode({'watch': 'true', **params})}", timeout=10)
    try:
        yield response, (json.loads(line) for line in iter(response.readline, b"") if line.strip())
    finally:
        response.close()


@pytest.fixture
def widgets(kube: KubeEmulator) -> KubeEmulator:
    kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", WIDGET_CRD)
    return kube


# --- CREATE ---------------------------------------------------------------------------------


def test_create_fills_server_metadata(kube: KubeEmulator) -> None:
    created = kube.create("v1", "configmaps", configmap("a", x="1"), "default")
    meta = created["metadata"]
    assert meta["namespace"] == "default"  # from the URL: the body carried none
    assert len(meta["uid"]) == 36 and int(meta["resourceVersion"]) > 0
    assert meta["creationTimestamp"].endswith("Z") and meta["generation"] == 1
    assert created["apiVersion"] == "v1" and created["kind"] == "ConfigMap"
    other = kube.create("v1", "configmaps", configmap("b"), "default")
    assert int(other["metadata"]["resourceVersion"]) > int(meta["resourceVersion"])  # one global counter
    assert other["metadata"]["uid"] != meta["uid"]
    generated = kube.create("v1", "configmaps", {"metadata": {"generateName": "gen-"}}, "default")
    assert generated["metadata"]["name"].startswith("gen-") and len(generated["metadata"]["name"]) == 9


def test_namespaced_watch_sees_objects_created_without_namespace_in_body(kube: KubeEmulator) -> None:
    kube.create_namespace("w")
    with watch(kube, "/api/v1/namespaces/w/configmaps", timeoutSeconds="5") as (_, events):
        kube.create("v1", "configmaps", configmap("c"), "w")
        event = next(events)
    assert event["type"] == "ADDED" and event["object"]["metadata"]["namespace"] == "w"


def test_duplicate_create_is_409_already_exists(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", configmap("dup"), "default")
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("v1", "configmaps", configmap("dup"), "default")
    assert exc.value.status == 409
    status = status_of(exc)
    assert (status["kind"], status["status"], status["reason"], status["code"]) == ("Status", "Failure", "AlreadyExists", 409)
    assert status["message"] == 'configmaps "dup" already exists'


def test_missing_object_is_404_status(kube: KubeEmulator) -> None:
    assert kube.get("v1", "configmaps", "nope", "default") is None
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.request("GET", api_path("v1", "configmaps", "nope", "default"))
    status = status_of(exc)
    assert (status["apiVersion"], status["kind"], status["code"], status["reason"]) == ("v1", "Status", 404, "NotFound")
    assert status["message"] == 'configmaps "nope" not found'
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.request("GET", api_path("nothing.test/v1", "things", namespace="default"))
    assert exc.value.status == 404 and "not served" in status_of(exc)["message"]


def test_create_needs_an_existing_namespace_and_valid_names(kube: KubeEmulator) -> None:
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("v1", "configmaps", configmap("a"), "absent")
    assert exc.value.status == 404 and status_of(exc)["message"] == 'namespaces "absent" not found'
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("v1", "configmaps", configmap("Upper_Case"), "default")
    assert exc.value.status == 422 and status_of(exc)["reason"] == "Invalid"
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("v1", "configmaps", configmap("a", labels={"k": "a value with spaces"}), "default")
    assert exc.value.status == 422 and "metadata.labels" in status_of(exc)["message"]


def test_list_and_get_namespaces(kube: KubeEmulator) -> None:
    # Plain kmock answers GET /api/v1/namespaces with 500 (its parser takes "namespaces" for a prefix).
    kube.create_namespace("team-a")
    names = [ns["metadata"]["name"] for ns in kube.list("v1", "namespaces")]
    assert {"default", "kube-system", "team-a"} <= set(names)
    ns = kube.get("v1", "namespaces", "team-a")
    assert ns["status"]["phase"] == "Active" and ns["metadata"]["labels"]["kubernetes.io/metadata.name"] == "team-a"


def test_list_has_kind_resource_version_and_pages(kube: KubeEmulator) -> None:
    for n in range(5):
        kube.create("v1", "configmaps", configmap(f"cm{n}"), "default")
    full = kube.request("GET", "/api/v1/namespaces/default/configmaps")
    assert (full["kind"], full["apiVersion"]) == ("ConfigMapList", "v1")
    assert int(full["metadata"]["resourceVersion"]) >= max(int(i["metadata"]["resourceVersion"]) for i in full["items"])
    first = kube.request("GET", "/api/v1/namespaces/default/configmaps", params={"limit": "2"})
    assert [i["metadata"]["name"] for i in first["items"]] == ["cm0", "cm1"] and first["metadata"]["remainingItemCount"] == 3
    rest = kube.request(
        "GET", "/api/v1/namespaces/default/configmaps", params={"limit": "10", "continue": first["metadata"]["continue"]}
    )
    assert [i["metadata"]["name"] for i in rest["items"]] == ["cm2", "cm3", "cm4"] and "continue" not in rest["metadata"]


# --- PATCH and PUT --------------------------------------------------------------------------------


def test_merge_patch_bumps_resource_version_and_generation_on_spec_change(widgets: KubeEmulator) -> None:
    created = widgets.create(GV, "widgets", widget("w", size="small"), "default")
    rv0 = int(created["metadata"]["resourceVersion"])
    labelled = widgets.patch(GV, "widgets", "w", {"metadata": {"labels": {"a": "b"}}}, "default")
    assert int(labelled["metadata"]["resourceVersion"]) > rv0 and labelled["metadata"]["generation"] == 1
    resized = widgets.patch(GV, "widgets", "w", {"spec": {"size": "big"}}, "default")
    assert resized["metadata"]["generation"] == 2 and resized["spec"] == {"size": "big", "replicas": 1}
    noop = widgets.patch(GV, "widgets", "w", {"spec": {"size": "big"}}, "default")
    assert noop["metadata"]["resourceVersion"] == resized["metadata"]["resourceVersion"]  # no-op writes change nothing
    removed = widgets.patch(GV, "widgets", "w", {"metadata": {"labels": {"a": None}}}, "default")
    assert removed["metadata"].get("labels") == {}


def test_json_patch_with_test_op_as_kopf_sends_it(kube: KubeEmulator) -> None:
    cm = kube.create("v1", "configmaps", configmap("j"), "default")
    rv = cm["metadata"]["resourceVersion"]
    ops = [
        {"op": "test", "path": "/metadata/resourceVersion", "value": rv},
        {"op": "add", "path": "/metadata/finalizers", "value": ["example.test/f"]},
    ]
    patched = kube.patch("v1", "configmaps", "j", ops, "default", patch_type="json")
    assert patched["metadata"]["finalizers"] == ["example.test/f"] and patched["metadata"]["resourceVersion"] != rv
    with pytest.raises(kubernetes.client.ApiException) as exc:  # the same test op, now stale
        kube.patch("v1", "configmaps", "j", ops, "default", patch_type="json")
    assert exc.value.status == 422  # kopf reads 422 as "newer changes pending, retry"


def test_merge_patch_with_stale_resource_version_conflicts(kube: KubeEmulator) -> None:
    cm = kube.create("v1", "configmaps", configmap("m"), "default")
    kube.patch("v1", "configmaps", "m", {"data": {"x": "1"}}, "default")
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.patch(
            "v1",
            "configmaps",
            "m",
            {"metadata": {"resourceVersion": cm["metadata"]["resourceVersion"]}, "data": {"x": "2"}},
            "default",
        )
    assert exc.value.status == 409 and status_of(exc)["reason"] == "Conflict"


def test_strategic_merge_patch_merges_lists_by_key(kube: KubeEmulator) -> None:
    pod = {"metadata": {"name": "p"}, "spec": {"containers": [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:1"}]}}
    kube.create("v1", "pods", pod, "default")
    patched = kube.patch(
        "v1", "pods", "p", {"spec": {"containers": [{"name": "b", "image": "b:2"}]}}, "default", patch_type="strategic"
    )
    assert patched["spec"]["containers"] == [{"name": "a", "image": "a:1"}, {"name": "b", "image": "b:2"}]
    merged = kube.patch(
        "v1", "pods", "p", {"spec": {"containers": [{"name": "b", "image": "b:3"}]}}, "default", patch_type="merge"
    )
    assert merged["spec"]["containers"] == [{"name": "b", "image": "b:3"}]  # a JSON merge patch replaces lists


def test_strategic_merge_patch_is_refused_for_custom_resources(widgets: KubeEmulator) -> None:
    widgets.create(GV, "widgets", widget("w"), "default")
    with pytest.raises(kubernetes.client.ApiException) as exc:
        widgets.patch(GV, "widgets", "w", {"spec": {"size": "big"}}, "default", patch_type="strategic")
    assert exc.value.status == 415


def test_put_replaces_and_conflicts_on_stale_resource_version(kube: KubeEmulator) -> None:
    cm = kube.create("v1", "configmaps", configmap("r", x="1", y="2"), "default")
    replaced = kube.replace("v1", "configmaps", {**cm, "data": {"z": "3"}}, "default")
    assert replaced["data"] == {"z": "3"} and replaced["metadata"]["uid"] == cm["metadata"]["uid"]
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.replace("v1", "configmaps", {**cm, "data": {}}, "default")  # cm carries the old resourceVersion
    assert exc.value.status == 409
    unconditional = {"metadata": {"name": "r"}, "data": {"w": "4"}}  # built-ins allow updates without a resourceVersion
    assert kube.replace("v1", "configmaps", unconditional, "default")["data"] == {"w": "4"}


def test_put_of_custom_resource_needs_resource_version(widgets: KubeEmulator) -> None:
    widgets.create(GV, "widgets", widget("w"), "default")
    with pytest.raises(kubernetes.client.ApiException) as exc:
        widgets.replace(GV, "widgets", widget("w", size="big"), "default")
    assert exc.value.status == 422


# --- subresources ---------------------------------------------------------------------------------


def test_status_subresource_split_for_builtins(kube: KubeEmulator) -> None:
    job = kube.create(
        "batch/v1",
        "jobs",
        {"metadata": {"name": "j"}, "spec": {"template": {"spec": {"containers": []}}}, "status": {"succeeded": 9}},
        "default",
    )
    assert "status" not in job  # create ignores .status for resources with a status subresource
    assert job["spec"]["template"]["metadata"]["labels"]["batch.kubernetes.io/job-name"] == "j"
    patched = kube.patch_status("batch/v1", "jobs", "j", {"succeeded": 1}, "default")
    assert patched["status"] == {"succeeded": 1} and patched["metadata"]["generation"] == 1
    ignored = kube.patch("batch/v1", "jobs", "j", {"status": {"succeeded": 5}, "metadata": {"labels": {"k": "v"}}}, "default")
    assert ignored["status"] == {"succeeded": 1} and ignored["metadata"]["labels"] == {"k": "v"}
    not_spec = kube.patch("batch/v1", "jobs", "j", {"spec": {"parallelism": 3}}, "default", subresource="status")
    assert "parallelism" not in not_spec["spec"]  # a /status write changes only .status
    pod = kube.create(
        "v1", "pods", {"metadata": {"name": "p"}, "spec": {"containers": []}, "status": {"phase": "Running"}}, "default"
    )
    assert pod["status"] == {"phase": "Pending"}  # as kube-apiserver sets it


def test_status_subresource_split_for_custom_resources(widgets: KubeEmulator) -> None:
    widgets.create(GV, "widgets", widget("w"), "default")
    patched = widgets.patch_status(GV, "widgets", "w", {"phase": "Ready"}, "default")
    assert patched["status"] == {"phase": "Ready"} and patched["metadata"]["generation"] == 1
    main = widgets.patch(GV, "widgets", "w", {"status": {"phase": "Lost"}, "spec": {"size": "big"}}, "default")
    assert main["status"] == {"phase": "Ready"} and main["spec"]["size"] == "big" and main["metadata"]["generation"] == 2
    status = widgets.get(GV, "widgets", "w", "default")
    replaced = widgets.replace(
        GV, "widgets", {**status, "status": {"phase": "Done"}, "spec": {"size": "small"}}, "default", subresource="status"
    )
    assert replaced["status"] == {"phase": "Done"} and replaced["spec"]["size"] == "big"


def test_without_status_subresource_status_is_a_plain_field(kube: KubeEmulator) -> None:
    kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", GADGET_CRD)
    kube.create(GV, "gadgets", {"metadata": {"name": "g"}, "status": {"on": True}})
    patched = kube.patch(GV, "gadgets", "g", {"status": {"on": False}})
    assert patched["status"] == {"on": False}
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.patch_status(GV, "gadgets", "g", {"on": True})
    assert exc.value.status == 404


def test_scale_subresource_of_a_crd(widgets: KubeEmulator) -> None:
    widgets.create(GV, "widgets", widget("w", replicas=2), "default")
    widgets.patch_status(GV, "widgets", "w", {"replicas": 1, "selector": "app=w"}, "default")
    scale = widgets.request("GET", api_path(GV, "widgets", "w", "default", "scale"))
    assert (scale["kind"], scale["apiVersion"]) == ("Scale", "autoscaling/v1")
    assert scale["spec"] == {"replicas": 2} and scale["status"] == {"replicas": 1, "selector": "app=w"}
    widgets.kubectl("scale", "--replicas=5", "widget/w")
    after = widgets.get(GV, "widgets", "w", "default")
    assert after["spec"]["replicas"] == 5 and after["metadata"]["generation"] == 2 and after["status"]["replicas"] == 1
    with pytest.raises(kubernetes.client.ApiException) as exc:
        widgets.patch(GV, "widgets", "w", {"spec": {"replicas": -1}}, "default", subresource="scale")
    assert exc.value.status == 422


def test_scale_subresource_of_a_statefulset(kube: KubeEmulator) -> None:
    sts = {"metadata": {"name": "s"}, "spec": {"replicas": 1, "selector": {"matchLabels": {"app": "s"}}, "template": {}}}
    kube.create("apps/v1", "statefulsets", sts, "default")
    kube.kubectl("scale", "statefulset/s", "--replicas=3")
    assert kube.get("apps/v1", "statefulsets", "s", "default")["spec"]["replicas"] == 3
    scale = kube.request("GET", api_path("apps/v1", "statefulsets", "s", "default", "scale"))
    assert scale["spec"]["replicas"] == 3 and scale["status"]["selector"] == "app=s"


def test_pod_binding_and_graceful_deletion_on_a_node(kube: KubeEmulator) -> None:
    kube.create(
        "v1", "pods", {"metadata": {"name": "p"}, "spec": {"containers": [], "terminationGracePeriodSeconds": 30}}, "default"
    )
    kube.request(
        "POST",
        api_path("v1", "pods", "p", "default", "binding"),
        {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": "p"}, "target": {"kind": "Node", "name": "node-1"}},
    )
    assert kube.get("v1", "pods", "p", "default")["spec"]["nodeName"] == "node-1"
    terminating = kube.delete("v1", "pods", "p", "default")
    assert terminating["metadata"]["deletionGracePeriodSeconds"] == 30 and kube.get("v1", "pods", "p", "default") is not None
    kube.delete("v1", "pods", "p", "default", grace_period=0)  # what the kubelet sends once the containers are gone
    assert kube.get("v1", "pods", "p", "default") is None


# --- selectors -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", ["a", "b"]),
        ("app==web,tier=front", ["a"]),
        ("app!=web", ["c", "d"]),
        ("tier in (front, back)", ["a", "b", "c"]),
        ("tier notin (front)", ["b", "c", "d"]),
        ("tier", ["a", "b", "c"]),
        ("!tier", ["d"]),
        ("app=web,!tier", []),
    ],
)
def test_label_selectors_on_list(kube: KubeEmulator, selector: str, expected: list[str]) -> None:
    for name, labels in {
        "a": {"app": "web", "tier": "front"},
        "b": {"app": "web", "tier": "back"},
        "c": {"app": "db", "tier": "back"},
        "d": {"app": "db"},
    }.items():
        kube.create("v1", "configmaps", configmap(name, labels), "default")
    assert [o["metadata"]["name"] for o in kube.list("v1", "configmaps", "default", label_selector=selector)] == expected


def test_bad_selectors_are_400(kube: KubeEmulator) -> None:
    for params in ({"labelSelector": "app in (web"}, {"labelSelector": "a=b,"}, {"fieldSelector": "metadata.name~x"}):
        with pytest.raises(kubernetes.client.ApiException) as exc:
            kube.request("GET", "/api/v1/configmaps", params=params)
        assert exc.value.status == 400


def test_field_selectors_on_list(kube: KubeEmulator) -> None:
    kube.create_namespace("other")
    for ns in ("default", "other"):
        kube.create("v1", "configmaps", configmap("same"), ns)
        kube.create("v1", "configmaps", configmap(f"only-{ns}"), ns)
    by_name = kube.list("v1", "configmaps", field_selector="metadata.name=same")
    assert sorted(o["metadata"]["namespace"] for o in by_name) == ["default", "other"]
    in_ns = kube.list("v1", "configmaps", field_selector="metadata.namespace=other,metadata.name!=same")
    assert [o["metadata"]["name"] for o in in_ns] == ["only-other"]
    kube.create("v1", "pods", {"metadata": {"name": "p"}, "spec": {"containers": []}}, "default")
    assert [p["metadata"]["name"] for p in kube.list("v1", "pods", field_selector="status.phase=Pending,spec.nodeName=")] == ["p"]


# --- watch -------------------------------------------------------------------------------------------


def test_watch_streams_json_lines_with_json_content_type(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", configmap("before"), "default")
    with watch(kube, "/api/v1/namespaces/default/configmaps", timeoutSeconds="5") as (response, events):
        assert response.headers["Content-Type"].startswith("application/json")
        assert next(events)["object"]["metadata"]["name"] == "before"  # no resourceVersion: current state first
        kube.patch("v1", "configmaps", "before", {"data": {"x": "1"}}, "default")
        modified = next(events)
        kube.request("DELETE", api_path("v1", "configmaps", "before", "default"))
        deleted = next(events)
    assert (modified["type"], modified["object"]["data"]) == ("MODIFIED", {"x": "1"})
    assert deleted["type"] == "DELETED" and int(deleted["object"]["metadata"]["resourceVersion"]) > int(
        modified["object"]["metadata"]["resourceVersion"]
    )


def test_watch_resumes_from_a_resource_version(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", configmap("old"), "default")
    since = kube.request("GET", "/api/v1/namespaces/default/configmaps")["metadata"]["resourceVersion"]
    kube.create("v1", "configmaps", configmap("new"), "default")
    kube.patch("v1", "configmaps", "old", {"data": {"v": "2"}}, "default")
    with watch(kube, "/api/v1/namespaces/default/configmaps", resourceVersion=since, timeoutSeconds="1") as (_, events):
        seen = [(e["type"], e["object"]["metadata"]["name"]) for e in events]  # the stream ends at timeoutSeconds
    assert seen == [("ADDED", "new"), ("MODIFIED", "old")]


def test_watch_from_an_expired_resource_version_is_410(tmp_path: Path) -> None:
    with KubeEmulator(tmp_path, history_limit=2) as small:
        for n in range(6):
            small.create("v1", "configmaps", configmap(f"c{n}"), "default")
        with watch(small, "/api/v1/configmaps", resourceVersion="1") as (_, events):
            error = next(events)
    assert error["type"] == "ERROR" and error["object"]["code"] == 410


def test_watch_applies_selectors_and_reports_objects_leaving_them(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", configmap("x", {"app": "a"}), "default")
    with watch(kube, "/api/v1/configmaps", labelSelector="app=a", fieldSelector="metadata.name=x", timeoutSeconds="5") as (
        _,
        events,
    ):
        assert next(events)["type"] == "ADDED"
        kube.create("v1", "configmaps", configmap("y", {"app": "a"}), "default")  # filtered out by name
        kube.patch("v1", "configmaps", "x", {"metadata": {"labels": {"app": "b"}}}, "default")
        left = next(events)
        kube.patch("v1", "configmaps", "x", {"metadata": {"labels": {"app": "a"}}}, "default")
        back = next(events)
    assert (left["type"], back["type"]) == ("DELETED", "ADDED")


def test_initial_events_end_with_a_bookmark(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", configmap("i"), "default")
    with watch(
        kube,
        "/api/v1/namespaces/default/configmaps",
        sendInitialEvents="true",
        resourceVersionMatch="NotOlderThan",
        allowWatchBookmarks="true",
        timeoutSeconds="5",
    ) as (_, events):
        added, bookmark = next(events), next(events)
    assert added["type"] == "ADDED"
    assert bookmark["type"] == "BOOKMARK" and bookmark["object"]["metadata"]["annotations"]["k8s.io/initial-events-end"] == "true"


# --- delete, finalizers, garbage collection ---------------------------------------------------------------


def test_delete_waits_for_finalizers(kube: KubeEmulator) -> None:
    kube.create("v1", "configmaps", {"metadata": {"name": "f", "finalizers": ["example.test/hold"]}}, "default")
    marked = kube.delete("v1", "configmaps", "f", "default")
    assert marked["metadata"]["deletionTimestamp"] and kube.get("v1", "configmaps", "f", "default") is not None
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.patch("v1", "configmaps", "f", {"metadata": {"finalizers": ["example.test/hold", "example.test/new"]}}, "default")
    assert exc.value.status == 422  # no new finalizers on an object being deleted
    with watch(kube, "/api/v1/namespaces/default/configmaps", fieldSelector="metadata.name=f", timeoutSeconds="5") as (_, events):
        assert next(events)["type"] == "ADDED"
        kube.patch("v1", "configmaps", "f", {"metadata": {"finalizers": None}}, "default")
        assert next(events)["type"] == "DELETED"
    assert kube.get("v1", "configmaps", "f", "default") is None


def _owned(name: str, *owners: dict[str, Any]) -> dict[str, Any]:
    refs = [
        {"apiVersion": o["apiVersion"], "kind": o["kind"], "name": o["metadata"]["name"], "uid": o["metadata"]["uid"]}
        for o in owners
    ]
    return {"metadata": {"name": name, "ownerReferences": refs}}


def test_garbage_collection_in_background(kube: KubeEmulator) -> None:
    owner = kube.create("v1", "configmaps", configmap("owner"), "default")
    keeper = kube.create("v1", "configmaps", configmap("keeper"), "default")
    child = kube.create("v1", "secrets", _owned("child", owner), "default")
    kube.create("v1", "secrets", _owned("grandchild", child), "default")
    kube.create("v1", "secrets", _owned("shared", owner, keeper), "default")
    kube.delete("v1", "configmaps", "owner", "default")
    assert kube.get("v1", "configmaps", "owner", "default") is None
    assert kube.get("v1", "secrets", "child", "default") is None and kube.get("v1", "secrets", "grandchild", "default") is None
    assert kube.get("v1", "secrets", "shared", "default") is not None  # another owner still exists


def test_garbage_collection_in_foreground_and_orphaning(kube: KubeEmulator) -> None:
    owner = kube.create("v1", "configmaps", configmap("owner"), "default")
    kube.create(
        "v1",
        "secrets",
        {**_owned("held", owner), "metadata": {**_owned("held", owner)["metadata"], "finalizers": ["x/y"]}},
        "default",
    )
    kube.delete("v1", "configmaps", "owner", "default", propagation="Foreground")
    waiting = kube.get("v1", "configmaps", "owner", "default")
    assert "foregroundDeletion" in waiting["metadata"]["finalizers"]  # blocked by its dependent
    assert kube.get("v1", "secrets", "held", "default")["metadata"]["deletionTimestamp"]
    kube.patch("v1", "secrets", "held", {"metadata": {"finalizers": None}}, "default")
    assert kube.get("v1", "secrets", "held", "default") is None and kube.get("v1", "configmaps", "owner", "default") is None

    parent = kube.create("v1", "configmaps", configmap("parent"), "default")
    kube.create("v1", "secrets", _owned("orphan", parent), "default")
    kube.delete("v1", "configmaps", "parent", "default", propagation="Orphan")
    assert kube.get("v1", "secrets", "orphan", "default")["metadata"]["ownerReferences"] == []


def test_delete_collection_by_selector(kube: KubeEmulator) -> None:
    for name, tier in (("a", "x"), ("b", "x"), ("c", "y")):
        kube.create("v1", "configmaps", configmap(name, {"tier": tier}), "default")
    deleted = kube.request("DELETE", "/api/v1/namespaces/default/configmaps", params={"labelSelector": "tier=x"})
    assert sorted(i["metadata"]["name"] for i in deleted["items"]) == ["a", "b"]
    assert [c["metadata"]["name"] for c in kube.list("v1", "configmaps", "default")] == ["c"]


def test_deleting_a_namespace_deletes_its_content(kube: KubeEmulator) -> None:
    kube.create_namespace("gone")
    kube.create("v1", "configmaps", configmap("a"), "gone")
    kube.create("v1", "configmaps", {"metadata": {"name": "held", "finalizers": ["x/y"]}}, "gone")
    kube.delete("v1", "namespaces", "gone")
    assert kube.get("v1", "namespaces", "gone")["status"]["phase"] == "Terminating"
    assert kube.get("v1", "configmaps", "a", "gone") is None
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("v1", "configmaps", configmap("late"), "gone")
    assert exc.value.status == 403
    kube.patch("v1", "configmaps", "held", {"metadata": {"finalizers": []}}, "gone")
    assert kube.get("v1", "namespaces", "gone") is None


# --- discovery, CRDs, kubectl -------------------------------------------------------------------------


def test_discovery_of_builtin_groups(kube: KubeEmulator) -> None:
    assert kube.request("GET", "/api")["versions"] == ["v1"]
    assert kube.kubectl("get", "--raw", "/readyz").stdout == "ok"
    core = kube.request("GET", "/api/v1")
    assert core["groupVersion"] == "v1"  # kmock says "/v1", which kubectl rejects
    groups = {g["name"]: g for g in kube.request("GET", "/apis")["groups"]}
    for group in ("apps", "batch", "apiextensions.k8s.io", "coordination.k8s.io", "events.k8s.io"):
        assert group in groups
    assert groups["autoscaling"]["preferredVersion"]["version"] == "v2"
    apps = {r["name"]: r for r in kube.request("GET", "/apis/apps/v1")["resources"]}
    assert apps["statefulsets"]["shortNames"] == ["sts"] and "shortNames" not in apps["statefulsets/status"]
    assert (apps["statefulsets/scale"]["group"], apps["statefulsets/scale"]["kind"]) == ("autoscaling", "Scale")
    out = kube.kubectl("api-resources", "--api-group=batch", "-o", "name").stdout.split()
    assert out == ["cronjobs.batch", "jobs.batch"]


def test_crd_registration_through_kubectl(kube: KubeEmulator, tmp_path: Path) -> None:
    kube.kubectl("apply", "-f", str(write_yaml(tmp_path / "crd.yaml", WIDGET_CRD)))  # no --validate=false needed
    kube.kubectl("wait", "--for=condition=Established", "crd/widgets.example.test", "--timeout=10s")
    manifest = widget("w", replicas=2, size="big") | {"metadata": {"name": "w", "labels": {"app": "w"}}}
    kube.kubectl("apply", "-f", str(write_yaml(tmp_path / "w.yaml", manifest)))
    table = kube.kubectl("get", "wd").stdout.split("\n")
    assert table[0].split() == ["NAME", "REPLICAS", "READY", "AGE"] and table[1].split()[:2] == ["w", "2"]
    assert "widget.example.test/w" in kube.kubectl("get", "all", "-o", "name").stdout  # categories: [all]
    kube.kubectl(
        "patch",
        "widget",
        "w",
        "--subresource=status",
        "--type=merge",
        "-p",
        json.dumps({"status": {"conditions": [{"type": "Ready", "status": "True"}]}}),
    )
    assert kube.kubectl("get", "widgets", "w", "--no-headers").stdout.split()[:3] == ["w", "2", "True"]
    doc = yaml.safe_load(kube.kubectl("get", "widget", "w", "-o", "yaml").stdout)
    assert doc["metadata"]["labels"] == {"app": "w"} and doc["status"]["conditions"][0]["status"] == "True"
    kube.kubectl("delete", "crd", "widgets.example.test")
    assert kube.get(GV, "widgets", "w", "default") is None
    assert "widgets" not in kube.kubectl("api-resources", "-o", "name").stdout


def test_crd_schema_prunes_defaults_and_validates(widgets: KubeEmulator, tmp_path: Path) -> None:
    created = widgets.create(GV, "widgets", widget("w", size="small", junk="x", port="http"), "default")
    assert created["spec"] == {"size": "small", "port": "http", "replicas": 1}  # junk pruned, replicas defaulted
    with pytest.raises(kubernetes.client.ApiException) as exc:
        widgets.create(GV, "widgets", widget("bad", size="huge", replicas="two"), "default")
    message = status_of(exc)["message"]
    assert exc.value.status == 422 and "spec.size: Unsupported value" in message and "spec.replicas: Invalid value" in message
    failed = widgets.kubectl("apply", "-f", str(write_yaml(tmp_path / "typo.yaml", widget("t", sise="big"))), check=False)
    assert failed.returncode != 0 and 'unknown field "spec.sise"' in failed.stderr  # kubectl asks for Strict validation


def test_bad_crds_are_rejected(kube: KubeEmulator) -> None:
    bad = json.loads(json.dumps(WIDGET_CRD))
    bad["metadata"]["name"] = "wrong.example.test"
    bad["spec"]["versions"][0]["storage"] = False
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.create("apiextensions.k8s.io/v1", "customresourcedefinitions", bad)
    message = status_of(exc)["message"]
    assert (
        exc.value.status == 422 and "must be spec.names.plural" in message and "exactly one version marked as storage" in message
    )


def test_kubectl_workflow(widgets: KubeEmulator, tmp_path: Path) -> None:
    kube = widgets
    kube.kubectl("create", "namespace", "flow")  # kubectl sends this one (and create secret/configmap) as protobuf
    kube.kubectl("create", "secret", "generic", "token", "-n", "flow", "--from-literal=t=tok")
    secret = kube.get("v1", "secrets", "token", "flow")
    assert (secret["data"], secret["type"]) == ({"t": "dG9r"}, "Opaque")
    kube.kubectl(
        "apply",
        "-n",
        "flow",
        "-f",
        str(write_yaml(tmp_path / "w.yaml", widget("w") | {"metadata": {"name": "w", "labels": {"t": "1"}}})),
    )
    assert kube.kubectl("get", "wd", "-n", "flow", "-l", "t=1", "-o", "name").stdout.strip() == "widget.example.test/w"
    kube.kubectl(
        "apply", "-n", "flow", "-f", str(write_yaml(tmp_path / "w.yaml", widget("w", size="big")))
    )  # an update: merge patch
    assert kube.get(GV, "widgets", "w", "flow")["spec"]["size"] == "big"

    watcher = threading.Thread(
        target=lambda: kube.patch_status(GV, "widgets", "w", {"conditions": [{"type": "Ready", "status": "True"}]}, "flow")
    )
    watcher.start()
    kube.kubectl("wait", "-n", "flow", "--for=jsonpath={.status.conditions[0].status}=True", "widget/w", "--timeout=20s")
    watcher.join()
    streamed = kube.kubectl("get", "wd", "-n", "flow", "-w", "--request-timeout=2s", check=False)
    assert "w " in streamed.stdout  # `get -w` lists, then watches until the client timeout
    assert kube.kubectl("get", "wd", "-A", "--no-headers").stdout.split()[:2] == ["flow", "w"]
    assert "Kind:         Widget" in kube.kubectl("describe", "widget", "w", "-n", "flow").stdout
    kube.kubectl("delete", "-n", "flow", "widget", "w", "--timeout=20s")
    assert kube.get(GV, "widgets", "w", "flow") is None
    with pytest.raises(KubectlError, match="NotFound"):
        kube.kubectl("get", "widget", "w", "-n", "flow")


def test_builtin_apply_update_uses_strategic_merge(kube: KubeEmulator, tmp_path: Path) -> None:
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"}, "spec": {"containers": [{"name": "c", "image": "c:1"}]}}
    kube.kubectl("apply", "-f", str(write_yaml(tmp_path / "p.yaml", pod)))
    pod["spec"]["containers"][0]["image"] = "c:2"
    kube.kubectl("apply", "-f", str(write_yaml(tmp_path / "p.yaml", pod)))
    assert kube.get("v1", "pods", "p", "default")["spec"]["containers"] == [{"name": "c", "image": "c:2"}]
    assert any(r.headers.get("Content-Type") == kube_patches.STRATEGIC for r in kube.api["patch"])  # kmock's request views


def test_events_are_stored_and_listable_in_both_apis(kube: KubeEmulator) -> None:
    core = {
        "metadata": {"name": "e1"},
        "involvedObject": {"kind": "ConfigMap", "name": "cm", "namespace": "default"},
        "reason": "Made",
        "message": "hello",
        "type": "Normal",
    }
    kube.create("v1", "events", core, "default")
    kube.create(
        "v1", "events", {**core, "metadata": {"name": "e2"}, "involvedObject": {"kind": "ConfigMap", "name": "other"}}, "default"
    )
    assert [e["reason"] for e in kube.events("default", involved_name="cm")] == ["Made"]
    modern = {
        "metadata": {"name": "e3"},
        "regarding": {"kind": "Pod", "name": "p"},
        "reason": "Pulled",
        "note": "ok",
        "type": "Normal",
        "action": "Pull",
        "reportingController": "kubelet",
        "reportingInstance": "n1",
        "eventTime": "2025-01-01T00:00:00.000000Z",
    }
    kube.create("events.k8s.io/v1", "events", modern, "default")
    assert [e["note"] for e in kube.list("events.k8s.io/v1", "events", "default")] == ["ok"]
    assert "Made" in kube.kubectl("get", "events", "-n", "default").stdout


def test_openapi_stubs(kube: KubeEmulator) -> None:
    index = kube.request("GET", "/openapi/v3")["paths"]
    assert "api/v1" in index and "apis/apps/v1" in index
    doc = kube.request("GET", index["apis/apps/v1"]["serverRelativeURL"].split("?")[0])
    patch = doc["paths"]["/apis/apps/v1/namespaces/{namespace}/statefulsets/{name}"]["patch"]
    assert patch["x-kubernetes-group-version-kind"]["kind"] == "StatefulSet"
    assert any(p["name"] == "fieldValidation" for p in patch["parameters"])
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.request("GET", "/openapi/v2")
    assert exc.value.status == 404


def test_kmock_reactions_still_intercept(kube: KubeEmulator) -> None:
    kube.api["get /api/v1/namespaces/default/configmaps/faulty"] << 503
    with pytest.raises(kubernetes.client.ApiException) as exc:
        kube.request("GET", api_path("v1", "configmaps", "faulty", "default"))
    assert exc.value.status == 503
    assert kube.get("v1", "configmaps", "healthy", "default") is None  # other paths keep the emulated semantics
    assert len(kube.api["get /api/v1/namespaces/default/configmaps/faulty"]) == 1
    kube.create("v1", "configmaps", configmap("tracked"), "default")
    kube.patch("v1", "configmaps", "tracked", {"data": {"k": "v"}}, "default")
    history = kube.api.objects["v1/configmaps", "default", "tracked"].history  # kmock keeps every stored version
    assert [v.raw["data"] for v in history] == [{}, {"k": "v"}]


def test_typed_client_works_against_the_emulator(kube: KubeEmulator) -> None:
    core = kubernetes.client.CoreV1Api(kube.api_client)
    core.create_namespaced_config_map(
        "default", kubernetes.client.V1ConfigMap(metadata=kubernetes.client.V1ObjectMeta(name="typed"), data={"a": "b"})
    )
    listed = core.list_namespaced_config_map("default", label_selector="!nothing")
    assert [c.metadata.name for c in listed.items] == ["typed"] and listed.kind == "ConfigMapList"
    apps = kubernetes.client.AppsV1Api(kube.api_client)
    body = {
        "metadata": {"name": "s"},
        "spec": {
            "replicas": 1,
            "selector": {"matchLabels": {"a": "s"}},
            "serviceName": "s",
            "template": {"metadata": {"labels": {"a": "s"}}, "spec": {"containers": [{"name": "c", "image": "i"}]}},
        },
    }
    apps.create_namespaced_stateful_set("default", body)
    apps.patch_namespaced_stateful_set_status("s", "default", {"status": {"replicas": 1, "readyReplicas": 1}})
    assert apps.read_namespaced_stateful_set("s", "default").status.ready_replicas == 1


def test_client_watch_follows_pods_of_a_node(kube: KubeEmulator) -> None:
    """What a kubelet (the local node) does: watch the pods bound to it and report their status."""
    for name, node in (("mine", "node-1"), ("other", "node-2")):
        kube.create("v1", "pods", {"metadata": {"name": name}, "spec": {"nodeName": node, "containers": []}}, "default")
    core = kubernetes.client.CoreV1Api(kube.api_client)
    seen = []
    for event in kubernetes.watch.Watch().stream(
        core.list_pod_for_all_namespaces, field_selector="spec.nodeName=node-1", timeout_seconds=5
    ):
        seen.append((event["type"], event["object"].metadata.name, event["object"].status.phase))
        if len(seen) == 1:
            kube.patch_status("v1", "pods", "other", {"phase": "Running"}, "default")  # not ours: filtered out
            kube.patch_status("v1", "pods", "mine", {"phase": "Running"}, "default")
        else:
            break
    assert seen == [("ADDED", "mine", "Pending"), ("MODIFIED", "mine", "Running")]


# --- the real kopf operator ----------------------------------------------------------------------------------

TOY_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "toys.example.test"},
    "spec": {
        "group": "example.test",
        "scope": "Namespaced",
        "names": {"plural": "toys", "singular": "toy", "kind": "Toy"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "subresources": {"status": {}},
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {
                            "spec": {"type": "object", "properties": {"greeting": {"type": "string"}}},
                            "status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True},
                        },
                    }
                },
            }
        ],
    },
}


def test_toy_kopf_operator(kube: KubeEmulator, tmp_path: Path) -> None:
    kube.apply_crd(write_yaml(tmp_path / "toys.yaml", TOY_CRD))
    kube.create_namespace("toys")
    registry = kopf.OperatorRegistry()
    kube.kopf_login(registry)
    released: list[str] = []

    @kopf.on.create("example.test", "v1", "toys", registry=registry)
    def make_configmap(spec: dict[str, Any], name: str, namespace: str, body: Any, patch: Any, **_: Any) -> None:
        child = {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": f"{name}-cm"},
            "data": {"greeting": spec["greeting"]},
        }
        kopf.adopt(child, owner=body)
        kube.create("v1", "configmaps", child, namespace)
        patch.status["phase"] = "Ready"
        kopf.info(body, reason="ConfigMapCreated", message=f"{name}-cm")

    @kopf.on.delete("example.test", "v1", "toys", registry=registry)
    def release(name: str, **_: Any) -> None:
        released.append(name)

    settings = kopf.OperatorSettings()
    settings.watching.server_timeout = 10  # exercise server-side watch timeouts and reconnections too
    with KopfRunner(["run", "--standalone", "--namespace=toys", "--verbose"], registry=registry, settings=settings, timeout=30):
        toy = kube.create(GV, "toys", {"metadata": {"name": "t1"}, "spec": {"greeting": "hi"}}, "toys")
        ready = wait_for(
            lambda: (kube.get(GV, "toys", "t1", "toys") or {}).get("status", {}).get("phase") == "Ready",
            20,
            what="status.phase=Ready",
        )
        assert ready
        cm = kube.get("v1", "configmaps", "t1-cm", "toys")
        assert cm["data"] == {"greeting": "hi"} and cm["metadata"]["ownerReferences"][0]["uid"] == toy["metadata"]["uid"]
        assert kube.get(GV, "toys", "t1", "toys")["metadata"]["finalizers"] == ["kopf.zalando.org/KopfFinalizerMarker"]
        wait_for(
            lambda: any(e["reason"] == "ConfigMapCreated" for e in kube.events("toys", involved_name="t1")),
            20,
            what="kopf's event",
        )

        kube.delete(GV, "toys", "t1", "toys")
        wait_for(lambda: kube.get(GV, "toys", "t1", "toys") is None, 20, what="the finalizer removed by kopf")
        assert kube.get("v1", "configmaps", "t1-cm", "toys") is None  # garbage-collected with its owner
    assert released == ["t1"]
    namespace_lists = [r for r in kube.api if r.url.path == "/api/v1/namespaces" and r.method.value == "GET"]
    assert namespace_lists, "kopf lists namespaces at start (500 in plain kmock)"


def test_kopf_in_a_subprocess_logs_in_through_kubeconfig(kube: KubeEmulator, tmp_path: Path) -> None:
    operator = tmp_path / "operator.py"
    operator.write_text(
        "import kopf\n\n@kopf.on.create('v1', 'configmaps')\ndef mark(patch, **_):\n    patch.metadata.labels['seen'] = 'yes'\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kopf", "run", "--standalone", "--namespace=default", str(operator)],
        env=kube.env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        kube.create("v1", "configmaps", configmap("c"), "default")
        wait_for(
            lambda: (kube.get("v1", "configmaps", "c", "default")["metadata"].get("labels") or {}).get("seen") == "yes",
            30,
            what="the subprocess operator's label",
        )
    finally:
        proc.terminate()
        output = proc.communicate(timeout=30)[0]
    assert "login_via_client' succeeded" in output  # kopf's own kubeconfig login, pointed here by KUBECONFIG


def test_module_scoped_fixture_is_one_server(kube_module: KubeEmulator) -> None:
    kube_module.create_namespace("module-shared")
    assert kube_module.get("v1", "namespaces", "module-shared")["metadata"]["name"] == "module-shared"


# --- the pure pieces ---------------------------------------------------------------------------------------------


def test_selector_parsing_and_matching() -> None:
    reqs = kube_selectors.parse_label_selector("a=1, b != 2, c in (x,y), d notin (z), e, !f, g>3")
    assert [r.op for r in reqs] == ["=", "!=", "in", "notin", "exists", "!", ">"]
    assert kube_selectors.labels_match(reqs, {"metadata": {"labels": {"a": "1", "c": "x", "e": "", "g": "4"}}})
    assert not kube_selectors.labels_match(reqs, {"metadata": {"labels": {"a": "1", "c": "x", "e": "", "g": "3"}}})
    with pytest.raises(kube_selectors.SelectorError):
        kube_selectors.parse_label_selector("bad key=1")
    sel = {
        "matchLabels": {"a": "1"},
        "matchExpressions": [{"key": "b", "operator": "In", "values": ["y", "x"]}, {"key": "c", "operator": "DoesNotExist"}],
    }
    assert kube_selectors.label_selector_to_string(sel) == "a=1,b in (x,y),!c"


def test_schema_pruning_keeps_embedded_and_preserved_fields() -> None:
    schema = {
        "type": "object",
        "properties": {
            "spec": {
                "type": "object",
                "properties": {
                    "template": {
                        "type": "object",
                        "x-kubernetes-embedded-resource": True,
                        "x-kubernetes-preserve-unknown-fields": True,
                    },
                    "items": {
                        "type": "array",
                        "items": {"type": "object", "properties": {"n": {"type": "integer", "default": 0}}},
                    },
                    "labels": {"type": "object", "additionalProperties": {"type": "string"}},
                },
            }
        },
    }
    obj = {
        "apiVersion": "x/v1",
        "kind": "X",
        "metadata": {"name": "n"},
        "junk": 1,
        "spec": {
            "template": {"apiVersion": "v1", "kind": "Pod", "anything": 1},
            "items": [{"n": 1, "m": 2}, {}],
            "labels": {"a": "b"},
        },
    }
    dropped = kube_schema.prune(obj, schema)
    kube_schema.apply_defaults(obj, schema)
    assert sorted(dropped) == ["junk", "spec.items[0].m"]
    assert obj["spec"] == {
        "template": {"apiVersion": "v1", "kind": "Pod", "anything": 1},
        "items": [{"n": 1}, {"n": 0}],
        "labels": {"a": "b"},
    }
    assert kube_schema.validate(obj, schema) == []


def test_strategic_merge_directives() -> None:
    target = {
        "metadata": {"finalizers": ["a"]},
        "spec": {"containers": [{"name": "x", "env": [{"name": "A", "value": "1"}]}, {"name": "y"}]},
    }
    patch = {
        "metadata": {"finalizers": ["b"], "$deleteFromPrimitiveList/finalizers": ["a"]},
        "spec": {
            "containers": [{"name": "x", "env": [{"name": "B", "value": "2"}]}, {"name": "y", "$patch": "delete"}],
            "$setElementOrder/containers": [{"name": "x"}],
        },
    }
    result = kube_patches.strategic_merge_patch(target, patch)
    assert result == {
        "metadata": {"finalizers": ["b"]},
        "spec": {"containers": [{"name": "x", "env": [{"name": "A", "value": "1"}, {"name": "B", "value": "2"}]}]},
    }


def test_printer_jsonpath_and_ages() -> None:
    obj = {
        "metadata": {"name": "n", "creationTimestamp": "2020-01-01T00:00:00Z"},
        "status": {"conditions": [{"type": "A", "status": "False"}, {"type": "Ready", "status": "True"}], "n": 3},
    }
    assert kube_tables.jsonpath_values(obj, '.status.conditions[?(@.type=="Ready")].status') == ["True"]
    assert kube_tables.jsonpath_values(obj, "{.status.conditions[*].type}") == ["A", "Ready"]
    assert kube_tables.jsonpath_values(obj, ".status.conditions[-1].type") == ["Ready"]
    assert [kube_tables.human_duration(s) for s in (5, 125, 3600 * 5 + 60, 86400 * 3)] == ["5s", "2m5s", "5h1m", "3d"]
    cols = [
        {"name": "N", "type": "integer", "jsonPath": ".status.n"},
        {"name": "Gone", "type": "string", "jsonPath": ".status.gone"},
    ]
    row = kube_tables.table([obj], cols, "1")["rows"][0]
    assert row["cells"] == ["n", 3, None] and row["object"]["kind"] == "PartialObjectMetadata"
    with pytest.raises(ValueError):
        kube_tables.check_jsonpath(".a..b")
