"""End to end on one machine: kubectl apply -> operator -> real controllers -> pods that run -> actions via the Service.

Nothing is played by the test: the session's real control plane (etcd,
kube-apiserver, kube-controller-manager, kube-scheduler) stores and
reconciles, the real ``policyserver operator`` creates the children, the
real Job and StatefulSet controllers make the pods, the real scheduler binds
them to the local node (tests/support/local_node.py), which runs them -- the
fetch Job's ``policyserver fetch``, the init container's ``policyserver
checkpoint verify``, ``torchrun ... -m policy_operator.runtime.worker`` with
gloo on CPU -- with their commands, env, volumes and probes as written, and
the real openpi client gets actions through the Service (the node's proxy).
Two PolicyServers: the cfgp=2,dp=1 sample (its checkpoint behind a bearer
token from the sample's Secret) and the cfgp=1,dp=2 sample (two pods sharing
one cache claim of the sample's ``nfs-client`` class), each derived from
``examples/`` by editing the YAML here.  docs/e2e.md explains the set-up and
the timings.
"""

from __future__ import annotations

import base64
import json
import math
import os
import re
import signal
import subprocess
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.manifests import SERVER_CONTAINER, Names
from policy_operator.source_uri import request_key
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.local_node_cluster import LocalCluster, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
NS = "robots"
TOKEN = "e2e-checkpoint-token"
AVAILABLE_S = 300  # two PolicyServers, 6 torch ranks and 3 torchrun agents starting on 2 busy cores
WAIT_S = 120.0
CFGP2, CFGP1 = "policy-cfgp2-dp1", "policy-cfgp1-dp2"


@dataclass
class Deployment:
    cluster: LocalCluster
    port: int
    servers: dict[str, CheckpointServer]  # PolicyServer name -> the HTTP server holding its checkpoint
    docs: dict[str, dict[str, Any]]
    applied_at: float
    wait_output: dict[str, str]


def example(name: str) -> dict[str, Any]:
    return yaml.safe_load((REPO / "examples" / f"{name}.yaml").read_text())


def init_checkpoint(path: Path, seed: int) -> None:
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(path), "--seed", str(seed)],
        check=True,
        capture_output=True,
        timeout=120,
    )


@pytest.fixture(scope="module")
def deployment(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    work = tmp_path_factory.mktemp("e2e")
    init_checkpoint(work / "sources" / "a" / "ckpt", seed=0)
    init_checkpoint(work / "sources" / "b" / "ckpt", seed=1)
    servers = {
        CFGP2: CheckpointServer(work / "sources" / "a", token=TOKEN).start(),
        CFGP1: CheckpointServer(work / "sources" / "b").start(),
    }
    storage_class = example("policyserver-cfgp1-dp2")["spec"]["storage"]["storageClassName"]
    cluster = LocalCluster(control_plane, work / "cluster", NS, backoff_s=2.0, storage_classes=[storage_class])
    try:
        cluster.start()
        secret = example("policyserver-cfgp2-dp1")["spec"]["checkpoint"]["secretRef"]["name"]
        cluster.api.create(
            "v1",
            "secrets",
            {"metadata": {"name": secret}, "data": {C.SECRET_TOKEN_KEY: base64.b64encode(TOKEN.encode()).decode()}},
            NS,
        )
        port = free_port_on(["127.0.0.1", *cluster.node.ips(24)])
        docs = {
            name: for_local_node(
                example(f"policyserver-{name.removeprefix('policy-')}"),
                source=servers[name].url_for("ckpt/"),
                port=port,
            )
            for name in (CFGP2, CFGP1)
        }
        applied_at = time.time()
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump_all(docs.values()))
        wait_output = {}
        for name in docs:
            try:
                wait_output[name] = cluster.kubectl(
                    "wait",
                    "--for=condition=Available",
                    f"policyserver/{name}",
                    f"--timeout={AVAILABLE_S}s",
                    timeout=AVAILABLE_S + 30,
                ).stdout
            except subprocess.CalledProcessError as exc:
                raise AssertionError(
                    f"{exc}\nstatus: {json.dumps(cluster.status(name), indent=1)[:4000]}\n{cluster.describe()}"
                ) from None
        yield Deployment(cluster, port, servers, docs, applied_at, wait_output)
    finally:
        cluster.stop()
        for server in servers.values():
            server.stop()
    cluster.node.raise_errors()
    assert not cluster.node.processes(), "processes outlived the cluster"
    assert "Traceback" not in cluster.operator.log.read_text(), f"the operator crashed; see {cluster.operator.log}"


