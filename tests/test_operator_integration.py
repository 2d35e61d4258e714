"""The real operator (``policyserver operator`` in a subprocess) against the Kubernetes API emulator.

There is no kubelet or controller-manager: the tests play them, writing Job,
StatefulSet and Pod status the way those controllers would, and serve each
pod's ``/readyz`` from a tiny HTTP server on a loopback address (127.0.0.1,
127.0.0.2, ...) given to the pod as its podIP.  Everything else is real:
kubectl applies the samples, the operator talks HTTP to the emulator, and its
Events and status are read back through the API.
"""

from __future__ import annotations

import contextlib
import copy
import json
import signal
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from policy_operator import constants as C
from policy_operator.sources import checkpoint_key
from tests.support.kube_emulator import KubeEmulator
from tests.support.kube_fixtures import kube  # noqa: F401 - the fixture
from tests.support.net import free_port, wait_for
from tests.support.servers import stop_process

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
NS = "robots"
PS = (f"{C.API_VERSION}", C.PLURAL)
RESYNC_S = 0.5
WAIT_S = 30.0
POLICYSERVER = str(Path(sys.executable).parent / "policyserver")


# --- harness ---------------------------------------------------------------------------------

class Operator:
    """``policyserver operator`` as a subprocess against the emulator; restartable, killable."""

    def __init__(self, kube: KubeEmulator, log: Path, peering: list[str] | None = None) -> None:
        self.kube, self.log = kube, log
        self.peering = peering or ["--standalone"]
        self.proc: subprocess.Popen[bytes] | None = None
        self.liveness = ""

    def start(self) -> Operator:
        port = free_port()
        self.liveness = f"http://127.0.0.1:{port}/healthz"
        out = self.log.open("ab")
        self.proc = subprocess.Popen(
            [POLICYSERVER, "operator", "--namespace", NS, *self.peering, "--resync-seconds", str(RESYNC_S),
             "--probe-timeout", "0.5", "--liveness", self.liveness, "--log-format", "json"],
            env=self.kube.env, stdout=out, stderr=subprocess.STDOUT)
        out.close()
        wait_for(self.probe, WAIT_S, what=f"operator liveness (log: {self.log})")
        return self

    def probe(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.poll() is None, self.log.read_text()[-3000:]
        with urllib.request.urlopen(self.liveness, timeout=2) as response:
            return json.loads(response.read())

    def passes(self) -> int:
        return int(self.probe()["reconciler"]["passes"])

    def settle(self, passes: int = 4) -> None:
        """Let the resync timer run a few full passes (what "nothing more happens" is measured against)."""
        start = self.passes()
        wait_for(lambda: self.passes() >= start + passes, WAIT_S, what=f"{passes} reconcile passes")

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None:
            stop_process(self.proc, sig)
        self.proc = None


@pytest.fixture
def cluster(kube: KubeEmulator) -> KubeEmulator:  # noqa: F811 - pytest fixture injection
    kube.apply_crd(REPO / "crds" / "policyservers.yaml")
    kube.create_namespace(NS)
    return kube


@pytest.fixture
def operator(cluster: KubeEmulator, tmp_path: Path) -> Iterator[Operator]:
    op = Operator(cluster, tmp_path / "operator.log").start()
    try:
        yield op
    finally:
        op.stop()
    assert "Traceback" not in (tmp_path / "operator.log").read_text(), "the operator crashed; see its log"


class Readyz:
    """One pod's /readyz: ``ranks`` says which ranks are warm; 200 only when all are."""

    def __init__(self, host: str, port: int, world_size: int) -> None:
        self.ranks = [False] * world_size
        self.cfgp = 2 if world_size % 2 == 0 else 1
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server API
                if self.path != C.READYZ_PATH:
                    self.send_error(404)
                    return
                body = json.dumps(outer.body()).encode()
                self.send_response(200 if all(outer.ranks) else 503)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def body(self) -> dict[str, Any]:
        ranks = [{"rank": r, "dp_index": r // self.cfgp, "cfg_index": r % self.cfgp,
                  "state": "serving" if ok else "loading", "age_s": 0.1, "ready": ok}
                 for r, ok in enumerate(self.ranks)]
        world = len(self.ranks)
        return {"ready": all(self.ranks), "layout": {"cfgp": self.cfgp, "dp": world // self.cfgp, "world_size": world},
                "world_size": world, "ranks_ready": sum(self.ranks), "ranks": ranks}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@contextlib.contextmanager
def readyz_servers(count: int, world_size: int) -> Iterator[tuple[int, list[Readyz]]]:
    """``count`` servers on 127.0.0.1, 127.0.0.2, ... sharing one port (pods share the spec's port)."""
    for _ in range(20):
        port = free_port()
        servers: list[Readyz] = []
        try:
            for i in range(count):
                servers.append(Readyz(f"127.0.0.{i + 1}", port, world_size))
        except OSError:
            for s in servers:
                s.close()
            continue
        try:
            yield port, servers
        finally:
            for s in servers:
                s.close()
        return
    raise RuntimeError("no port free on every loopback address")


def ps_status(kube: KubeEmulator, name: str) -> dict[str, Any]:
    obj = kube.get(*PS, name, NS)
    return (obj or {}).get("status") or {}


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def wait_status(kube: KubeEmulator, name: str, predicate: Callable[[dict[str, Any]], Any], what: str) -> dict[str, Any]:
    last: dict[str, Any] = {}

    def check() -> Any:
        nonlocal last
        last = ps_status(kube, name)
        return predicate(last)

    try:
        wait_for(check, WAIT_S, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}; status: {json.dumps(last, indent=1)[:3000]}") from None
    return last


def apply(kube: KubeEmulator, obj: dict[str, Any]) -> None:
    kube.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(obj))


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / f"policyserver-{name}.yaml").read_text())


