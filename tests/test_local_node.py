"""The local node (tests/support/local_node.py) on its own: real processes for pods, Jobs and StatefulSets.

Each test starts the API emulator and a node, writes objects through the API
and reads back what a kubelet and the controllers would have written; the
containers are small Python programs whose behaviour the test controls.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import sys
import textwrap
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from policy_operator import constants as C
from tests.support.kube_emulator import KubeEmulator
from tests.support.kube_fixtures import kube  # noqa: F401 - the fixture
from tests.support.local_node import LocalNode
from tests.support.local_node_controllers import plan_statefulset, revision
from tests.support.local_node_proc import PathMap, expand, tagged_processes
from tests.support.net import free_port, wait_for

pytestmark = pytest.mark.slow

NS = "node-test"
LABELS = {"test": "local-node"}
WAIT_S = 30.0
PY = Path(sys.executable).name  # found on the node's PATH (the venv's bin), as an image's python would be


@pytest.fixture
def node(kube: KubeEmulator) -> Iterator[LocalNode]:  # noqa: F811 - pytest fixture injection
    kube.create_namespace(NS)
    n = LocalNode(kube, [NS], label_selector="test=local-node", backoff_s=0.2, backoff_cap_s=1.0, resync_s=0.5)
    n.start()
    try:
        yield n
    finally:
        n.stop()
    assert not n.processes(), "processes outlived the node"
    n.raise_errors()


def pod_body(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name, "labels": dict(LABELS)},
            "spec": {"containers": containers, **spec}}


def python(name: str, script: str, *args: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "python:3.11", "command": [PY, "-c", textwrap.dedent(script), *args], **extra}


def get_pod(kube: KubeEmulator, name: str) -> dict[str, Any]:
    return kube.get("v1", "pods", name, NS) or {}


def condition(obj: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def wait_pod(kube: KubeEmulator, node: LocalNode, name: str, predicate, what: str) -> dict[str, Any]:
    try:
        return wait_for(lambda: (p := get_pod(kube, name)) and predicate(p) and p, WAIT_S, what=what)
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\nstatus: {json.dumps(get_pod(kube, name).get('status'), indent=1)[:3000]}\n"
                             f"{node.describe(NS)}") from None


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


# --- pure parts ------------------------------------------------------------------------------

def test_path_map_rewrites_mount_prefixes_only() -> None:
    paths = PathMap.of({"/models": "/h/pvc", "/tmp": "/h/tmp", "/models/cache": "/h/cache"})
    assert paths.host("/models") == "/h/pvc"
    assert paths.host("/models/abc/config.json") == "/h/pvc/abc/config.json"
    assert paths.host("/models/cache/x") == "/h/cache/x"  # the longer (nested) mount wins
    assert paths.host("--checkpoint=/models/abc") == "--checkpoint=/h/pvc/abc"
    assert paths.host("HOME=/tmp") == "HOME=/h/tmp"
    assert paths.host("/modelsX") == "/modelsX" and paths.host("models/x") == "models/x"
    assert paths.host("http://h/models/x") == "http://h/models/x" and paths.host("--url=http://h/tmp") == "--url=http://h/tmp"
    assert paths.container("/h/pvc/abc") == "/models/abc"
    assert expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"


def test_statefulset_plan_rolls_highest_ordinal_once_the_others_are_ready() -> None:
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet",
           "metadata": {"name": "s", "uid": "u1", "generation": 2},
           "spec": {"replicas": 3, "podManagementPolicy": "Parallel", "template": {"metadata": {}, "spec": {"c": 1}}}}
    rev = revision(sts)

    def pod(i: int, r: str, ready: bool = True) -> dict[str, Any]:
        return {"metadata": {"name": f"s-{i}", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: r},
                             "ownerReferences": [{"uid": "u1", "controller": True}]},
                "status": {"phase": "Running", "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}

    plan = plan_statefulset(sts, [pod(0, "old"), pod(1, "old"), pod(2, "old")])
    assert plan.delete == ["s-2"] and not plan.create
    assert plan.status["updatedReplicas"] == 0 and plan.status["updateRevision"] == rev
    assert plan_statefulset(sts, [pod(0, "old", ready=False), pod(1, "old"), pod(2, "old")]).delete == []
    plan = plan_statefulset(sts, [pod(0, "old"), pod(1, "old")])  # s-2 was deleted: recreate it first
    assert [p["metadata"]["name"] for p in plan.create] == ["s-2"] and plan.delete == []
    done = plan_statefulset({**sts, "status": {"currentRevision": "old"}}, [pod(0, rev), pod(1, rev), pod(2, rev)])
    assert done.status["currentRevision"] == rev == done.status["updateRevision"] and done.status["readyReplicas"] == 3


# --- pods ------------------------------------------------------------------------------------

SERVER = """
    import json, os, sys, http.server
    out, token_file = sys.argv[1], sys.argv[2]
    facts = {"ip": os.environ["POD_IP"], "name": os.environ["POD_NAME"], "secret_env": os.environ["SECRET"],
             "secret_file": open(token_file).read(), "home": os.environ["HOME"], "cwd": os.getcwd(),
             "init": open(os.path.join(os.path.dirname(out), "init.txt")).read()}
    with open(out, "w") as f:
        json.dump(facts, f)

    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            body = open(out, "rb").read()
            self.send_response(200 if self.path in ("/", "/ready") else 404)
            self.end_headers()
            self.wfile.write(body)
        def log_message(self, *a):
            pass

    http.server.HTTPServer((os.environ["POD_IP"], int(os.environ["PORT"])), H).serve_forever()