def wait_status(
    d: Deployment, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = WAIT_S
) -> dict[str, Any]:
    return d.cluster.wait_status(name, predicate, what, timeout)


def server_pods(d: Deployment, name: str) -> list[dict[str, Any]]:
    pods = d.cluster.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    return sorted(pods, key=lambda p: p["metadata"]["name"])


def events(d: Deployment, name: str) -> list[tuple[str, str, str]]:
    return [
        (e.get("type", ""), e.get("reason", ""), e.get("message", ""))
        for e in d.cluster.api.events(NS, involved_name=name)
    ]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes() != b""
    except OSError:
        return False


def processes_per_pod(layout: str, fronts: int = 0) -> int:
    """The node processes of one server pod of ``layout`` (``cfgp=C,dp=D``) with ``fronts`` front-end processes."""
    world = math.prod(int(part.split("=")[1]) for part in layout.split(","))
    return (1 if world == 1 else 2 + world) + fronts


def frontend_processes(d: Deployment, name: str) -> int:
    """The front-end processes a PolicyServer's pods run (spec.runtime.frontend; none inline)."""
    frontend = d.docs[name]["spec"].get("runtime", {}).get("frontend", {})
    return int(frontend.get("processes", 1)) if frontend.get("mode") == "process" else 0


def mounts(pod: dict[str, Any], claim: str) -> bool:
    return any((v.get("persistentVolumeClaim") or {}).get("claimName") == claim for v in pod["spec"].get("volumes", []))


def requests_served(ip: str, port: int) -> float:
    """Sum of ``policy_requests_total`` on one pod's /metrics."""
    with urllib.request.urlopen(f"http://{ip}:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    return sum(float(m.group(1)) for m in re.finditer(r"^policy_requests_total\{[^}]*\} (\S+)$", text, re.M))


def wait_for_endpoints(d: Deployment, name: str, count: int) -> None:
    """The Service sends traffic to pods the kubelet reports Ready (readinessProbe every 5 s), which can come a
    little after Available (kubectl wait, the fixture's last step)."""
    service = Names(name).service
    wait_for(
        lambda: len(d.cluster.node.proxy.backends(NS, service)) == count,
        60,
        what=f"{count} ready endpoint(s) behind Service {service}",
    )


def actions_through_service(d: Deployment, name: str, connections: int, seed: int = 1) -> list[dict[str, Any]]:
    """One openpi-client session after another to the Service (ws://127.0.0.1:PORT, the node's proxy)."""
    from policy_operator.runtime.client import robolab_observation
    from tests.support.openpi import session_at

    host, port = d.cluster.node.service_address(NS, Names(name).service, C.PORT_NAME)
    answers = []
    for _ in range(connections):
        with session_at(host, port) as client:
            meta = client.get_server_metadata()
            obs = robolab_observation(meta, seed=seed, fixed_seed=7)
            answers.append({"meta": meta, "first": client.infer(obs)["actions"], "again": client.infer(obs)["actions"]})
    return answers


# --- the tests, in the order a person would check things -------------------------------------------