def names_of(kube: KubeEmulator, group_version: str, plural: str, selector: str | None = None) -> list[str]:
    return sorted(o["metadata"]["name"] for o in kube.list(group_version, plural, NS, label_selector=selector))


def posts(kube: KubeEmulator, plural: str) -> list[str]:
    """Paths of every successful-or-not POST the emulator saw for a plural in NS, in order."""
    return [str(r.url.path) for r in list(kube.api["post"]) if str(r.url.path).endswith(f"/namespaces/{NS}/{plural}")]


def finish_job(kube: KubeEmulator, name: str) -> None:
    kube.patch_status("batch/v1", "jobs", name, {
        "succeeded": 1, "active": 0, "conditions": [{"type": "Complete", "status": "True"}]}, NS)


def run_pods(kube: KubeEmulator, sts_name: str, ips: list[str]) -> list[str]:
    """Play the StatefulSet controller and the kubelet: pods from the current template, Running at ``ips``."""
    sts = kube.get("apps/v1", "statefulsets", sts_name, NS)
    assert sts is not None
    template = sts["spec"]["template"]
    names = []
    for i, ip in enumerate(ips):
        name = f"{sts_name}-{i}"
        pod = {"apiVersion": "v1", "kind": "Pod",
               "metadata": {"name": name, "labels": template["metadata"]["labels"],
                            "ownerReferences": [{"apiVersion": "apps/v1", "kind": "StatefulSet", "name": sts_name,
                                                 "uid": sts["metadata"]["uid"], "controller": True}]},
               "spec": copy.deepcopy(template["spec"])}
        if kube.get("v1", "pods", name, NS) is None:
            kube.create("v1", "pods", pod, NS)
        kube.patch_status("v1", "pods", name, {"phase": "Running", "podIP": ip}, NS)
        names.append(name)
    return names


def settle_statefulset(kube: KubeEmulator, sts_name: str) -> None:
    """The StatefulSet controller's status once a rollout is done."""
    sts = kube.get("apps/v1", "statefulsets", sts_name, NS)
    assert sts is not None
    n = sts["spec"]["replicas"]
    kube.patch_status("apps/v1", "statefulsets", sts_name, {
        "observedGeneration": sts["metadata"]["generation"], "replicas": n, "readyReplicas": n, "updatedReplicas": n,
        "currentRevision": f"{sts_name}-1", "updateRevision": f"{sts_name}-1"}, NS)