"""


def server_pod(name: str, port: int) -> dict[str, Any]:
    env = [{"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
           {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
           {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
           {"name": "PORT", "value": str(port)}, {"name": "HOME", "value": "/data/home"}]
    mounts = [{"name": "data", "mountPath": "/data"}, {"name": "creds", "mountPath": "/var/run/creds", "readOnly": True}]
    server = python("server", SERVER, "/data/facts.json", "/var/run/creds/token", env=env, volumeMounts=mounts,
                    workingDir="/data", ports=[{"name": "http", "containerPort": port}],
                    readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
                    livenessProbe={"tcpSocket": {"port": port}, "periodSeconds": 1})
    init = python("init", "import sys; open(sys.argv[1], 'w').write('init ran')", "/data/init.txt",
                  volumeMounts=mounts[:1])
    return pod_body(name, [server], initContainers=[init],
                    volumes=[{"name": "data", "emptyDir": {}},
                             {"name": "creds", "secret": {"secretName": "creds", "items": [{"key": "token", "path": "token"}]}}])


def test_pod_with_an_http_server_gets_ready_through_its_probe(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    port = free_port()
    kube.create("v1", "secrets", {"metadata": {"name": "creds"},
                                  "data": {"token": base64.b64encode(b"s3cret").decode()}}, NS)
    for name in ("web-a", "web-b"):  # the same port on two pods: each has its own IP
        kube.create("v1", "pods", server_pod(name, port), NS)
    pods = {name: wait_pod(kube, node, name, lambda p: condition(p, "Ready") == "True", f"{name} Ready")
            for name in ("web-a", "web-b")}
    ips = {p["status"]["podIP"] for p in pods.values()}
    assert len(ips) == 2 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
    for name, p in pods.items():
        status = p["status"]
        assert p["spec"]["nodeName"] == node.name and status["phase"] == "Running"
        assert {condition(p, k) for k in ("Initialized", "ContainersReady", "PodScheduled")} == {"True"}
        assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
        cs = status["containerStatuses"][0]
        assert (cs["ready"], cs["started"], cs["restartCount"]) == (True, True, 0) and "running" in cs["state"]
        with urllib.request.urlopen(f"http://{status['podIP']}:{port}/", timeout=5) as r:
            facts = json.loads(r.read())
        runner = node.pod(NS, name)
        data = runner.volumes["data"]
        assert facts == {"ip": status["podIP"], "name": name, "secret_env": "s3cret", "secret_file": "s3cret",
                         "home": f"{data}/home", "cwd": str(data), "init": "init ran"}
        procs = node.processes(NS, name, "server")
        assert len(procs) == 1 and procs[0].argv[-2:] == (f"{data}/facts.json", f"{runner.volumes['creds']}/token")


def test_missing_secret_is_a_config_error_until_it_exists(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]
    kube.create("v1", "pods", pod_body("waits", [python("main", "import time; time.sleep(60)", env=env)]), NS)
    p = wait_pod(kube, node, "waits", lambda p: (p["status"].get("containerStatuses") or [{}])[0]
                 .get("state", {}).get("waiting", {}).get("reason") == "CreateContainerConfigError", "config error")
    assert p["status"]["containerStatuses"][0]["state"]["waiting"]["message"] == 'secret "later" not found'
    kube.create("v1", "secrets", {"metadata": {"name": "later"}, "stringData": {"token": "x"}}, NS)
    wait_pod(kube, node, "waits", lambda p: condition(p, "Ready") == "True", "Ready once the Secret exists")


def test_crashed_container_is_restarted_and_liveness_failure_kills_it(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    liveness = {"exec": {"command": [PY, "-c", "import os, sys; sys.exit(os.path.exists(os.environ['FLAG']))"]},
                "periodSeconds": 1, "failureThreshold": 1}
    main = python("main", "import time; print('up', flush=True); time.sleep(600)", livenessProbe=liveness,
                  env=[{"name": "FLAG", "value": "/scratch/unhealthy"}],
                  volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}])
    kube.create("v1", "pods", pod_body("crashy", [main], volumes=[{"name": "scratch", "emptyDir": {}}],
                                       terminationGracePeriodSeconds=1), NS)
    wait_pod(kube, node, "crashy", lambda p: condition(p, "Ready") == "True", "Ready")
    first = node.processes(NS, "crashy", "main")
    assert len(first) == 1
    os.kill(first[0].pid, signal.SIGKILL)
    p = wait_pod(kube, node, "crashy", lambda p: p["status"]["containerStatuses"][0]["restartCount"] == 1
                 and p["status"]["containerStatuses"][0]["ready"], "restarted once")
    last = p["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"], last["signal"]) == (137, "Error", 9)
    assert "up" in node.logs(NS, "crashy", "main", run=-2) and "up" in node.logs(NS, "crashy", "main")

    (node.pod(NS, "crashy").volumes["scratch"] / "unhealthy").write_text("")  # the exec probe now fails
    p = wait_pod(kube, node, "crashy", lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 2,
                 "restart by the liveness probe")
    assert "Liveness probe failed" in p["status"]["containerStatuses"][0]["lastState"]["terminated"]["message"]


KEEPER = """
    import os, signal, subprocess, sys, time
    out = sys.argv[1]
    def note(text):
        with open(out, "a") as f:
            f.write(text + "\\n")
    signal.signal(signal.SIGTERM, lambda *a: note("SIGTERM"))   # and keep running: SIGKILL must follow
    child = subprocess.Popen([sys.executable, "-c",
        "import subprocess, sys, time; g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']);"
        "print(g.pid, flush=True); time.sleep(600)"], stdout=subprocess.PIPE, start_new_session=True, text=True)
    grandchild = int(child.stdout.readline())
    note(f"pids {os.getpid()} {child.pid} {grandchild}")
    while True:
        time.sleep(1)