def test_kubectl_wait_available_and_every_rank_ready(deployment: Deployment) -> None:
    d = deployment
    for name in (CFGP2, CFGP1):
        assert f"policyserver.{C.GROUP}/{name} condition met" in d.wait_output[name]
        d.cluster.kubectl(
            "wait",
            "--for=jsonpath={.status.phase}=Ready",
            f"policyserver/{name}",
            f"--timeout={int(WAIT_S)}s",
            timeout=WAIT_S + 30,
        )
    a = wait_status(d, CFGP2, lambda s: s.get("ranksReady") == "2/2", "cfgp=2: 2/2 ranks")
    b = wait_status(d, CFGP1, lambda s: s.get("ranksReady") == "4/4", "cfgp=1,dp=2: 4/4 ranks (2 pods)")
    assert (a["ready"], a["layout"], b["ready"], b["layout"]) == ("1/1", "cfgp=2,dp=1", "2/2", "cfgp=1,dp=2")
    for status, cfgp in ((a, 2), (b, 1)):
        for pod in status["pods"]:
            assert pod["ranksReady"] == "2/2" and pod["ready"] is True
            assert [(r["rank"], r["dpIndex"], r["cfgIndex"], r["ready"]) for r in pod["ranks"]] == [
                (r, r // cfgp, r % cfgp, True) for r in range(2)
            ]
    table = d.cluster.kubectl("get", C.SHORT_NAME).stdout.splitlines()
    rows = {line.split()[0]: line.split() for line in table[1:]}
    assert rows[CFGP2][1:6] == ["1/1", "2/2", "cfgp=2,dp=1", "Ready", "Ready"]
    assert rows[CFGP1][1:6] == ["2/2", "4/4", "cfgp=1,dp=2", "Ready", "Ready"]


def test_real_controllers_made_the_pods_and_the_scheduler_bound_them(deployment: Deployment) -> None:
    d = deployment
    for name, replicas in ((CFGP2, 1), (CFGP1, 2)):
        # the controller counts pods the node reports Ready (its readinessProbe, every 5 s), which may come a
        # little after the operator's own /readyz poll made the PolicyServer Available
        def ready_statefulset(n: str = name, r: int = replicas) -> dict[str, Any] | None:
            s = d.cluster.get("apps/v1", "statefulsets", Names(n).statefulset)
            return s if s and s["status"].get("readyReplicas") == r else None

        sts = wait_for(ready_statefulset, WAIT_S, what=f"{name}: StatefulSet ready")
        assert sts["status"]["currentRevision"] == sts["status"]["updateRevision"]
        for pod in server_pods(d, name):
            owner = pod["metadata"]["ownerReferences"][0]
            assert (owner["kind"], owner["uid"]) == ("StatefulSet", sts["metadata"]["uid"])
            assert pod["metadata"]["labels"][C.LABEL_CONTROLLER_REVISION_HASH] == sts["status"]["currentRevision"]
            assert pod["spec"]["nodeName"] == d.cluster.node.name
            assert any(c["type"] == "PodScheduled" and c["status"] == "True" for c in pod["status"]["conditions"])
            assert pod["status"]["qosClass"] == "Burstable"  # the samples request CPU and memory
    node = d.cluster.api.existing("v1", "nodes", d.cluster.node.name)
    assert node["status"]["allocatable"][C.GPU_RESOURCE] == "8"


def test_one_fetch_job_and_one_download_per_checkpoint(deployment: Deployment) -> None:
    d = deployment
    for name, doc in d.docs.items():
        key = request_key(doc["spec"]["checkpoint"]["source"], doc["spec"]["checkpoint"].get("revision"))
        jobs = d.cluster.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_FETCH}")
        assert [j["metadata"]["name"] for j in jobs] == [Names(name).job(key)]
        assert jobs[0]["status"]["succeeded"] == 1
        assert d.cluster.status(name)["checkpoint"]["phase"] == "Ready"
        server = d.servers[name]
        for file in (C.MANIFEST_FILE, C.CONFIG_FILE, C.WEIGHTS_FILE):
            assert server.count(f"/ckpt/{file}") == 1, (name, file, server.requests)
        # a completed fetch pod is deleted at once: it would keep a deleted cache claim alive (docs/operator.md)
        selector = f"{C.LABEL_JOB_NAME}={jobs[0]['metadata']['name']}"
        deadline = time.monotonic() + 30
        while (fetch_pods := d.cluster.list("v1", "pods", selector)) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert [p["status"]["phase"] for p in fetch_pods] == []
    # the cfgp=2 sample's Secret reached the fetch as a bearer token (the server refuses requests without it)
    assert {r.headers.get("Authorization") for r in d.servers[CFGP2].requests} == {"<redacted>"}
    # both pods of the dp=2 PolicyServer mount the one cache claim, of the sample's class, on one volume
    runners = [d.cluster.node.runner(NS, p["metadata"]["name"]) for p in server_pods(d, CFGP1)]
    assert len(runners) == 2 and runners[0].claims == runners[1].claims == {(NS, Names(CFGP1).pvc)}
    claim = d.cluster.existing("v1", "persistentvolumeclaims", Names(CFGP1).pvc)
    assert claim["status"]["phase"] == "Bound" and claim["spec"]["accessModes"] == ["ReadWriteMany"]
    assert claim["spec"]["storageClassName"] == d.docs[CFGP1]["spec"]["storage"]["storageClassName"]