def events(kube: KubeEmulator, name: str) -> list[tuple[str, str, str]]:
    return [(e.get("type", ""), e.get("reason", ""), e.get("message", "")) for e in kube.events(NS, involved_name=name)]


def server_command(sts: dict[str, Any]) -> list[str]:
    return sts["spec"]["template"]["spec"]["containers"][0]["command"]


# --- tests -----------------------------------------------------------------------------------

def test_download_then_serve_with_per_rank_readiness(cluster: KubeEmulator, operator: Operator) -> None:
    kube = cluster
    obj = example("cfgp2-dp1")
    name = obj["metadata"]["name"]
    key = checkpoint_key(obj["spec"]["checkpoint"]["source"], obj["spec"]["checkpoint"]["revision"])
    job_name = f"{name}-fetch-{key}"
    with readyz_servers(2, world_size=2) as (port, servers):
        obj["spec"]["replicas"] = 2
        obj["spec"]["service"] = {"port": port}
        apply(kube, obj)

        # 1. cache and download first; no pods while the checkpoint is not there
        wait_for(lambda: kube.get("batch/v1", "jobs", job_name, NS), WAIT_S, what="fetch Job")
        pvc = kube.get("v1", "persistentvolumeclaims", f"{name}-cache", NS)
        assert pvc is not None and pvc["spec"]["accessModes"] == ["ReadWriteMany"]  # 2 replicas share it
        status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_PENDING, "phase Pending")
        assert condition(status, C.COND_VALID)["status"] == "True"
        assert condition(status, C.COND_CHECKPOINT_READY)["status"] == "False"
        operator.settle()
        assert names_of(kube, "apps/v1", "statefulsets") == []

        kube.patch_status("batch/v1", "jobs", job_name, {"active": 1}, NS)
        status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_DOWNLOADING, "phase Downloading")
        ck = condition(status, C.COND_CHECKPOINT_READY)
        assert (ck["status"], ck["reason"]) == ("False", "Downloading") and "attempt 1/4" in ck["message"]
        assert status["checkpoint"]["phase"] == "Downloading"

        # 2. checkpoint ready -> StatefulSet and Services, in that order after PVC and Job
        finish_job(kube, job_name)
        status = wait_status(kube, name, lambda s: s.get("endpoint"), "endpoint")
        assert status["endpoint"] == f"ws://{name}.{NS}.svc:{port}"
        assert status["checkpoint"] == {**status["checkpoint"], "phase": "Ready", "key": key,
                                        "path": f"{C.CACHE_MOUNT_PATH}/{key}"}
        order = [p.rsplit("/", 1)[1] for p in list(str(r.url.path) for r in kube.api["post"])
                 if f"/namespaces/{NS}/" in p and not p.endswith(("/events", f"/{C.PLURAL}"))]
        assert order == ["persistentvolumeclaims", "jobs", "statefulsets", "services", "services"]
        sts = kube.get("apps/v1", "statefulsets", name, NS)
        assert sts["spec"]["replicas"] == 2
        assert sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"][C.GPU_RESOURCE] == "2"
        assert f"{C.CACHE_MOUNT_PATH}/{key}" in server_command(sts)
        assert {s["metadata"]["name"] for s in kube.list("v1", "services", NS)} == {name, f"{name}-pods"}
        assert status["phase"] == C.PHASE_STARTING

        # 3. per-rank readiness from each pod's /readyz
        servers[0].ranks[:] = [True, True]
        servers[1].ranks[:] = [True, False]
        pods = run_pods(kube, name, ["127.0.0.1", "127.0.0.2"])
        status = wait_status(kube, name, lambda s: s.get("ranksReady") == "3/4", "3/4 ranks")
        assert status["ready"] == "1/2" and status["readyReplicas"] == 1
        by_pod = {p["name"]: p for p in status["pods"]}
        assert by_pod[pods[0]]["ranksReady"] == "2/2" and by_pod[pods[0]]["ready"] is True
        assert by_pod[pods[1]]["ranksReady"] == "1/2" and by_pod[pods[1]]["ready"] is False
        assert [r["ready"] for r in by_pod[pods[1]]["ranks"]] == [True, False]
        assert "rank 1 loading" in by_pod[pods[1]]["message"]
        assert status["phase"] == C.PHASE_STARTING
        assert condition(status, C.COND_AVAILABLE)["reason"] == "PartiallyReady"

        servers[1].ranks[:] = [True, True]
        status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_READY, "phase Ready")
        assert (status["ready"], status["ranksReady"], status["layout"]) == ("2/2", "4/4", "cfgp=2,dp=1")
        assert condition(status, C.COND_AVAILABLE)["status"] == "True"
        assert (condition(status, C.COND_PROGRESSING)["status"], condition(status, C.COND_PROGRESSING)["reason"]) \
            == ("False", "Stable")
        assert all(c["observedGeneration"] == 1 for c in status["conditions"])
        wait_for(lambda: all(kube.get("v1", "pods", p, NS)["metadata"].get("annotations", {})
                             .get(C.ANNOTATION_RANKS_READY) == "2/2" for p in pods), WAIT_S, what="pod annotations")
        table = kube.kubectl("get", C.SHORT_NAME, name, "-n", NS).stdout
        header, row = table.splitlines()[:2]
        assert header.split()[:6] == ["NAME", "READY", "RANKS", "LAYOUT", "CHECKPOINT", "PHASE"]
        assert row.split()[:7] == [name, "2/2", "4/4", "cfgp=2,dp=1", "Ready", "Ready", status["endpoint"]]

        # 4. a rank dies outside a rollout -> Degraded, with a Warning
        settle_statefulset(kube, name)
        servers[1].ranks[:] = [False, False]
        status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_DEGRADED, "phase Degraded")
        assert status["ranksReady"] == "2/4" and condition(status, C.COND_AVAILABLE)["status"] == "True"

    evs = events(kube, name)
    created = sorted(m for t, r, m in evs if r == "Created")
    assert len(created) == 5 and len(set(created)) == 5  # PVC, Job, StatefulSet, 2 Services, once each
    reasons = {(t, r) for t, r, _ in evs}
    assert {("Normal", "Downloading"), ("Normal", "Downloaded"), ("Normal", "Ready"), ("Warning", "Degraded")} <= reasons
    assert operator.probe()["reconciler"]["failures"] == 0