"""


def test_delete_runs_prestop_then_sigterm_then_kills_the_whole_tree(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    pre_stop = {"exec": {"command": [PY, "-c", "import sys; open(sys.argv[1], 'a').write('preStop\\n')", "/out/log"]}}
    main = python("main", KEEPER, "/out/log", volumeMounts=[{"name": "out", "mountPath": "/out"}],
                  lifecycle={"preStop": pre_stop})
    (node.root / "out").mkdir()
    kube.create("v1", "pods", pod_body("tree", [main], terminationGracePeriodSeconds=2,
                                       volumes=[{"name": "out", "hostPath": {"path": str(node.root / "out")}}]), NS)
    log = node.root / "out" / "log"
    wait_for(lambda: log.exists() and "pids" in log.read_text(), WAIT_S, what="the process tree")
    pids = [int(x) for x in log.read_text().split("pids", 1)[1].split()]
    assert all(alive(p) for p in pids) and len(node.processes(NS, "tree")) == 3
    assert len({os.getsid(p) for p in pids}) == 2  # the child left the container's session, as torchrun ranks do

    kube.delete("v1", "pods", "tree", NS)
    wait_for(lambda: kube.get("v1", "pods", "tree", NS) is None, WAIT_S, what="the pod gone from the API")
    assert not any(alive(p) for p in pids) and node.processes(NS, "tree") == []
    assert log.read_text().splitlines()[1:] == ["preStop", "SIGTERM"]
    assert not tagged_processes(node.node_id)


# --- Jobs ---------------------------------------------------------------------------------------

def job_body(name: str, script: str, backoff_limit: int = 0, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": name, "labels": dict(LABELS)},
            "spec": {"backoffLimit": backoff_limit, **spec,
                     "template": {"metadata": {"labels": dict(LABELS)},
                                  "spec": {"restartPolicy": "Never", "containers": [
                                      python("work", script, terminationMessagePolicy="FallbackToLogsOnError")]}}}}


def job_pods(kube: KubeEmulator, name: str) -> list[dict[str, Any]]:
    return kube.list("v1", "pods", NS, label_selector=f"{C.LABEL_JOB_NAME}={name}")


def wait_job(kube: KubeEmulator, node: LocalNode, name: str, kind: str) -> dict[str, Any]:
    try:
        return wait_for(lambda: (j := kube.get("batch/v1", "jobs", name, NS)) and condition(j, kind) == "True" and j,
                        WAIT_S, what=f"Job {name} {kind}")
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{kube.get('batch/v1', 'jobs', name, NS)}\n{node.describe(NS)}") from None


def test_job_pod_exit_0_completes_the_job(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    kube.create("batch/v1", "jobs", job_body("ok", "print('done')"), NS)
    job = wait_job(kube, node, "ok", "Complete")
    assert (job["status"]["succeeded"], job["status"]["active"], job["status"]["failed"]) == (1, 0, 0)
    assert condition(job, "SuccessCriteriaMet") == "True" and job["status"]["completionTime"]
    (pod,) = job_pods(kube, "ok")
    assert pod["status"]["phase"] == "Succeeded" and pod["metadata"]["name"].startswith("ok-")
    assert pod["metadata"]["labels"][C.LABEL_JOB_CONTROLLER_UID] == job["metadata"]["uid"]
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"


def test_job_failures_use_backoff_limit_and_pod_failure_policy(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    kube.create("batch/v1", "jobs", job_body("flaky", "print('error: boom'); raise SystemExit(3)", backoff_limit=1), NS)
    fatal = job_body("fatal", "print('error: bad hash'); raise SystemExit(4)", backoff_limit=5, podFailurePolicy={
        "rules": [{"action": "FailJob", "onExitCodes": {"containerName": "work", "operator": "In", "values": [2, 4]}}]})
    kube.create("batch/v1", "jobs", fatal, NS)

    job = wait_job(kube, node, "flaky", "Failed")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and job["status"]["failed"] == 2
    pods = job_pods(kube, "flaky")
    assert len(pods) == 2 and {p["status"]["phase"] for p in pods} == {"Failed"}
    term = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["message"].strip() == "error: boom"

    job = wait_job(kube, node, "fatal", "Failed")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "PodFailurePolicy" and "exit code 4 matching FailJob rule at index 0" in failed["message"]
    assert len(job_pods(kube, "fatal")) == 1  # no retry of a fatal exit code


# --- StatefulSets ---------------------------------------------------------------------------------

def test_statefulset_pods_scale_and_roll(kube: KubeEmulator, node: LocalNode) -> None:  # noqa: F811
    port = free_port()
    serve = python("web", "import http.server, os, sys; http.server.HTTPServer((os.environ['IP'], int(sys.argv[1])), "
                          "http.server.SimpleHTTPRequestHandler).serve_forever()", str(port),
                   env=[{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                        {"name": "VERSION", "value": "1"}],
                   readinessProbe={"httpGet": {"path": "/", "port": port}, "periodSeconds": 1})
    sts = {"apiVersion": "apps/v1", "kind": "StatefulSet", "metadata": {"name": "web", "labels": dict(LABELS)},
           "spec": {"replicas": 2, "serviceName": "web", "podManagementPolicy": "Parallel",
                    "selector": {"matchLabels": LABELS},
                    "template": {"metadata": {"labels": dict(LABELS)},
                                 "spec": {"containers": [serve], "terminationGracePeriodSeconds": 2}}}}
    kube.create("apps/v1", "statefulsets", sts, NS)

    def sts_status(pred, what: str) -> dict[str, Any]:
        try:
            return wait_for(lambda: (s := kube.get("apps/v1", "statefulsets", "web", NS)) and pred(s.get("status") or {})
                            and s, WAIT_S, what=what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}\n{kube.get('apps/v1', 'statefulsets', 'web', NS)}\n{node.describe(NS)}") from None

    s = sts_status(lambda st: st.get("readyReplicas") == 2, "2 ready replicas")
    assert s["status"]["currentRevision"] == s["status"]["updateRevision"] and s["status"]["observedGeneration"] == 1
    pods = {n: get_pod(kube, n) for n in ("web-0", "web-1")}
    assert len({p["status"]["podIP"] for p in pods.values()}) == 2
    assert pods["web-1"]["spec"]["hostname"] == "web-1"
    old_pids = [p.pid for p in node.processes(NS, "web-1")]

    kube.patch("apps/v1", "statefulsets", "web", {"spec": {"replicas": 1}}, NS)
    sts_status(lambda st: st.get("replicas") == 1, "scaled to 1")
    wait_for(lambda: kube.get("v1", "pods", "web-1", NS) is None, WAIT_S, what="web-1 deleted")
    assert old_pids and not any(alive(p) for p in old_pids)

    template = s["spec"]["template"]
    template["spec"]["containers"][0]["env"][1]["value"] = "2"
    kube.patch("apps/v1", "statefulsets", "web", {"spec": {"template": template}}, NS)
    s = sts_status(lambda st: st.get("observedGeneration") == 3 and st.get("updatedReplicas") == 1
                   and st.get("readyReplicas") == 1 and st.get("currentRevision") == st.get("updateRevision"), "rolled")
    pod = get_pod(kube, "web-0")
    assert pod["metadata"]["labels"][C.LABEL_CONTROLLER_REVISION_HASH] == s["status"]["updateRevision"]
    assert pod["metadata"]["uid"] != pods["web-0"]["metadata"]["uid"]
    assert node.processes(NS, "web-0")[0].env["VERSION"] == "2"
