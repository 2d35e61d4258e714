"""The local node (tests/support/local_node.py) on the real control plane: the kubelet, the proxy, the provisioner.

One node for the module on the session's control plane; each test writes
objects through the real API and reads back what the kubelet stand-in and
the real controllers (scheduler, Job, StatefulSet, PV, PVC protection) made
of them.  The containers are small Python programs whose behaviour the test
controls.
"""

from __future__ import annotations

import base64
import json
import os
import signal
import socket
import sys
import textwrap
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from policy_operator import constants as C
from tests.support.local_node import LocalNode
from tests.support.local_node_api import Api
from tests.support.local_node_cluster import delete_namespace
from tests.support.local_node_proc import PathMap, expand, tagged_processes
from tests.support.local_node_storage import ANN_PROVISIONED_BY, STORAGE_CLASS, STORAGE_PROVISIONER
from tests.support.net import wait_for

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

NS = "node-test"
WAIT_S = 60.0
GPUS = 4
PY = Path(sys.executable).name  # found on the node's PATH (the venv's bin), as an image's python would be


@pytest.fixture(scope="module")
def api(control_plane: ControlPlane) -> Iterator[Api]:
    control_plane.create_namespace(NS)
    client = Api(control_plane.kubeconfig)
    yield client
    client.close()


@pytest.fixture(scope="module")
def node(control_plane: ControlPlane, api: Api) -> Iterator[LocalNode]:
    n = LocalNode(
        control_plane.kubeconfig,
        namespaces=[NS],
        name="node-local-node-test",
        gpus=GPUS,
        backoff_s=0.2,
        backoff_cap_s=1.0,
        resync_s=0.5,
    )
    n.start()
    try:
        yield n
        delete_namespace(api, NS)  # the node still runs: every pod ends gracefully, volumes are released
    finally:
        n.stop()
    assert not n.processes(), "processes outlived the node"
    n.raise_errors()


def pod_body(name: str, containers: list[dict[str, Any]], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"test": name}},
        "spec": {"containers": containers, **spec},
    }


def python(name: str, script: str, *args: str, **extra: Any) -> dict[str, Any]:
    return {"name": name, "image": "python:3.11", "command": [PY, "-c", textwrap.dedent(script), *args], **extra}


def condition(obj: dict[str, Any], kind: str) -> str | None:
    return next((c["status"] for c in (obj.get("status") or {}).get("conditions") or [] if c["type"] == kind), None)


def wait_obj(
    api: Api,
    node: LocalNode,
    gv: str,
    plural: str,
    name: str,
    predicate: Callable[[dict[str, Any]], Any],
    what: str,
    timeout: float = WAIT_S,
) -> dict[str, Any]:
    try:
        return wait_for(lambda: (o := api.get(gv, plural, name, NS)) and predicate(o) and o, timeout, what=what)
    except TimeoutError as exc:
        status = (api.get(gv, plural, name, NS) or {}).get("status")
        raise AssertionError(f"{exc}\nstatus: {json.dumps(status, indent=1)[:3000]}\n{node.describe(NS)}") from None


def wait_pod(
    api: Api, node: LocalNode, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = WAIT_S
) -> dict[str, Any]:
    return wait_obj(api, node, "v1", "pods", name, predicate, what, timeout)


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
    assert (
        paths.host("http://h/models/x") == "http://h/models/x"
        and paths.host("--url=http://h/tmp") == "--url=http://h/tmp"
    )
    assert paths.container("/h/pvc/abc") == "/models/abc"
    assert expand("$(A)-$(B)-$$(A)", {"A": "1"}) == "1-$(B)-$(A)"


# --- the Node ----------------------------------------------------------------------------------


def test_node_is_registered_ready_with_gpus_and_keeps_its_lease(api: Api, node: LocalNode) -> None:
    obj = api.get("v1", "nodes", node.name)
    assert obj is not None and condition(obj, "Ready") == "True"
    assert obj["status"]["allocatable"][C.GPU_RESOURCE] == str(GPUS)
    assert {"cpu", "memory", "pods"} <= set(obj["status"]["allocatable"])
    assert not (obj.get("spec") or {}).get("taints"), "the node-lifecycle controller tainted the node"
    lease = api.existing("coordination.k8s.io/v1", "leases", node.name, "kube-node-lease")
    first = lease["spec"]["renewTime"]
    assert lease["spec"]["holderIdentity"] == node.name
    wait_for(
        lambda: (
            api.existing("coordination.k8s.io/v1", "leases", node.name, "kube-node-lease")["spec"]["renewTime"] != first
        ),
        30,
        what="the lease renewed",
    )