def test_pods_run_torchrun_with_gloo_on_cpu(deployment: Deployment) -> None:
    d = deployment
    ips = set()
    for name, cfgp in ((CFGP2, 2), (CFGP1, 1)):
        for pod in server_pods(d, name):
            pod_name, ip = pod["metadata"]["name"], pod["status"]["podIP"]
            ips.add(ip)
            container = pod["spec"]["containers"][0]
            assert C.GPU_RESOURCE not in json.dumps(container.get("resources") or {})
            procs = d.cluster.node.processes(NS, pod_name, SERVER_CONTAINER)
            agents = [p for p in procs if any(a.endswith("/torchrun") for a in p.argv[:2])]
            assert len(agents) == 1, [p.argv for p in procs]
            ranks = sorted((p for p in procs if p.ppid == agents[0].pid), key=lambda p: int(p.env["RANK"]))
            # the cfgp=1 example decodes in 2 front-end processes (runtime.frontend): children of rank 0, no rank
            fronts = [p for p in procs if "policy_operator.runtime.serving.frontend" in p.argv]
            assert len(fronts) == frontend_processes(d, name) == (2 if name == CFGP1 else 0), [p.argv for p in procs]
            assert all(p.ppid == ranks[0].pid and "RANK" not in p.env for p in fronts)
            assert [p.env["RANK"] for p in ranks] == ["0", "1"] and len(procs) == 4 + len(fronts)  # serve, torchrun
            for rank in ranks:
                assert "policy_operator.runtime.worker" in rank.argv
                argv = list(rank.argv)
                assert argv[argv.index("--device") + 1] == "cpu" and argv[argv.index("--cfgp") + 1] == str(cfgp)
                assert rank.env[C.ENV_HOST] == ip and rank.env["WORLD_SIZE"] == "2"
            log = d.cluster.node.logs(NS, pod_name, SERVER_CONTAINER)
            for r in (0, 1):
                assert f"rank {r}/2 joined cfgp={cfgp},dp={2 // cfgp} (backend gloo" in log, log[-3000:]
            assert ("2 front-end processes)" in log) is (name == CFGP1), log[-3000:]
    assert len(ips) == 3  # three pods, three loopback addresses, one port


def test_openpi_client_gets_actions_through_the_service(deployment: Deployment) -> None:
    d = deployment
    for name, (cfgp, dp) in ((CFGP2, (2, 1)), (CFGP1, (1, 2))):
        pods = server_pods(d, name)
        wait_for_endpoints(d, name, len(pods))
        before = {p["metadata"]["name"]: requests_served(p["status"]["podIP"], d.port) for p in pods}
        answers = actions_through_service(d, name, connections=16 if len(pods) > 1 else 2)
        for a in answers:
            meta = a["meta"]
            assert meta["layout"] == {"cfgp": cfgp, "dp": dp, "world_size": 2} and meta["steps"] == 2
            assert a["first"].shape == tuple(meta["action_shape"]) and np.isfinite(a["first"]).all()
            assert np.array_equal(a["first"], a["again"])  # same observation and seed: same actions
        assert all(np.array_equal(a["first"], answers[0]["first"]) for a in answers)  # every pod: same weights
        after = {p["metadata"]["name"]: requests_served(p["status"]["podIP"], d.port) for p in pods}
        assert sum(after.values()) - sum(before.values()) == 2 * len(answers)
        # the proxy spread the 16 connections over both ready pods of the dp=2 PolicyServer
        assert all(after[n] > before[n] for n in after), (before, after)