def test_invalid_spec_creates_nothing_and_does_not_retry(cluster: KubeEmulator, operator: Operator) -> None:
    kube = cluster
    obj = example("minimal")
    obj["spec"]["parallelism"] = {"cfgp": 2}
    obj["spec"]["runtime"] = {"guidance": 1.0}  # only the CEL rule refuses this; the emulator does not run CEL
    apply(kube, obj)
    name = obj["metadata"]["name"]
    status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_FAILED, "phase Failed")
    valid = condition(status, C.COND_VALID)
    assert (valid["status"], valid["reason"]) == ("False", "InvalidSpec") and "guidance" in valid["message"]
    operator.settle()
    for plural in ("persistentvolumeclaims", "jobs", "statefulsets", "services"):
        assert posts(kube, plural) == [], plural
    warnings = [m for t, r, m in events(kube, name) if (t, r) == ("Warning", "InvalidSpec")]
    assert len(warnings) == 1 and "cfgp=2 needs classifier-free guidance" in warnings[0]

    # the schema layer refuses what it can (dp=0) before the operator ever sees it
    bad = copy.deepcopy(obj)
    bad["spec"]["parallelism"] = {"dp": 0}
    assert kube.kubectl("apply", "-n", NS, "-f", "-", input=yaml.safe_dump(bad), check=False).returncode != 0

    kube.kubectl("patch", C.SHORT_NAME, name, "-n", NS, "--type=merge", "-p", '{"spec":{"runtime":{"guidance":2.0}}}')
    status = wait_status(kube, name, lambda s: condition(s, C.COND_VALID).get("status") == "True", "Valid=True")
    assert condition(status, C.COND_VALID)["observedGeneration"] == 2
    wait_for(lambda: names_of(kube, "batch/v1", "jobs"), WAIT_S, what="fetch Job after the fix")
    assert len(names_of(kube, "v1", "persistentvolumeclaims")) == 1