def test_pod_asking_for_more_gpus_than_the_node_has_stays_unschedulable(api: Api, node: LocalNode) -> None:
    main = python("main", "pass", resources={"limits": {C.GPU_RESOURCE: str(GPUS + 1)}})
    api.create("v1", "pods", pod_body("greedy", [main]), NS)
    pod = wait_pod(api, node, "greedy", lambda p: condition(p, "PodScheduled") == "False", "PodScheduled=False")
    cond = next(c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled")
    assert cond["reason"] == "Unschedulable" and f"Insufficient {C.GPU_RESOURCE}" in cond["message"]
    assert not pod["spec"].get("nodeName") and node.pod(NS, "greedy") is None
    api.delete("v1", "pods", "greedy", NS)


# --- pods ------------------------------------------------------------------------------------

SERVER = """
    import json, os, sys, http.server
    out, token_file, namespace_file = sys.argv[1], sys.argv[2], sys.argv[3]
    facts = {"ip": os.environ["POD_IP"], "name": os.environ["POD_NAME"], "secret_env": os.environ["SECRET"],
             "secret_file": open(token_file).read(), "home": os.environ["HOME"], "cwd": os.getcwd(),
             "init": open(os.path.join(os.path.dirname(out), "init.txt")).read(),
             "namespace_file": open(namespace_file).read()}
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
    env = [
        {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
        {"name": "SECRET", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
        {"name": "PORT", "value": str(port)},
        {"name": "HOME", "value": "/data/home"},
    ]
    mounts = [
        {"name": "data", "mountPath": "/data"},
        {"name": "creds", "mountPath": "/var/run/creds", "readOnly": True},
    ]
    server = python(
        "server",
        SERVER,
        "/data/facts.json",
        "/var/run/creds/token",
        "/var/run/secrets/kubernetes.io/serviceaccount/namespace",
        env=env,
        volumeMounts=mounts,
        workingDir="/data",
        ports=[{"name": "http", "containerPort": port}],
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1},
        livenessProbe={"tcpSocket": {"port": port}, "periodSeconds": 1},
    )
    init = python(
        "init", "import sys; open(sys.argv[1], 'w').write('init ran')", "/data/init.txt", volumeMounts=mounts[:1]
    )
    # no automountServiceAccountToken: false, so the API server's ServiceAccount admission adds its projected
    # volume (a bound token, kube-root-ca.crt, the namespace) and the node must set it up
    return pod_body(
        name,
        [server],
        initContainers=[init],
        volumes=[
            {"name": "data", "emptyDir": {}},
            {"name": "creds", "secret": {"secretName": "creds", "items": [{"key": "token", "path": "token"}]}},
        ],
    )


def test_pod_with_an_http_server_gets_ready_through_its_probe(api: Api, node: LocalNode) -> None:
    port = free_port_on_node(node)
    api.create(
        "v1", "secrets", {"metadata": {"name": "creds"}, "data": {"token": base64.b64encode(b"s3cret").decode()}}, NS
    )
    for name in ("web-a", "web-b"):  # the same port on two pods: each has its own IP
        api.create("v1", "pods", server_pod(name, port), NS)
    pods = {
        name: wait_pod(api, node, name, lambda p: condition(p, "Ready") == "True", f"{name} Ready")
        for name in ("web-a", "web-b")
    }
    ips = {p["status"]["podIP"] for p in pods.values()}
    assert len(ips) == 2 and all(ip.startswith("127.") and ip != "127.0.0.1" for ip in ips)
    for name, p in pods.items():
        status = p["status"]
        assert p["spec"]["nodeName"] == node.name and status["phase"] == "Running"
        assert {condition(p, k) for k in ("Initialized", "ContainersReady", "PodScheduled")} == {"True"}
        assert status["qosClass"] == "BestEffort"  # the API server's, untouched by the node's status writes
        assert status["initContainerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
        cs = status["containerStatuses"][0]
        assert (cs["ready"], cs["started"], cs["restartCount"]) == (True, True, 0) and "running" in cs["state"]
        with urllib.request.urlopen(f"http://{status['podIP']}:{port}/", timeout=5) as r:
            facts = json.loads(r.read())
        runner = node.runner(NS, name)
        data = runner.volume("data")
        assert facts == {
            "ip": status["podIP"],
            "name": name,
            "secret_env": "s3cret",
            "secret_file": "s3cret",
            "home": f"{data}/home",
            "cwd": str(data),
            "init": "init ran",
            "namespace_file": NS,
        }
        procs = node.processes(NS, name, "server")
        assert len(procs) == 1 and procs[0].argv[-3:-1] == (f"{data}/facts.json", f"{runner.volume('creds')}/token")
        token_volume = next(v for v in p["spec"]["volumes"] if "projected" in v)["name"]
        assert (runner.volume(token_volume) / "token").read_text().count(".") == 2  # a JWT from TokenRequest


def free_port_on_node(node: LocalNode) -> int:
    from tests.support.local_node_cluster import free_port_on

    return free_port_on(node.ips(16))


def test_missing_secret_is_a_config_error_until_it_exists(api: Api, node: LocalNode) -> None:
    env = [{"name": "T", "valueFrom": {"secretKeyRef": {"name": "later", "key": "token"}}}]
    api.create(
        "v1",
        "pods",
        pod_body("waits", [python("main", "import time; time.sleep(600)", env=env)], terminationGracePeriodSeconds=1),
        NS,
    )
    p = wait_pod(
        api,
        node,
        "waits",
        lambda p: (
            ((p["status"].get("containerStatuses") or [{}])[0].get("state", {}).get("waiting") or {}).get("reason")
            == "CreateContainerConfigError"
        ),
        "config error",
    )
    assert p["status"]["containerStatuses"][0]["state"]["waiting"]["message"] == 'secret "later" not found'
    api.create("v1", "secrets", {"metadata": {"name": "later"}, "stringData": {"token": "x"}}, NS)
    wait_pod(api, node, "waits", lambda p: condition(p, "Ready") == "True", "Ready once the Secret exists")


def test_crashed_container_is_restarted_and_liveness_failure_kills_it(api: Api, node: LocalNode) -> None:
    liveness = {
        "exec": {"command": [PY, "-c", "import os, sys; sys.exit(os.path.exists(os.environ['FLAG']))"]},
        "periodSeconds": 1,
        "failureThreshold": 1,
    }
    main = python(
        "main",
        "import time; print('up', flush=True); time.sleep(600)",
        livenessProbe=liveness,
        env=[{"name": "FLAG", "value": "/scratch/unhealthy"}],
        volumeMounts=[{"name": "scratch", "mountPath": "/scratch"}],
    )
    api.create(
        "v1",
        "pods",
        pod_body(
            "crashy",
            [main],
            volumes=[{"name": "scratch", "emptyDir": {}}],
            terminationGracePeriodSeconds=1,
            automountServiceAccountToken=False,
        ),
        NS,
    )
    wait_pod(api, node, "crashy", lambda p: condition(p, "Ready") == "True", "Ready")
    first = node.processes(NS, "crashy", "main")
    assert len(first) == 1
    os.kill(first[0].pid, signal.SIGKILL)
    p = wait_pod(
        api,
        node,
        "crashy",
        lambda p: (
            p["status"]["containerStatuses"][0]["restartCount"] == 1 and p["status"]["containerStatuses"][0]["ready"]
        ),
        "restarted once",
    )
    last = p["status"]["containerStatuses"][0]["lastState"]["terminated"]
    assert (last["exitCode"], last["reason"], last["signal"]) == (137, "Error", 9)
    assert "up" in node.logs(NS, "crashy", "main", run=-2) and "up" in node.logs(NS, "crashy", "main")

    (node.runner(NS, "crashy").volume("scratch") / "unhealthy").write_text("")  # the exec probe now fails
    p = wait_pod(
        api,
        node,
        "crashy",
        lambda p: p["status"]["containerStatuses"][0]["restartCount"] >= 2,
        "restart by the liveness probe",
    )
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


def test_delete_runs_prestop_then_sigterm_then_kills_the_whole_tree(api: Api, node: LocalNode) -> None:
    pre_stop = {"exec": {"command": [PY, "-c", "import sys; open(sys.argv[1], 'a').write('preStop\\n')", "/out/log"]}}
    main = python(
        "main", KEEPER, "/out/log", volumeMounts=[{"name": "out", "mountPath": "/out"}], lifecycle={"preStop": pre_stop}
    )
    (node.root / "out").mkdir()
    api.create(
        "v1",
        "pods",
        pod_body(
            "tree",
            [main],
            terminationGracePeriodSeconds=2,
            volumes=[{"name": "out", "hostPath": {"path": str(node.root / "out")}}],
        ),
        NS,
    )
    log = node.root / "out" / "log"
    wait_for(lambda: log.exists() and "pids" in log.read_text(), WAIT_S, what="the process tree")
    pids = [int(x) for x in log.read_text().split("pids", 1)[1].split()]
    assert all(alive(p) for p in pids) and len(node.processes(NS, "tree")) == 3
    assert len({os.getsid(p) for p in pids}) == 2  # the child left the container's session, as torchrun ranks do

    api.delete("v1", "pods", "tree", NS)  # graceful: the API server sets deletionTimestamp, the node finishes
    wait_for(lambda: api.get("v1", "pods", "tree", NS) is None, WAIT_S, what="the pod gone from the API")
    assert not any(alive(p) for p in pids) and node.processes(NS, "tree") == []
    assert log.read_text().splitlines()[1:] == ["preStop", "SIGTERM"]
    assert not [p for p in tagged_processes(node.node_id) if "tree" in p.tag]


# --- Jobs (the real Job controller) -------------------------------------------------------------


def job_body(name: str, script: str, backoff_limit: int = 0, **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name},
        "spec": {
            "backoffLimit": backoff_limit,
            **spec,
            "template": {
                "spec": {
                    "restartPolicy": "Never",
                    "automountServiceAccountToken": False,
                    "containers": [python("work", script, terminationMessagePolicy="FallbackToLogsOnError")],
                }
            },
        },
    }


def job_pods(api: Api, name: str) -> list[dict[str, Any]]:
    return api.list("v1", "pods", NS, label_selector=f"{C.LABEL_JOB_NAME}={name}")


def wait_job(api: Api, node: LocalNode, name: str, kind: str, timeout: float = WAIT_S) -> dict[str, Any]:
    return wait_obj(
        api, node, "batch/v1", "jobs", name, lambda j: condition(j, kind) == "True", f"Job {name} {kind}", timeout
    )


def test_job_pod_exit_0_completes_the_job(api: Api, node: LocalNode) -> None:
    api.create("batch/v1", "jobs", job_body("ok", "print('done')"), NS)
    job = wait_job(api, node, "ok", "Complete")
    assert (job["status"]["succeeded"], job["status"].get("active", 0), job["status"].get("failed", 0)) == (1, 0, 0)
    assert condition(job, "SuccessCriteriaMet") == "True" and job["status"]["completionTime"]
    (pod,) = job_pods(api, "ok")
    assert pod["status"]["phase"] == "Succeeded" and pod["metadata"]["name"].startswith("ok-")
    assert pod["status"]["containerStatuses"][0]["state"]["terminated"]["reason"] == "Completed"
    assert "done" in node.logs(NS, pod["metadata"]["name"], "work")


def test_job_failures_use_backoff_limit_and_pod_failure_policy(api: Api, node: LocalNode) -> None:
    api.create("batch/v1", "jobs", job_body("flaky", "print('error: boom'); raise SystemExit(3)", backoff_limit=1), NS)
    fatal = job_body(
        "fatal",
        "print('error: bad hash'); raise SystemExit(4)",
        backoff_limit=5,
        podFailurePolicy={
            "rules": [
                {"action": "FailJob", "onExitCodes": {"containerName": "work", "operator": "In", "values": [2, 4]}}
            ]
        },
    )
    api.create("batch/v1", "jobs", fatal, NS)

    job = wait_job(api, node, "fatal", "Failed")
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert (
        failed["reason"] == "PodFailurePolicy" and "exit code 4 matching FailJob rule at index 0" in failed["message"]
    )
    assert len(job_pods(api, "fatal")) == 1  # no retry of a fatal exit code

    job = wait_job(api, node, "flaky", "Failed", timeout=WAIT_S + 30)  # the controller waits 10 s before a retry
    failed = next(c for c in job["status"]["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and job["status"]["failed"] == 2
    pods = job_pods(api, "flaky")
    assert len(pods) == 2 and {p["status"]["phase"] for p in pods} == {"Failed"}
    term = pods[0]["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["message"].strip() == "error: boom"


# --- StatefulSets (the real controller) and the Service proxy ---------------------------------------

WEB = """
    import http.server, os, sys
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ready = not os.path.exists(os.environ["UNREADY_FLAG"])
            self.send_response(200 if ready or self.path != "/ready" else 503)
            self.end_headers()
            self.wfile.write(f"{os.environ['POD_NAME']} v{os.environ['VERSION']}".encode())
        def log_message(self, *a):
            pass
    http.server.HTTPServer((os.environ["IP"], int(sys.argv[1])), H).serve_forever()
"""


def web_statefulset(port: int, replicas: int) -> dict[str, Any]:
    labels = {"app": "web"}
    serve = python(
        "web",
        WEB,
        str(port),
        ports=[{"name": "http", "containerPort": port}],
        env=[
            {"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "VERSION", "value": "1"},
            {"name": "UNREADY_FLAG", "value": "/flags/unready"},
        ],  # env values are path-mapped
        volumeMounts=[{"name": "flags", "mountPath": "/flags"}],
        readinessProbe={"httpGet": {"path": "/ready", "port": "http"}, "periodSeconds": 1, "failureThreshold": 1},
    )
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "web"},
        "spec": {
            "replicas": replicas,
            "serviceName": "web",
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "containers": [serve],
                    "terminationGracePeriodSeconds": 2,
                    "automountServiceAccountToken": False,
                    "volumes": [{"name": "flags", "emptyDir": {}}],
                },
            },
        },
    }


def get_through(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def test_statefulset_pods_scale_roll_and_serve_through_the_service_proxy(api: Api, node: LocalNode) -> None:
    port = free_port_on_node(node)
    api.create(
        "v1",
        "services",
        {
            "metadata": {"name": "web"},
            "spec": {"selector": {"app": "web"}, "ports": [{"name": "http", "port": 80, "targetPort": "http"}]},
        },
        NS,
    )
    api.create("apps/v1", "statefulsets", web_statefulset(port, 2), NS)

    def sts(pred: Callable[[dict[str, Any]], Any], what: str) -> dict[str, Any]:
        return wait_obj(api, node, "apps/v1", "statefulsets", "web", lambda s: pred(s.get("status") or {}), what)

    s = sts(lambda st: st.get("readyReplicas") == 2, "2 ready replicas")
    assert s["status"]["currentRevision"] == s["status"]["updateRevision"]
    pods = {n: api.existing("v1", "pods", n, NS) for n in ("web-0", "web-1")}
    assert len({p["status"]["podIP"] for p in pods.values()} | {"127.0.0.1"}) == 3
    assert pods["web-1"]["spec"]["hostname"] == "web-1"

    # the Service: port 80 by name or number, to targetPort "http" of a ready pod, from 127.0.0.1
    url = node.service_url(NS, "web", "http")
    assert url == node.service_url(NS, "web", 80) and url.startswith("http://127.0.0.1:")
    wait_for(lambda: len(node.proxy.backends(NS, "web")) == 2, WAIT_S, what="both pods behind the Service")
    seen = {get_through(url) for _ in range(30)}
    assert seen == {"web-0 v1", "web-1 v1"}  # random choice among the ready endpoints reaches both
    (node.runner(NS, "web-1").volume("flags") / "unready").write_text("")  # web-1 fails its readiness probe
    wait_pod(api, node, "web-1", lambda p: condition(p, "Ready") == "False", "web-1 not ready")
    wait_for(
        lambda: node.proxy.backends(NS, "web") == [(pods["web-0"]["status"]["podIP"], port)],
        WAIT_S,
        what="only web-0 behind the Service",
    )
    assert {get_through(url) for _ in range(10)} == {"web-0 v1"}

    old_pids = [p.pid for p in node.processes(NS, "web-1")]
    api.patch("apps/v1", "statefulsets", "web", {"spec": {"replicas": 1}}, NS)
    wait_for(lambda: api.get("v1", "pods", "web-1", NS) is None, WAIT_S, what="web-1 deleted by the controller")
    assert old_pids and not any(alive(p) for p in old_pids)

    template = s["spec"]["template"]
    template["spec"]["containers"][0]["env"][2]["value"] = "2"
    api.patch("apps/v1", "statefulsets", "web", {"spec": {"template": template}}, NS)
    s = sts(
        lambda st: (
            st.get("observedGeneration") == 3
            and st.get("updatedReplicas") == 1
            and st.get("readyReplicas") == 1
            and st.get("currentRevision") == st.get("updateRevision")
        ),
        "rolled",
    )
    pod = api.existing("v1", "pods", "web-0", NS)
    assert pod["metadata"]["labels"][C.LABEL_CONTROLLER_REVISION_HASH] == s["status"]["updateRevision"]
    assert pod["metadata"]["uid"] != pods["web-0"]["metadata"]["uid"]
    assert node.processes(NS, "web-0")[0].env["VERSION"] == "2"
    wait_for(lambda: get_through(url) == "web-0 v2", WAIT_S, what="the Service reaches the new pod")

    api.delete("v1", "services", "web", NS)
    wait_for(lambda: node.proxy.address(NS, "web", "http") is None, WAIT_S, what="the Service's port closed")
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", int(url.rsplit(":", 1)[1])), timeout=2):
        pass


# --- volumes (the node's provisioner, the real PV and PVC-protection controllers) -------------------


def test_claim_is_provisioned_protected_while_in_use_and_released_after(api: Api, node: LocalNode) -> None:
    api.create(
        "v1",
        "persistentvolumeclaims",
        {
            "metadata": {"name": "cache"},
            "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "1Gi"}}},
        },
        NS,
    )
    claim = wait_obj(
        api,
        node,
        "v1",
        "persistentvolumeclaims",
        "cache",
        lambda c: (c.get("status") or {}).get("phase") == "Bound",
        "claim Bound",
    )
    assert claim["spec"]["storageClassName"] == STORAGE_CLASS  # the default class, set at admission
    volume = api.existing("v1", "persistentvolumes", claim["spec"]["volumeName"])
    assert volume["metadata"]["annotations"][ANN_PROVISIONED_BY] == STORAGE_PROVISIONER
    assert volume["spec"]["claimRef"]["uid"] == claim["metadata"]["uid"]
    path = Path(volume["spec"]["local"]["path"])

    writer = python(
        "main",
        "import sys, time; open(sys.argv[1], 'w').write('kept'); time.sleep(600)",
        "/cache/f",
        volumeMounts=[{"name": "cache", "mountPath": "/cache"}],
    )
    api.create(
        "v1",
        "pods",
        pod_body(
            "user",
            [writer],
            terminationGracePeriodSeconds=1,
            automountServiceAccountToken=False,
            volumes=[{"name": "cache", "persistentVolumeClaim": {"claimName": "cache"}}],
        ),
        NS,
    )
    wait_pod(api, node, "user", lambda p: condition(p, "Ready") == "True", "the claim's user Ready")
    wait_for(lambda: (path / "f").exists(), WAIT_S, what="the file on the volume")
    assert node.runner(NS, "user").claims == {(NS, "cache")}

    api.delete("v1", "persistentvolumeclaims", "cache", NS)  # in use: PVC protection keeps it
    claim = wait_obj(
        api,
        node,
        "v1",
        "persistentvolumeclaims",
        "cache",
        lambda c: c["metadata"].get("deletionTimestamp"),
        "claim terminating",
    )
    assert "kubernetes.io/pvc-protection" in claim["metadata"]["finalizers"]
    time.sleep(4 * node.resync_s)  # a few passes of the node and the controllers: still held
    assert api.get("v1", "persistentvolumeclaims", "cache", NS) is not None and (path / "f").read_text() == "kept"

    api.delete("v1", "pods", "user", NS)
    wait_for(
        lambda: api.get("v1", "persistentvolumeclaims", "cache", NS) is None,
        WAIT_S,
        what="the claim gone once no pod uses it",
    )
    wait_for(
        lambda: api.get("v1", "persistentvolumes", volume["metadata"]["name"]) is None and not path.exists(),
        WAIT_S,
        what="the released volume and its directory deleted",
    )
