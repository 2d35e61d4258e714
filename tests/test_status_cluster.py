"""Status that never lies, on the real control plane: the real StatefulSet/Job controllers, ResourceQuota
admission and the local node's kubelet decide; the operator's status must say what they did.

One operator and one local node for the module (short resync, tiny checkpoint, 2 CPU steps).  What is
pinned down: a rollout watched throughout never reads Ready while a pod of the old template serves; a
template that crashes (``--dtype bogus``) reaches ProgressDeadlineExceeded with the rank's own error;
a ResourceQuota on ``requests.nvidia.com/gpu`` shows up as FailedCreate instead of an endless Starting.
The decisions themselves are unit-tested in tests/test_status_decisions.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from policy_operator import constants as C
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.kubelet_logs import ContainerLogServer
from tests.support.local_node_cluster import LocalCluster, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
NS = "status-it"
WAIT_S = 150.0


class Env:
    def __init__(self, lc: LocalCluster, source: CheckpointServer, port: int) -> None:
        self.lc, self.source, self.port = lc, source, port

    def doc(self, name: str, **spec: Any) -> dict[str, Any]:
        sample = yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text())
        doc = for_local_node(sample, source=self.source.url_for("ckpt/"), port=self.port)
        doc["metadata"]["name"] = name
        doc["spec"].update(spec)
        return doc

    def apply(self, doc: dict[str, Any]) -> None:
        self.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))

    def wait(self, name: str, predicate: Callable[[dict[str, Any]], Any], what: str,
             timeout: float = WAIT_S) -> dict[str, Any]:
        return self.lc.wait_status(name, predicate, what, timeout)

    def delete(self, name: str) -> None:
        self.lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    import subprocess

    work = tmp_path_factory.mktemp("status-it")
    subprocess.run([str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
                   check=True, capture_output=True, timeout=120)
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=0.5, gpus=2)
    lc.operator.probe_timeout_s = 0.5
    logs = ContainerLogServer(lc.node)  # pods/log: where a crashed rank's error is when its message lost it
    try:
        lc.start()
        logs.start()
        yield Env(lc, source, free_port_on(["127.0.0.1", *lc.node.ips(16)]))
    finally:
        logs.stop()
        lc.stop()
        source.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def test_a_rollout_watched_throughout_never_reads_ready_while_an_old_pod_serves(env: Env) -> None:
    name = "rolling"
    env.apply(env.doc(name))
    first = env.wait(name, lambda s: s.get("phase") == C.PHASE_READY, "first Ready")
    assert cond(first, C.COND_READY)["status"] == "True" and cond(first, C.COND_READY)["reason"] == "ReplicasReady"
    old_revision = first["pods"][0]["revision"]

    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch() -> None:  # every status the API serves during the rollout, with the pods as they are then
        while not stop.is_set():
            status = env.lc.status(name)
            pods = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
            seen.append({"status": status,
                         "revisions": {(p["metadata"].get("labels") or {}).get(C.LABEL_CONTROLLER_REVISION_HASH)
                                       for p in pods}})
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        env.lc.kubectl("patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps({"spec": {"runtime": {"steps": 3}}}))
        done = env.wait(name, lambda s: s.get("observedGeneration") == 2 and s.get("phase") == C.PHASE_READY
                        and all(p.get("revision") != old_revision for p in s.get("pods") or []), "rolled and Ready")

        def claims_ready_now() -> list[dict[str, Any]]:
            return [s for s in list(seen) if s["status"].get("observedGeneration") == 2
                    and (s["status"].get("phase") == C.PHASE_READY
                         or cond(s["status"], C.COND_READY).get("status") == "True")]

        # the watcher samples on its own clock: it must see the end the wait saw before it is stopped
        wait_for(claims_ready_now, 30, what="the watcher to see the end of the rollout")
    finally:
        stop.set()
        watcher.join(10)
    assert done["updatedReadyReplicas"] == 1 and cond(done, C.COND_PROGRESSING)["reason"] == "Stable"
    claims_ready = claims_ready_now()
    assert claims_ready, "the watcher never saw the end of the rollout"
    for s in claims_ready:
        assert old_revision not in {p.get("revision") for p in s["status"].get("pods") or []}, s["status"]
    rolling = [s["status"] for s in seen if s["status"].get("observedGeneration") == 2
               and cond(s["status"], C.COND_PROGRESSING).get("reason") == "RollingOut"]
    assert rolling, "the rollout was never reported as RollingOut"
    assert all(cond(s, C.COND_READY)["status"] == "False" for s in rolling)
    env.delete(name)


def test_a_crashing_template_reaches_the_progress_deadline_with_the_ranks_error(env: Env) -> None:
    name = "crashy"
    doc = env.doc(name, progressDeadlineSeconds=15)
    doc["spec"]["runtime"]["extraArgs"] = ["--dtype", "bogus"]
    env.apply(doc)
    # the deadline may pass while the pod still imports torch; once the rank has died its error is the detail
    status = env.wait(name, lambda s: s.get("phase") == C.PHASE_FAILED
                      and "bogus" in cond(s, C.COND_PROGRESSING).get("message", ""),
                      "phase Failed after the deadline, with the rank's error", timeout=150)
    progressing = cond(status, C.COND_PROGRESSING)
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded"), progressing
    assert "bogus" in progressing["message"] and "server exited" in progressing["message"], progressing["message"]
    assert cond(status, C.COND_READY)["reason"] == "ProgressDeadlineExceeded"
    assert status["checkpoint"]["phase"] == "Ready"  # the download was fine; the pods are not
    env.lc.api.wait_event(NS, name, "Warning", "ProgressDeadlineExceeded")
    env.delete(name)


def test_a_gpu_quota_refusal_is_in_status_as_failed_create(env: Env) -> None:
    quota = {"apiVersion": "v1", "kind": "ResourceQuota", "metadata": {"name": "no-gpus", "namespace": NS},
             "spec": {"hard": {f"requests.{C.GPU_RESOURCE}": "0"}}}
    env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(quota))
    wait_for(lambda: ((env.lc.get("v1", "resourcequotas", "no-gpus") or {}).get("status") or {}).get("hard"), 60,
             what="the quota controller's status of the ResourceQuota")
    name = "quota"
    doc = env.doc(name)
    doc["spec"]["runtime"]["device"] = "cuda"  # one nvidia.com/gpu per pod: more than the quota's 0
    try:
        env.apply(doc)
        status = env.wait(name, lambda s: cond(s, C.COND_AVAILABLE).get("reason") == "FailedCreate",
                          "Available=False FailedCreate")
        available = cond(status, C.COND_AVAILABLE)
        assert available["status"] == "False" and "exceeded quota" in available["message"], available
        assert C.GPU_RESOURCE in available["message"]
        assert status["phase"] == C.PHASE_PENDING and cond(status, C.COND_READY)["reason"] == "FailedCreate"
        assert env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}") == []
        env.lc.api.wait_event(NS, name, "Warning", "FailedCreate")

        env.lc.kubectl("delete", "resourcequota", "no-gpus")  # lifted: the pod is created, the refusal leaves status
        status = env.wait(name, lambda s: cond(s, C.COND_AVAILABLE).get("reason") not in ("FailedCreate", None)
                          and env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},"
                                                        f"{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}"),
                          "the refusal gone once the pod exists")
        assert "exceeded quota" not in json.dumps(status["conditions"])
    finally:
        env.lc.kubectl("delete", "resourcequota", "no-gpus", "--ignore-not-found")
    env.delete(name)
