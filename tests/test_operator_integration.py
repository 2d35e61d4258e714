"""The real operator (``policyserver operator`` in a subprocess) against the real control plane and the local node.

The session's control plane runs the real Job, StatefulSet, garbage-collector,
PV and scheduler controllers; the local node runs the pods (the fetch is the
real ``policyserver fetch`` from a loopback checkpoint server, the server is
torchrun with gloo on CPU, 2 steps).  What this module pins down is the
operator's contract with them: children in order and each created once,
per-rank status, Events, a fetch failure's message, a checkpoint change that
downloads once then rolls, ``kubectl scale``, deletion with and without
``retainOnDelete``, convergence after being SIGKILLed mid-reconcile, leader
election through kopf peering, and a PolicyServer that asks for more GPUs
than the node has.  Faults are real ones: the operator process is killed;
there is no fault injection into the API server.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.manifests import Names
from policy_operator.source_uri import checkpoint_key
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.kubectl_table import table
from tests.support.local_node_api import Api
from tests.support.local_node_cluster import LocalCluster, OperatorProcess, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
NS = "operator-it"
PS = (C.API_VERSION, C.PLURAL)
RESYNC_S = 0.5
WAIT_S = 120.0
NODE_GPUS = 2
CHILDREN = (("v1", "persistentvolumeclaims"), ("batch/v1", "jobs"), ("apps/v1", "statefulsets"), ("v1", "services"))


@dataclass
class Cluster:
    lc: LocalCluster
    source: CheckpointServer
    port: int
    recorder: Recorder

    @property
    def api(self) -> Api:
        return self.lc.api


class Recorder:
    """Every child object that ever existed in NS, by (plural, name) -> the uids seen, from watches.

    With a real API server there is no request log to count POSTs in; a child created twice (a duplicate, or
    deleted and made again) shows up as a second uid under one name.
    """

    def __init__(self, api: Api) -> None:
        self.api = api
        self.uids: dict[tuple[str, str], list[str]] = {}
        self.order: list[tuple[str, str]] = []  # (plural, name) in the order first seen
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._watch, args=gp, daemon=True) for gp in CHILDREN]

    def start(self) -> Recorder:
        for t in self._threads:
            t.start()
        return self

    def stop(self) -> None:
        self._stop.set()

    def _watch(self, group_version: str, plural: str) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                for kind, obj in self.api.watch(group_version, plural, NS, timeout_s=5):
                    if kind == "ADDED":
                        key, uid = (plural, obj["metadata"]["name"]), obj["metadata"]["uid"]
                        with self._lock:
                            uids = self.uids.setdefault(key, [])
                            if uid not in uids:
                                uids.append(uid)
                                self.order.append(key)

    def created(self, plural: str, instance: str | None = None) -> list[str]:
        """Names of that plural created (once each; a name made twice appears twice), optionally of one instance."""
        with self._lock:
            return [
                name
                for (p, name) in self.order
                if p == plural and (instance is None or name == instance or name.startswith(f"{instance}-"))
            ]


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    work = tmp_path_factory.mktemp("operator-it")
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "v2"), "--seed", "1"],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=RESYNC_S, gpus=NODE_GPUS)
    lc.operator.probe_timeout_s = 0.5
    recorder = Recorder(lc.api)
    try:
        lc.start()
        recorder.start()
        yield Cluster(lc, source, free_port_on(["127.0.0.1", *lc.node.ips(16)]), recorder)
    finally:
        recorder.stop()
        lc.stop()
        source.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / f"policyserver-{name}.yaml").read_text())


def runnable(c: Cluster, name: str, *, sample: str = "minimal", path: str = "ckpt/", **spec: Any) -> dict[str, Any]:
    doc = for_local_node(example(sample), source=c.source.url_for(path), port=c.port)
    doc["metadata"]["name"] = name
    doc["spec"].update(spec)
    return doc


def apply(c: Cluster, obj: dict[str, Any]) -> None:
    c.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))


def status_of(c: Cluster, name: str) -> dict[str, Any]:
    return c.lc.status(name)


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((x for x in status.get("conditions") or [] if x["type"] == kind), {})


def wait_status(
    c: Cluster, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = WAIT_S
) -> dict[str, Any]:
    return c.lc.wait_status(name, predicate, what, timeout)


def names_of(c: Cluster, group_version: str, plural: str, selector: str | None = None) -> list[str]:
    return sorted(o["metadata"]["name"] for o in c.lc.list(group_version, plural, selector))


def events(c: Cluster, name: str) -> list[tuple[str, str, str]]:
    return [
        (e.get("type", ""), e.get("reason", ""), e.get("message", "")) for e in c.api.events(NS, involved_name=name)
    ]


def children(c: Cluster, name: str) -> list[str]:
    return [f"{plural}/{n}" for gv, plural in CHILDREN for n in names_of(c, gv, plural, f"{C.LABEL_INSTANCE}={name}")]


def delete(c: Cluster, name: str) -> None:
    """``kubectl delete`` and wait until the garbage collector took every child (so the next test starts clean)."""
    c.lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)
    wait_for(lambda: not children(c, name), WAIT_S, what=f"children of {name} collected")


# --- tests -----------------------------------------------------------------------------------


def test_fetch_then_serve_in_order_with_per_rank_status_and_events(cluster: Cluster) -> None:
    c = cluster
    name = "serve"
    doc = runnable(c, name, replicas=2)
    key = checkpoint_key(doc["spec"]["checkpoint"]["source"])
    apply(c, doc)
    status = wait_status(c, name, lambda s: s.get("phase") == C.PHASE_READY, "phase Ready")
    assert (status["ready"], status["ranksReady"], status["layout"]) == ("2/2", "2/2", "cfgp=1,dp=1")
    assert status["endpoint"] == f"ws://{name}.{NS}.svc:{c.port}"
    assert status["checkpoint"]["phase"] == "Ready" and status["checkpoint"]["key"] == key
    assert condition(status, C.COND_AVAILABLE)["status"] == "True"
    assert condition(status, C.COND_VALID)["status"] == "True"
    assert all(x["observedGeneration"] == 1 for x in status["conditions"])
    for pod in status["pods"]:
        assert pod["ranksReady"] == "1/1" and [r["ready"] for r in pod["ranks"]] == [True]

    # the cache claim and the fetch Job first; the StatefulSet only once the Job had completed; then Services
    mine = {
        ("persistentvolumeclaims", Names(name).pvc),
        ("jobs", Names(name).job(key)),
        ("statefulsets", name),
        ("services", name),
        ("services", Names(name).headless_service),
    }
    created = [k for k in c.recorder.order if k in mine]  # (the cache-GC Job, made later, is not part of this)
    assert sorted(created[3:]) == [("services", name), ("services", Names(name).headless_service)], created
    assert created[:3] == [
        ("persistentvolumeclaims", Names(name).pvc),
        ("jobs", Names(name).job(key)),
        ("statefulsets", name),
    ]
    job = c.lc.existing("batch/v1", "jobs", Names(name).job(key))
    sts = c.lc.existing("apps/v1", "statefulsets", name)
    done = next(x["lastTransitionTime"] for x in job["status"]["conditions"] if x["type"] == "Complete")
    assert sts["metadata"]["creationTimestamp"] >= done
    assert sts["spec"]["replicas"] == 2 and C.GPU_RESOURCE not in json.dumps(sts["spec"]["template"])

    wait_for(
        lambda: all(
            (p["metadata"].get("annotations") or {}).get(C.ANNOTATION_RANKS_READY) == "1/1"
            for p in c.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
        ),
        WAIT_S,
        what="per-pod ranks annotations",
    )
    row = table(c.lc.kubectl("get", C.SHORT_NAME, name).stdout)[0]  # the CRD's printer columns, as kubectl prints
    assert {k: row[k] for k in ("NAME", "READY", "RANKS", "LAYOUT", "CHECKPOINT", "PHASE", "ENDPOINT")} == {
        "NAME": name,
        "READY": "2/2",
        "RANKS": "2/2",
        "LAYOUT": "cfgp=1,dp=1",
        "CHECKPOINT": "Ready",
        "PHASE": "Ready",
        "ENDPOINT": status["endpoint"],
    }
    evs = events(c, name)
    created = [
        (m.group(1), m.group(2))
        for t, r, text in evs
        if r == "Created" and (m := re.match(r"created (?:fetch )?(\w+) (\S+)", text))
    ]
    assert len(created) == len(set(created)), created  # each child announced once
    assert {
        ("PersistentVolumeClaim", Names(name).pvc),
        ("Job", Names(name).job(key)),
        ("StatefulSet", name),
        ("Service", name),
        ("Service", Names(name).headless_service),
    } <= set(created), created
    assert {("Normal", "Downloaded"), ("Normal", "Ready")} <= {(t, r) for t, r, _ in evs}
    assert c.lc.operator.probe()["reconciler"]["failures"] == 0


def test_checkpoint_change_downloads_once_then_rolls_and_scale_works(cluster: Cluster) -> None:
    c = cluster
    name = "serve"  # the previous test's PolicyServer, Ready
    key_a = status_of(c, name)["checkpoint"]["key"]
    sts = c.lc.existing("apps/v1", "statefulsets", name)
    hash_a = sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]
    old_pods = {
        p["metadata"]["uid"]
        for p in c.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    }

    patch = {"spec": {"checkpoint": {"source": c.source.url_for("v2/")}}}
    c.lc.kubectl("patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps(patch))
    key_b = checkpoint_key(c.source.url_for("v2/"))
    wait_status(c, name, lambda s: s.get("checkpoint", {}).get("servingKey") == key_b, "serving checkpoint B")
    # the real StatefulSet controller rolls the pods one at a time, each once the others are Ready
    sts = wait_for(
        lambda: (
            (s := c.lc.get("apps/v1", "statefulsets", name))
            and s["status"].get("observedGeneration") == s["metadata"]["generation"]
            and s["status"].get("updatedReplicas") == 2
            and s["status"].get("readyReplicas") == 2
            and s["status"].get("currentRevision") == s["status"].get("updateRevision")
            and s
        ),
        240,
        what="the StatefulSet rolled to checkpoint B",
    )
    status = wait_status(
        c, name, lambda s: s.get("phase") == C.PHASE_READY and s.get("ready") == "2/2", "Ready on checkpoint B"
    )
    assert status["checkpoint"]["key"] == key_b
    assert sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH] != hash_a
    assert f"{C.CACHE_MOUNT_PATH}/{key_b}" in sts["spec"]["template"]["spec"]["containers"][0]["command"]
    new_pods = {
        p["metadata"]["uid"]
        for p in c.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    }
    assert not new_pods & old_pods  # the real StatefulSet controller replaced every pod
    fetch_jobs = [j for j in c.recorder.created("jobs", name) if j.startswith(f"{name}-fetch-")]
    assert fetch_jobs == [Names(name).job(key_a), Names(name).job(key_b)]
    assert c.source.count("/v2/model.safetensors") == 1  # downloaded once, for both pods
    c.api.wait_event(NS, name, "Normal", "Updated", message=f"checkpoint {key_a} -> {key_b}")

    # kubectl scale goes through the scale subresource -> spec.replicas -> StatefulSet replicas, no roll
    hash_b = sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]
    c.lc.kubectl("scale", f"{C.PLURAL}/{name}", "--replicas=1")
    status = wait_status(c, name, lambda s: s.get("ready") == "1/1" and s.get("replicas") == 1, "scaled to 1")
    sts = c.lc.existing("apps/v1", "statefulsets", name)
    assert sts["spec"]["replicas"] == 1 and sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH] == hash_b
    assert set(status["selector"].split(",")) == {f"{k}={v}" for k, v in sts["spec"]["selector"]["matchLabels"].items()}
    wait_for(
        lambda: (
            len(c.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")) == 1
        ),
        WAIT_S,
        what="the highest pod deleted by the controller",
    )
    assert c.recorder.created("statefulsets", name) == [name]
    delete(c, name)


def test_fetch_failure_reports_the_fetch_error(cluster: Cluster) -> None:
    c = cluster
    name = "badhash"
    doc = runnable(c, name)
    doc["spec"]["checkpoint"]["sha256"] = {C.WEIGHTS_FILE: "0" * 64}
    apply(c, doc)
    status = wait_status(c, name, lambda s: s.get("phase") == C.PHASE_FAILED, "phase Failed")
    ck = condition(status, C.COND_CHECKPOINT_READY)
    assert (ck["status"], ck["reason"]) == ("False", "VerificationFailed"), ck
    assert C.WEIGHTS_FILE in ck["message"] and "sha256" in ck["message"]
    assert status["checkpoint"]["phase"] == "Failed"
    job = c.lc.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={name}")[0]
    failed = next(x for x in job["status"]["conditions"] if x["type"] == "Failed")
    assert failed["reason"] == "PodFailurePolicy"  # the real Job controller matched the fatal exit code
    c.api.wait_event(NS, name, "Warning", "VerificationFailed")
    c.lc.operator.settle()
    assert names_of(c, "apps/v1", "statefulsets", f"{C.LABEL_INSTANCE}={name}") == []
    assert len(c.recorder.created("jobs", name)) == 1
    delete(c, name)


def test_delete_cascades_and_retain_on_delete_keeps_the_cache(cluster: Cluster) -> None:
    c = cluster
    for name, retain in (("drop", False), ("keep", True)):
        apply(c, runnable(c, name, storage={"retainOnDelete": retain}))

        def jobs_of(n: str = name) -> list[str]:
            return names_of(c, "batch/v1", "jobs", f"{C.LABEL_INSTANCE}={n}")

        wait_for(jobs_of, WAIT_S, what=f"Job of {name}")
    keep_pvc = c.lc.existing("v1", "persistentvolumeclaims", "keep-cache")
    assert not keep_pvc["metadata"].get("ownerReferences")
    assert (
        c.lc.existing("v1", "persistentvolumeclaims", "drop-cache")["metadata"]["ownerReferences"][0]["name"] == "drop"
    )

    c.lc.kubectl("delete", C.SHORT_NAME, "drop", "--wait=false")
    wait_for(
        lambda: c.lc.get(*PS, "drop") is None and not children(c, "drop"),
        WAIT_S,
        what="the garbage collector's cascade of drop",
    )
    c.lc.kubectl("delete", C.SHORT_NAME, "keep", "--wait=false")
    wait_for(
        lambda: c.lc.get(*PS, "keep") is None and children(c, "keep") == ["persistentvolumeclaims/keep-cache"],
        WAIT_S,
        what="cascade of keep, cache retained",
    )

    apply(c, runnable(c, "keep", storage={"retainOnDelete": False}))  # a new owner adopts the retained cache
    wait_for(
        lambda: (
            (c.lc.existing("v1", "persistentvolumeclaims", "keep-cache")["metadata"].get("ownerReferences") or [{}])[
                0
            ].get("uid")
            == c.lc.existing(*PS, "keep")["metadata"]["uid"]
        ),
        WAIT_S,
        what="retained PVC adopted",
    )
    assert c.lc.existing("v1", "persistentvolumeclaims", "keep-cache")["metadata"]["uid"] == keep_pvc["metadata"]["uid"]
    assert c.recorder.created("persistentvolumeclaims", "keep") == ["keep-cache"]  # never a second keep-cache
    c.lc.kubectl("delete", C.SHORT_NAME, "keep", "--wait=false")
    wait_for(lambda: not children(c, "keep"), WAIT_S, what="keep collected with its cache")


def test_operator_killed_mid_reconcile_converges_without_duplicates(cluster: Cluster) -> None:
    c = cluster
    name = "killed"
    c.lc.operator.stop()
    op = OperatorProcess(
        c.lc.control_plane.env, NS, c.lc.workdir / "killed.log", resync_s=RESYNC_S, probe_timeout_s=0.5
    )
    try:
        op.start()
        apply(c, runnable(c, name))
        wait_for(lambda: c.recorder.created("jobs", name), WAIT_S, interval=0.01, what="the fetch Job")
        op.stop(signal.SIGKILL)  # right after the Job was created: that pass never wrote its status
        wait_for(
            lambda: (
                (j := c.lc.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={name}"))
                and (j[0].get("status") or {}).get("succeeded")
            ),
            WAIT_S,
            what="the Job done while no operator runs",
        )
        op.start()
        wait_for(lambda: c.recorder.created("statefulsets", name), WAIT_S, interval=0.01, what="the StatefulSet")
        op.stop(signal.SIGKILL)  # right after the StatefulSet: the Services of that pass never came
        op.start()
        status = wait_status(c, name, lambda s: s.get("phase") == C.PHASE_READY, "Ready after two crashes")
        assert status["checkpoint"]["phase"] == "Ready"
        op.settle()
        for plural, count in (("persistentvolumeclaims", 1), ("jobs", 1), ("statefulsets", 1), ("services", 2)):
            made = [n for n in c.recorder.created(plural, name) if plural != "jobs" or "-fetch-" in n]
            assert len(made) == count, (plural, made)
        created = [m for _, r, m in events(c, name) if r == "Created"]
        assert len(created) == len(set(created))  # nothing created twice (Events of the killed passes may be lost)
        assert "Traceback" not in op.log.read_text()
    finally:
        op.stop()
        c.lc.operator.start()
    delete(c, name)


def test_more_gpus_than_the_node_has_stays_pending_and_says_so(cluster: Cluster) -> None:
    c = cluster
    name = "greedy"
    doc = runnable(c, name, parallelism={"cfgp": 2, "dp": 2})  # 4 ranks: 4 GPUs per pod on cuda; the node has 2
    doc["spec"]["runtime"]["device"] = "cuda"
    apply(c, doc)
    status = wait_status(
        c,
        name,
        lambda s: "Insufficient" in condition(s, C.COND_AVAILABLE).get("message", ""),
        "Available=False saying the pod does not fit",
    )
    available = condition(status, C.COND_AVAILABLE)
    assert available["status"] == "False" and available["reason"] == "Unschedulable", available
    assert f"Insufficient {C.GPU_RESOURCE}" in available["message"]
    assert status["phase"] == C.PHASE_PENDING and status["checkpoint"]["phase"] == "Ready"
    pod = c.lc.existing("v1", "pods", f"{name}-0")
    assert not pod["spec"].get("nodeName") and c.lc.node.pod(NS, f"{name}-0") is None
    c.api.wait_event(NS, name, "Warning", "Unschedulable")
    delete(c, name)


KOPF_PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {
        "group": "kopf.dev",
        "scope": "Namespaced",
        "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "properties": {"status": {"type": "object", "x-kubernetes-preserve-unknown-fields": True}},
                    }
                },
            }
        ],
    },
}


def test_two_replicas_elect_one_leader_through_kopf_peering(cluster: Cluster) -> None:
    c = cluster
    c.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(KOPF_PEERING_CRD))
    c.lc.kubectl("wait", "--for=condition=Established", "crd/kopfpeerings.kopf.dev", "--timeout=60s")
    c.lc.kubectl(
        "apply",
        "-f",
        "-",
        input=yaml.safe_dump(
            {"apiVersion": "kopf.dev/v1", "kind": "KopfPeering", "metadata": {"name": C.PEERING_NAME}}
        ),
    )
    c.lc.kubectl("delete", C.SHORT_NAME, "--all", "--timeout=120s", timeout=150)  # what a failed test left
    c.lc.operator.stop()
    work = c.lc.workdir
    low = OperatorProcess(
        c.lc.control_plane.env,
        NS,
        work / "low.log",
        resync_s=RESYNC_S,
        peering=["--peering", C.PEERING_NAME, "--priority", "10"],
        log_format="json",
    )
    high = OperatorProcess(
        c.lc.control_plane.env,
        NS,
        work / "high.log",
        resync_s=RESYNC_S,
        peering=["--peering", C.PEERING_NAME, "--priority", "20"],
        log_format="json",
    )
    try:
        low.start()  # alone for a moment, with no PolicyServer in the namespace: nothing to reconcile yet
        high.start()
        wait_for(
            lambda: "Pausing operations in favour of" in low.log.read_text(),
            60,
            what="the lower-priority replica to pause",
        )
        name = "peered"
        apply(c, runnable(c, name))
        wait_for(lambda: status_of(c, name).get("phase"), WAIT_S, what="a reconcile by the leader")
        high.settle()
        assert low.passes() == 0 and high.passes() > 0
        assert len([j for j in c.recorder.created("jobs", name) if j.startswith(f"{name}-fetch-")]) == 1
        assert len(c.recorder.created("persistentvolumeclaims", name)) == 1
        peers = c.lc.existing("kopf.dev/v1", "kopfpeerings", C.PEERING_NAME)["status"]
        assert sorted(p["priority"] for p in peers.values()) == [10, 20]
    finally:
        high.stop()
        low.stop()
        c.lc.operator.start()
    delete(c, "peered")