def test_killed_rank_degrades_then_the_restarted_container_recovers(deployment: Deployment) -> None:
    d = deployment
    (pod,) = server_pods(d, CFGP2)
    pod_name = pod["metadata"]["name"]
    before = pod["status"]["containerStatuses"][0]["restartCount"]
    (rank1,) = [p for p in d.cluster.node.processes(NS, pod_name, SERVER_CONTAINER) if p.env.get("RANK") == "1"]
    os.kill(rank1.pid, signal.SIGKILL)

    degraded = wait_status(d, CFGP2, lambda s: s.get("phase") == C.PHASE_DEGRADED, "phase Degraded")
    available = next(c for c in degraded["conditions"] if c["type"] == C.COND_AVAILABLE)
    assert (available["status"], available["reason"]) == ("False", "ReplicasUnavailable")
    # torchrun (--max-restarts=0) ends the job, the container exits non-zero, the node restarts it after its
    # backoff (restartPolicy Always) and its readinessProbe (every 5 s, as the manifest says) passes again
    cs = wait_for(
        lambda: (
            (c := d.cluster.existing("v1", "pods", pod_name)["status"]["containerStatuses"][0])["restartCount"]
            == before + 1
            and c["ready"]
            and c
        ),
        AVAILABLE_S,
        what="the server container restarted and Ready again",
    )
    assert cs["started"] is True
    last = cs["lastState"]["terminated"]
    assert last["exitCode"] != 0 and last["reason"] == "Error", last  # torchrun's exit once a rank died
    recovered = wait_status(
        d,
        CFGP2,
        lambda s: s.get("phase") == C.PHASE_READY and s.get("ranksReady") == "2/2",
        "phase Ready again",
        timeout=AVAILABLE_S,
    )
    assert next(c for c in recovered["conditions"] if c["type"] == C.COND_AVAILABLE)["status"] == "True"
    # kopf posts Events from its queue after the status patch: wait for them, bounded
    wait_for(
        lambda: (
            {("Warning", "phase Ready -> Degraded"), ("Normal", "phase Degraded -> Ready")}
            <= {(t, m.split(":", 1)[0]) for t, r, m in events(d, CFGP2) if m.startswith("phase ")}
        ),
        30,
        what="the phase Events of the outage and the recovery",
    )
    # the pod kept its name and address: the StatefulSet did not replace it, the kubelet restarted the container
    assert d.cluster.existing("v1", "pods", pod_name)["metadata"]["uid"] == pod["metadata"]["uid"]


@pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")
def test_layout_change_rolls_the_pods_to_the_new_world_size(deployment: Deployment) -> None:
    d = deployment
    old = {p["metadata"]["name"]: p["metadata"]["uid"] for p in server_pods(d, CFGP1)}
    d.cluster.kubectl("patch", C.SHORT_NAME, CFGP1, "--type=merge", "-p", '{"spec":{"parallelism":{"dp":1}}}')
    status = wait_status(
        d,
        CFGP1,
        lambda s: s.get("layout") == "cfgp=1,dp=1" and s.get("phase") == C.PHASE_READY and s.get("ranksReady") == "2/2",
        "rolled to cfgp=1,dp=1 (2 pods x 1 rank)",
        timeout=AVAILABLE_S,
    )
    assert status["ready"] == "2/2"
    new = {p["metadata"]["name"]: p["metadata"]["uid"] for p in server_pods(d, CFGP1)}
    # every pod replaced (each old one retired once a new one serves: the names move up, rollout.py)
    assert len(new) == len(old) and not set(new.values()) & set(old.values())
    for pod in server_pods(d, CFGP1):
        procs = d.cluster.node.processes(NS, pod["metadata"]["name"], SERVER_CONTAINER)
        # a single rank runs in serve itself, no torchrun; its 2 front-end processes are its children
        (serve,) = [p for p in procs if "serve" in p.argv]
        fronts = [p for p in procs if "policy_operator.runtime.serving.frontend" in p.argv]
        assert len(procs) == 3 and len(fronts) == 2 and all(p.ppid == serve.pid for p in fronts), procs
    (answer,) = actions_through_service(d, CFGP1, connections=1)
    assert answer["meta"]["layout"] == {"cfgp": 1, "dp": 1, "world_size": 1}