def test_fetch_failure_reports_the_fetch_error(cluster: KubeEmulator, operator: Operator) -> None:
    kube = cluster
    kube.kubectl("apply", "-n", NS, "-f", str(REPO / "examples" / "policyserver-minimal.yaml"))
    obj = example("minimal")
    name = obj["metadata"]["name"]
    job_name = f"{name}-fetch-{checkpoint_key(obj['spec']['checkpoint']['source'])}"
    job = wait_for(lambda: kube.get("batch/v1", "jobs", job_name, NS), WAIT_S, what="fetch Job")
    template = job["spec"]["template"]
    kube.create("v1", "pods", {"metadata": {"name": f"{job_name}-x1", "labels": template["metadata"]["labels"]},
                               "spec": template["spec"]}, NS)
    message = "fetching...\npolicyserver fetch: error: model.safetensors: sha256 0bad != 1good from the source\n"
    kube.patch_status("v1", "pods", f"{job_name}-x1", {"phase": "Failed", "containerStatuses": [{
        "name": "fetch", "ready": False, "restartCount": 0, "image": "i", "imageID": "",
        "state": {"terminated": {"exitCode": 4, "reason": "Error", "message": message}}}]}, NS)
    kube.patch_status("batch/v1", "jobs", job_name, {"failed": 1, "conditions": [
        {"type": "Failed", "status": "True", "reason": "PodFailurePolicy",
         "message": "Container fetch for pod robots/x1 failed with exit code 4 matching FailJob rule at index 0"}]}, NS)
    status = wait_status(kube, name, lambda s: s.get("phase") == C.PHASE_FAILED, "phase Failed")
    ck = condition(status, C.COND_CHECKPOINT_READY)
    assert (ck["status"], ck["reason"]) == ("False", "VerificationFailed")
    assert "model.safetensors: sha256 0bad != 1good" in ck["message"]
    assert status["checkpoint"]["phase"] == "Failed"
    assert ("Warning", "VerificationFailed") in {(t, r) for t, r, _ in events(kube, name)}
    operator.settle()
    assert names_of(kube, "apps/v1", "statefulsets") == [] and len(posts(kube, "jobs")) == 1


def test_checkpoint_change_downloads_once_then_rolls_and_scale_works(cluster: KubeEmulator, operator: Operator) -> None:
    kube = cluster
    kube.kubectl("apply", "-n", NS, "-f", str(REPO / "examples" / "policyserver-minimal.yaml"))
    obj = example("minimal")
    name, source = obj["metadata"]["name"], obj["spec"]["checkpoint"]["source"]
    key_a, key_b = checkpoint_key(source), checkpoint_key(source, "v2")
    finish_job(kube, wait_for(lambda: names_of(kube, "batch/v1", "jobs"), WAIT_S, what="Job A")[0])
    sts = wait_for(lambda: kube.get("apps/v1", "statefulsets", name, NS), WAIT_S, what="StatefulSet")
    hash_a = sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]
    assert sts["spec"]["template"]["metadata"]["labels"][C.LABEL_CHECKPOINT_KEY] == key_a

    kube.kubectl("patch", C.SHORT_NAME, name, "-n", NS, "--type=merge", "-p",
                 '{"spec":{"checkpoint":{"revision":"v2"}}}')
    job_b = f"{name}-fetch-{key_b}"
    wait_for(lambda: kube.get("batch/v1", "jobs", job_b, NS), WAIT_S, what="Job B")
    status = wait_status(kube, name, lambda s: s.get("checkpoint", {}).get("key") == key_b, "new key in status")
    operator.settle()
    assert len(posts(kube, "jobs")) == 2 and len(names_of(kube, "batch/v1", "jobs")) == 2
    sts = kube.get("apps/v1", "statefulsets", name, NS)
    assert sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH] == hash_a  # old pods keep serving A
    status = ps_status(kube, name)
    assert status["phase"] == C.PHASE_DOWNLOADING and status["checkpoint"]["servingKey"] == key_a

    finish_job(kube, job_b)
    sts = wait_for(lambda: (s := kube.get("apps/v1", "statefulsets", name, NS))["metadata"]["annotations"]
                   [C.ANNOTATION_TEMPLATE_HASH] != hash_a and s, WAIT_S, what="roll to checkpoint B")
    assert f"{C.CACHE_MOUNT_PATH}/{key_b}" in server_command(sts)
    assert any(r == "Updated" and f"checkpoint {key_a} -> {key_b}" in m for _, r, m in events(kube, name))
    hash_b = sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]

    # kubectl scale goes through the scale subresource -> spec.replicas -> StatefulSet replicas, no roll
    kube.kubectl("scale", f"{C.PLURAL}/{name}", "-n", NS, "--replicas=3")
    sts = wait_for(lambda: (s := kube.get("apps/v1", "statefulsets", name, NS))["spec"]["replicas"] == 3 and s,
                   WAIT_S, what="scaled StatefulSet")
    assert sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH] == hash_b
    assert ps_status(kube, name)["selector"] == sts_selector(sts)

    kube.kubectl("patch", C.SHORT_NAME, name, "-n", NS, "--type=merge", "-p", '{"spec":{"image":"policy:next"}}')
    sts = wait_for(lambda: (s := kube.get("apps/v1", "statefulsets", name, NS))["spec"]["template"]["spec"]
                   ["containers"][0]["image"] == "policy:next" and s, WAIT_S, what="image roll")
    assert sts["spec"]["replicas"] == 3 and sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH] != hash_b
    assert len(posts(kube, "jobs")) == 2 and len(posts(kube, "statefulsets")) == 1


def sts_selector(sts: dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in sts["spec"]["selector"]["matchLabels"].items())


def test_delete_cascades_and_retain_on_delete_keeps_the_cache(cluster: KubeEmulator, operator: Operator) -> None:
    kube = cluster
    for name, retain in (("drop", False), ("keep", True)):
        obj = example("minimal")
        obj["metadata"]["name"] = name
        obj["spec"]["storage"] = {"retainOnDelete": retain}
        apply(kube, obj)
        finish_job(kube, wait_for(lambda n=name: names_of(kube, "batch/v1", "jobs", f"{C.LABEL_INSTANCE}={n}"),
                                  WAIT_S, what=f"Job of {name}")[0])
        wait_for(lambda n=name: kube.get("v1", "services", n, NS), WAIT_S, what=f"Service of {name}")
    keep_pvc = kube.get("v1", "persistentvolumeclaims", "keep-cache", NS)
    assert not keep_pvc["metadata"].get("ownerReferences")
    assert kube.get("v1", "persistentvolumeclaims", "drop-cache", NS)["metadata"]["ownerReferences"][0]["name"] == "drop"

    def children(name: str) -> list[str]:
        selector = f"{C.LABEL_INSTANCE}={name}"
        return [f"{plural}/{n}" for gv, plural in (("v1", "persistentvolumeclaims"), ("batch/v1", "jobs"),
                                                     ("apps/v1", "statefulsets"), ("v1", "services"))
                for n in names_of(kube, gv, plural, selector)]

    kube.kubectl("delete", C.SHORT_NAME, "drop", "-n", NS, "--wait=false")
    wait_for(lambda: kube.get(*PS, "drop", NS) is None and not children("drop"), WAIT_S, what="cascade of drop")
    kube.kubectl("delete", C.SHORT_NAME, "keep", "-n", NS, "--wait=false")
    wait_for(lambda: kube.get(*PS, "keep", NS) is None and children("keep") == ["persistentvolumeclaims/keep-cache"],
             WAIT_S, what="cascade of keep, cache retained")

    obj = example("minimal")
    obj["metadata"]["name"] = "keep"
    obj["spec"]["storage"] = {"retainOnDelete": False}  # a new owner adopts the retained cache
    apply(kube, obj)
    wait_for(lambda: (kube.get("v1", "persistentvolumeclaims", "keep-cache", NS)["metadata"].get("ownerReferences")
                      or [{}])[0].get("uid") == kube.get(*PS, "keep", NS)["metadata"]["uid"], WAIT_S,
             what="retained PVC adopted")
    assert kube.get("v1", "persistentvolumeclaims", "keep-cache", NS)["metadata"]["uid"] == keep_pvc["metadata"]["uid"]
    assert len(posts(kube, "persistentvolumeclaims")) == 2  # drop-cache and keep-cache, never a second keep-cache