def test_kubectl_delete_collects_everything_and_the_claim_waits_for_its_pods(deployment: Deployment) -> None:
    d = deployment
    node = d.cluster.node
    pids = [p.pid for p in node.processes(NS)]
    # per pod: serve alone runs a single rank; more ranks are serve + torchrun + one process each (read from the
    # layout each PolicyServer has now, whichever tests ran before)
    expected = sum(
        len(server_pods(d, n)) * processes_per_pod(d.cluster.status(n)["layout"], frontend_processes(d, n))
        for n in (CFGP2, CFGP1)
    )
    assert len(pids) == expected, [p.argv for p in node.processes(NS)]
    claims = {n: d.cluster.existing("v1", "persistentvolumeclaims", Names(n).pvc) for n in (CFGP2, CFGP1)}
    assert all("kubernetes.io/pvc-protection" in c["metadata"]["finalizers"] for c in claims.values())
    volumes = [c["spec"]["volumeName"] for c in claims.values()]
    gone_at: dict[str, float] = {}  # "pods <name>" / "claim <name>" -> when it left the API
    held: set[str] = set()  # claims seen deleted (deletionTimestamp set) while pods that mount them still existed

    def watch_gone() -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline and len(gone_at) < 4:
            for n in (CFGP2, CFGP1):
                # the server and fetch pods that hold the claim: PVC protection counts a pod once it is bound to
                # a node (a pod the StatefulSet controller recreates during teardown, never scheduled, mounts nothing)
                # and until it has terminated (a Succeeded or Failed pod whose object is still being deleted holds
                # nothing either)
                pods = [
                    p
                    for p in d.cluster.list("v1", "pods", f"{C.LABEL_INSTANCE}={n}")
                    if p["spec"].get("nodeName")
                    and mounts(p, Names(n).pvc)
                    and p.get("status", {}).get("phase") not in ("Succeeded", "Failed")
                ]
                claim = d.cluster.get("v1", "persistentvolumeclaims", Names(n).pvc)
                if not pods:
                    gone_at.setdefault(f"pods {n}", time.monotonic())
                if claim is None:
                    gone_at.setdefault(f"claim {n}", time.monotonic())
                elif claim["metadata"].get("deletionTimestamp") and pods:
                    held.add(n)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch_gone, daemon=True)
    watcher.start()
    d.cluster.kubectl("delete", C.SHORT_NAME, CFGP2, CFGP1, "--timeout=120s", timeout=150)
    watcher.join(WAIT_S + 5)
    try:
        wait_for(
            lambda: not d.cluster.list("v1", "pods") and not node.processes(NS),
            WAIT_S,
            what="every pod gone and every process ended",
        )
    except TimeoutError as exc:
        raise AssertionError(f"{exc}\n{d.cluster.describe()}") from None
    assert not any(alive(pid) for pid in pids)
    # the garbage collector deleted the claims with their owner at once; PVC protection held each one until
    # the pods mounting it were gone (the server pods' preStop sleep alone lasts 5 s)
    assert len(gone_at) == 4 and all(gone_at[f"claim {n}"] >= gone_at[f"pods {n}"] for n in (CFGP2, CFGP1)), gone_at
    assert held == {CFGP2, CFGP1}
    for gv, plural in (
        ("apps/v1", "statefulsets"),
        ("batch/v1", "jobs"),
        ("v1", "services"),
        ("v1", "persistentvolumeclaims"),
    ):
        assert d.cluster.list(gv, plural) == [], plural
    wait_for(
        lambda: (
            all(d.cluster.api.get("v1", "persistentvolumes", v) is None for v in volumes)
            and not list((node.root / "pv").iterdir())
        ),
        WAIT_S,
        what="the released volumes and directories deleted",
    )