def test_restart_mid_reconcile_and_api_errors_converge_without_duplicates(cluster: KubeEmulator,
                                                                          tmp_path: Path) -> None:
    kube = cluster
    op = Operator(kube, tmp_path / "operator.log").start()
    try:
        kube.kubectl("apply", "-n", NS, "-f", str(REPO / "examples" / "policyserver-cfgp1-dp2.yaml"))
        name = "policy-cfgp1-dp2"
        wait_for(lambda: posts(kube, "jobs"), WAIT_S, interval=0.01, what="Job POST")
        op.stop(signal.SIGKILL)  # right after the Job was created: the status write of that pass never happened

        finish_job(kube, names_of(kube, "batch/v1", "jobs")[0])
        kube.api[f"post /apis/apps/v1/namespaces/{NS}/statefulsets"][:3] << 503  # the API server hiccups
        op.start()
        wait_for(lambda: kube.get("v1", "services", name, NS), WAIT_S, what="Service after restart")
        assert len(posts(kube, "statefulsets")) >= 2  # the 503s were retried
        op.stop(signal.SIGKILL)
        op.start()
        op.settle()
        status = ps_status(kube, name)
        assert status["phase"] == C.PHASE_STARTING and status["checkpoint"]["phase"] == "Ready"
        assert len(posts(kube, "jobs")) == 1 and len(posts(kube, "persistentvolumeclaims")) == 1
        for gv, plural, count in (("v1", "persistentvolumeclaims", 1), ("batch/v1", "jobs", 1),
                                  ("apps/v1", "statefulsets", 1), ("v1", "services", 2)):
            assert len(names_of(kube, gv, plural)) == count, plural
        created = [m for _, r, m in events(kube, name) if r == "Created"]
        assert len(created) == len(set(created))  # nothing created twice (Events of the killed pass may be lost)
        assert {m.split(" (")[0] for m in created} >= {f"created StatefulSet {name}", f"created Service {name}",
                                                      f"created Service {name}-pods"}
    finally:
        op.stop()


KOPF_PEERING_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "kopfpeerings.kopf.dev"},
    "spec": {"group": "kopf.dev", "scope": "Namespaced",
             "names": {"kind": "KopfPeering", "plural": "kopfpeerings", "singular": "kopfpeering"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "properties": {"status": {"type": "object",
                                                             "x-kubernetes-preserve-unknown-fields": True}}}}}]},
}


def test_two_replicas_elect_one_leader_through_kopf_peering(cluster: KubeEmulator, tmp_path: Path) -> None:
    kube = cluster
    crd_file = tmp_path / "kopfpeering.yaml"
    crd_file.write_text(yaml.safe_dump(KOPF_PEERING_CRD))
    kube.apply_crd(crd_file)
    kube.create("kopf.dev/v1", "kopfpeerings", {"metadata": {"name": C.PEERING_NAME}}, NS)
    low = Operator(kube, tmp_path / "low.log", ["--peering", C.PEERING_NAME, "--priority", "10"]).start()
    high = Operator(kube, tmp_path / "high.log", ["--peering", C.PEERING_NAME, "--priority", "20"]).start()
    try:
        wait_for(lambda: "Pausing operations in favour of" in (tmp_path / "low.log").read_text(), WAIT_S,
                 what="the lower-priority replica to pause")
        kube.kubectl("apply", "-n", NS, "-f", str(REPO / "examples" / "policyserver-minimal.yaml"))
        wait_for(lambda: ps_status(kube, "policy-minimal").get("phase"), WAIT_S, what="a reconcile by the leader")
        high.settle()
        assert low.passes() == 0 and high.passes() > 0
        assert len(posts(kube, "jobs")) == 1 and len(posts(kube, "persistentvolumeclaims")) == 1
        peers = kube.get("kopf.dev/v1", "kopfpeerings", C.PEERING_NAME, NS)["status"]
        assert sorted(p["priority"] for p in peers.values()) == [10, 20]
    finally:
        high.stop()
        low.stop()
