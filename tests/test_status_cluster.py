"""Status that never lies, on the real control plane: the real StatefulSet/Job controllers, ResourceQuota
admission and the local node's kubelet decide; the operator's status must say what they did.

One operator and one local node for the module (short resync, tiny checkpoint, 2 CPU steps).  What is
pinned down: a rollout watched throughout never reads Ready while a pod of the old template serves, nor
RanksUnknown while the new pod starts, and the happy path posts no Warning (the cache claim binding is a
wait); a crash-looping pod is Failed at once with the error that killed it; a SIGSTOPped pod is "not
answering /readyz"; a template that crashes (``--dtype bogus``) reaches
ProgressDeadlineExceeded with the rank's own error (from its termination message: the operator reads no
log); a ResourceQuota on ``requests.nvidia.com/gpu`` shows up as FailedCreate instead of an endless Starting; a fetch pod that cannot start says why and stalls at the
deadline; an apply the apiserver always refuses is Stalled, not retried; and a PolicyServer at rest costs the
operator (as its own ServiceAccount) no API request.
The decisions themselves are unit-tested in tests/test_status_decisions.py.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.kube import CACHED_KINDS
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.kubectl_table import table
from tests.support.local_node_cluster import LocalCluster, OperatorProcess, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
NS = "status-it"
WAIT_S = 150.0
RESYNC_S = 0.5
KOPF_WATCHES = 4  # kopf's own: PolicyServers, fetch Jobs, StatefulSets (operator/handlers.py) and its peering


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

    def wait(
        self, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = WAIT_S
    ) -> dict[str, Any]:
        return self.lc.wait_status(name, predicate, what, timeout)

    def delete(self, name: str) -> None:
        self.lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    import subprocess

    work = tmp_path_factory.mktemp("status-it")
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=RESYNC_S, gpus=2)
    lc.operator.probe_timeout_s = 0.5
    try:
        lc.start()
        yield Env(lc, source, free_port_on(["127.0.0.1", *lc.node.ips(16)]))
    finally:
        lc.stop()
        source.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def test_a_rollout_watched_throughout_never_reads_ready_while_an_old_pod_serves(env: Env) -> None:
    name = "rolling"
    env.apply(env.doc(name))
    first = env.wait(name, lambda s: s.get("phase") == C.PHASE_READY, "first Ready")
    assert cond(first, C.COND_READY)["status"] == "True" and cond(first, C.COND_READY)["reason"] == "ReplicasReady"
    # the happy path raises no alarm: the fetch pod waited for its new cache claim to bind (the scheduler said
    # "pod has unbound immediate PersistentVolumeClaims"), which is no Unschedulable Warning (issue 40 item 11)
    env.lc.operator.settle()  # kopf posts a pass's Events after its status
    warnings = [
        (e.get("reason"), e.get("message"))
        for e in env.lc.api.events(NS, involved_name=name)
        if e.get("type") == "Warning" and (e.get("involvedObject") or {}).get("kind") == C.KIND
    ]  # (the endpoints controllers' own Warnings about the Service of the same name: loopback pod IPs, see e2e.md)
    assert not warnings, f"Warnings on the happy path: {warnings}"
    old_revision = first["pods"][0]["revision"]

    seen: list[dict[str, Any]] = []
    stop = threading.Event()

    def watch() -> None:  # every status the API serves during the rollout, with the pods as they are then
        while not stop.is_set():
            status = env.lc.status(name)
            pods = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
            seen.append(
                {
                    "status": status,
                    "revisions": {
                        (p["metadata"].get("labels") or {}).get(C.LABEL_CONTROLLER_REVISION_HASH) for p in pods
                    },
                }
            )
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        env.lc.kubectl(
            "patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps({"spec": {"runtime": {"steps": 3}}})
        )
        done = env.wait(
            name,
            lambda s: (
                s.get("observedGeneration") == 2
                and s.get("phase") == C.PHASE_READY
                and all(p.get("revision") != old_revision for p in s.get("pods") or [])
            ),
            "rolled and Ready",
        )

        def claims_ready_now() -> list[dict[str, Any]]:
            return [
                s
                for s in list(seen)
                if s["status"].get("observedGeneration") == 2
                and (
                    s["status"].get("phase") == C.PHASE_READY or cond(s["status"], C.COND_READY).get("status") == "True"
                )
            ]

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
    rolling = [
        s["status"]
        for s in seen
        if s["status"].get("observedGeneration") == 2
        and cond(s["status"], C.COND_PROGRESSING).get("reason") == "RollingOut"
    ]
    assert rolling, "the rollout was never reported as RollingOut"
    assert all(cond(s, C.COND_READY)["status"] == "False" for s in rolling)
    # the new pod refuses connections while it starts: that is a pod starting, not /readyz cut off from the operator
    unknown = [
        s["status"]
        for s in seen
        if cond(s["status"], C.COND_AVAILABLE).get("reason") == "RanksUnknown"
        or any(p.get("ranksKnown") is False for p in s["status"].get("pods") or [])
    ]
    assert not unknown, unknown[0]
    assert "RanksUnknown" not in {e.get("reason") for e in env.lc.api.events(NS, involved_name=name)}
    env.delete(name)


def test_a_crashing_template_reaches_the_progress_deadline_with_the_ranks_error(env: Env) -> None:
    name = "crashy"
    doc = env.doc(name, progressDeadlineSeconds=15)
    doc["spec"]["runtime"]["extraArgs"] = ["--dtype", "bogus"]
    env.apply(doc)
    # the deadline may pass while the pod still imports torch; once the rank has died its error is the detail
    # (before the deadline the phase is already Failed, Progressing CrashLoopBackOff: the next test's subject)
    status = env.wait(
        name,
        lambda s: (
            s.get("phase") == C.PHASE_FAILED
            and cond(s, C.COND_PROGRESSING).get("reason") == "ProgressDeadlineExceeded"
            and "bogus" in cond(s, C.COND_PROGRESSING).get("message", "")
        ),
        "phase Failed after the deadline, with the rank's error",
        timeout=150,
    )
    progressing = cond(status, C.COND_PROGRESSING)
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded"), progressing
    assert "bogus" in progressing["message"] and "server exited" in progressing["message"], progressing["message"]
    assert cond(status, C.COND_READY)["reason"] == "ProgressDeadlineExceeded"
    assert status["checkpoint"]["phase"] == "Ready"  # the download was fine; the pods are not
    env.lc.api.wait_event(NS, name, "Warning", "ProgressDeadlineExceeded")
    env.delete(name)


def server_pods(env: Env, name: str) -> list[dict[str, Any]]:
    return env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")


def test_a_crash_looping_pod_is_failing_at_once_with_the_error_that_killed_it(env: Env) -> None:
    """The default progressDeadlineSeconds (900 s): the phase read Starting (Progressing RollingOut) all that time
    and the pod's message was its last log line, not its error (issue 40 item 12)."""
    name = "crashloop"
    doc = env.doc(name)
    doc["spec"]["runtime"]["extraArgs"] = ["--dtype", "bogus"]
    env.apply(doc)
    status = env.wait(
        name,
        lambda s: s.get("phase") == C.PHASE_FAILED and cond(s, C.COND_PROGRESSING).get("reason") == "CrashLoopBackOff",
        "phase Failed, Progressing CrashLoopBackOff, long before the progress deadline",
    )
    progressing = cond(status, C.COND_PROGRESSING)
    assert progressing["status"] == "True" and "bogus" in progressing["message"], progressing
    assert cond(status, C.COND_READY)["reason"] == "CrashLoopBackOff"
    assert cond(status, C.COND_STALLED)["status"] == "False"  # the kubelet keeps restarting it
    message = status["pods"][0].get("message", "")
    assert message.startswith("crash-looping: server exited") and "bogus" in message, message
    assert "server closed" not in message
    env.lc.api.wait_event(NS, name, "Warning", "CrashLoopBackOff", message="bogus")
    env.delete(name)


def test_a_hung_pod_is_reported_as_not_answering(env: Env) -> None:
    """Every process of a serving pod SIGSTOPped: the kernel still accepts connections on its socket and nothing
    answers.  It read "starting: /readyz unreachable" (issue 40 item 13)."""
    import signal

    from tests.support.local_node_proc import signal_processes

    name = "hung"
    env.apply(env.doc(name))
    env.wait(name, lambda s: s.get("phase") == C.PHASE_READY, "Ready")
    pod = server_pods(env, name)[0]["metadata"]["name"]
    procs = env.lc.node.processes(NS, pod, "server")
    assert procs, f"no process of {pod}"
    signal_processes(procs, signal.SIGSTOP)
    try:
        status = env.wait(
            name,
            lambda s: any(p.get("message", "").startswith("not answering /readyz") for p in s.get("pods") or []),
            "the pod reported as not answering",
            timeout=60,
        )
    finally:
        signal_processes(procs, signal.SIGCONT)
    entry = status["pods"][0]
    assert not entry["ready"] and entry["ranksReady"] == "0/1" and "ranksKnown" not in entry, entry
    assert "starting" not in entry["message"] and cond(status, C.COND_AVAILABLE).get("reason") != "RanksUnknown"
    env.delete(name)


def test_a_latency_budget_shows_the_pods_measured_batch_times_in_status(env: Env) -> None:
    """spec.runtime.batching.latencyBudgetMs: the ready pod's warm-up times reach status.batching, and a budget no
    batch fits caps the batch at 1 (the pods still serve), shown as MAXBATCH by ``kubectl get -o wide``."""
    name = "budgeted"
    doc = env.doc(name)
    doc["spec"]["runtime"]["batching"] = {"maxBatch": 4, "latencyBudgetMs": 0.001}
    env.apply(doc)
    status = env.wait(
        name,
        lambda s: s.get("phase") == C.PHASE_READY and (s.get("batching") or {}).get("bucketsMs"),
        "phase Ready with the measured batch times",
    )
    batching = status["batching"]
    assert batching["maxBatch"] == 1, batching  # no batch runs in a microsecond: a lone request is still served
    assert set(batching["bucketsMs"]) == {"1", "2", "4"}, batching  # every bucket up to maxBatch, measured
    assert all(ms > 0.001 for ms in batching["bucketsMs"].values()), batching
    pods = env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    assert batching["pod"] in {p["metadata"]["name"] for p in pods}, (batching, pods)
    row = table(env.lc.kubectl("get", C.SHORT_NAME, name, "-o", "wide").stdout)[0]
    assert row["MAXBATCH"] == "1", row  # the CRD's printer column, as kubectl prints it
    env.delete(name)


def test_a_gpu_quota_refusal_is_in_status_as_failed_create(env: Env) -> None:
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "no-gpus", "namespace": NS},
        "spec": {"hard": {f"requests.{C.GPU_RESOURCE}": "0"}},
    }
    env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(quota))
    wait_for(
        lambda: ((env.lc.get("v1", "resourcequotas", "no-gpus") or {}).get("status") or {}).get("hard"),
        60,
        what="the quota controller's status of the ResourceQuota",
    )
    name = "quota"
    doc = env.doc(name)
    doc["spec"]["runtime"]["device"] = "cuda"  # one nvidia.com/gpu per pod: more than the quota's 0
    try:
        env.apply(doc)
        status = env.wait(
            name, lambda s: cond(s, C.COND_AVAILABLE).get("reason") == "FailedCreate", "Available=False FailedCreate"
        )
        available = cond(status, C.COND_AVAILABLE)
        assert available["status"] == "False" and "exceeded quota" in available["message"], available
        assert C.GPU_RESOURCE in available["message"]
        assert status["phase"] == C.PHASE_PENDING and cond(status, C.COND_READY)["reason"] == "FailedCreate"
        assert env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}") == []
        env.lc.api.wait_event(NS, name, "Warning", "FailedCreate")

        env.lc.kubectl("delete", "resourcequota", "no-gpus")  # lifted: the pod is created, the refusal leaves status
        status = env.wait(
            name,
            lambda s: (
                cond(s, C.COND_AVAILABLE).get("reason") not in ("FailedCreate", None)
                and env.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
            ),
            "the refusal gone once the pod exists",
        )
        assert "exceeded quota" not in json.dumps(status["conditions"])
    finally:
        env.lc.kubectl("delete", "resourcequota", "no-gpus", "--ignore-not-found")
    env.delete(name)


def test_a_fetch_pod_that_cannot_start_says_why_then_stalls_at_the_deadline(env: Env) -> None:
    """The Job counts a Pending pod as active; status used to read Downloading (attempt 1/4) forever."""
    deadline = 15
    secret = env.doc("nosecret", progressDeadlineSeconds=deadline)
    secret["spec"]["checkpoint"]["secretRef"] = {"name": "no-such-secret"}  # the kubelet cannot mount the token
    nobody = env.doc("noscheduler", progressDeadlineSeconds=deadline)
    nobody["spec"]["schedulerName"] = "no-such-scheduler"  # no condition at all: nothing ever looks at the pod
    noclass = env.doc("noclass", progressDeadlineSeconds=deadline)
    noclass["spec"]["storage"] = {"storageClassName": "no-such-class"}  # the claim never binds
    for doc in (secret, nobody, noclass):
        env.apply(doc)
    try:
        status = env.wait(
            "nosecret",
            lambda s: (
                cond(s, C.COND_CHECKPOINT_READY).get("reason") == "FetchPodNotStarting"
                and "no-such-secret" in cond(s, C.COND_CHECKPOINT_READY)["message"]
            ),
            "CheckpointReady=False FetchPodNotStarting naming the Secret",
        )
        assert 'secret "no-such-secret" not found' in cond(status, C.COND_CHECKPOINT_READY)["message"]
        assert status["phase"] == C.PHASE_PENDING and status["checkpoint"]["phase"] == "Pending"
        assert (cond(status, C.COND_PROGRESSING)["status"], cond(status, C.COND_PROGRESSING)["reason"]) == (
            "True",
            "FetchPodNotStarting",
        )
        env.lc.api.wait_event(NS, "nosecret", "Warning", "FetchPodNotStarting")
        status = env.wait(
            "noclass",
            lambda s: cond(s, C.COND_CHECKPOINT_READY).get("reason") == "Unschedulable",
            "CheckpointReady=False Unschedulable (the claim is not bound)",
        )
        assert "PersistentVolumeClaim" in cond(status, C.COND_CHECKPOINT_READY)["message"], status
        early = env.lc.status("noscheduler")
        assert "no-such-scheduler" in cond(early, C.COND_CHECKPOINT_READY).get("message", ""), early

        # nothing changes for spec.progressDeadlineSeconds: only a change fixes it (kstatus Stalled), said once
        for name, words in (("nosecret", "no-such-secret"), ("noscheduler", "no scheduler has taken it")):
            status = env.wait(
                name,
                lambda s: cond(s, C.COND_STALLED).get("status") == "True",
                f"{name} Stalled past the deadline",
                timeout=deadline + 60,
            )
            progressing = cond(status, C.COND_PROGRESSING)
            assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded"), progressing
            assert words in progressing["message"] and status["phase"] == C.PHASE_FAILED, status
            env.lc.api.wait_event(NS, name, "Warning", "ProgressDeadlineExceeded")
        env.lc.operator.settle()
        warnings = [
            (e.get("reason"), e.get("message"))
            for e in env.lc.api.events(NS, involved_name="nosecret")
            if e.get("type") == "Warning"
        ]
        assert {"FetchPodNotStarting", "ProgressDeadlineExceeded"} <= {r for r, _ in warnings}, warnings
        # the same Warning never twice; a new reason, or a new message (the pod first waits for its claim to
        # bind, then for the Secret, when the scheduler sees the claim unbound), is a change
        assert len(warnings) == len(set(warnings)), f"a Warning per change, not per pass: {warnings}"
    finally:  # stalled PolicyServers left behind would keep the next tests' operator busy
        for name in ("nosecret", "noscheduler", "noclass"):
            env.delete(name)


def test_an_apply_the_apiserver_always_refuses_is_stalled_with_its_message_not_retried(env: Env) -> None:
    """Server-side apply answers 500 "duplicate entries" for a list-map key given twice: the same body gets the
    same answer, so it is ApplyFailed (Stalled) with the API's message, not a silent retry every 5 s."""
    name = "dupspread"
    spread = {
        "maxSkew": 1,
        "topologyKey": "kubernetes.io/hostname",
        "whenUnsatisfiable": "ScheduleAnyway",
        "labelSelector": {"matchLabels": {C.LABEL_INSTANCE: name}},
    }
    env.apply(env.doc(name, topologySpreadConstraints=[spread, {**spread, "maxSkew": 2}]))
    status = env.wait(name, lambda s: cond(s, C.COND_STALLED).get("status") == "True", "Stalled")
    progressing = cond(status, C.COND_PROGRESSING)
    assert (progressing["status"], progressing["reason"]) == ("False", "ApplyFailed"), progressing
    assert "duplicate entries" in progressing["message"] and "StatefulSet" in progressing["message"], progressing
    env.lc.api.wait_event(NS, name, "Warning", "ApplyFailed")
    env.lc.operator.settle()
    assert "transient API error" not in env.lc.operator.log.read_text()
    env.delete(name)


def metric_samples(env: Env, name: str) -> list[tuple[dict[str, str], float]]:
    """One counter of the apiserver's own /metrics, every sample with its labels."""
    from prometheus_client.parser import text_string_to_metric_families

    text = env.lc.kubectl("get", "--raw", "/metrics").stdout
    return [
        (dict(sample.labels), sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == name
    ]


def operator_requests(env: Env) -> float:
    """Requests the apiserver dispatched for ServiceAccounts outside kube-system: API Priority and Fairness' flow
    schema ``service-accounts``.  Only the operator runs as one here (the node and the tests are the admin, the
    controllers kube-system ServiceAccounts), so this is the operator's count, watches included."""
    return sum(
        v
        for labels, v in metric_samples(env, "apiserver_flowcontrol_dispatched_requests_total")
        if labels.get("flow_schema") == "service-accounts"
    )


def operator_as_service_account(env: Env, work: Path) -> OperatorProcess:
    """The operator with a ServiceAccount token and exactly the Role operator/rbac.py asks for (the chart's)."""
    from policy_operator.operator import rbac

    account = "policy-operator"
    role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": {"name": account},
        "rules": rbac.policy_rules(all_namespaces=False),
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": account},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": account},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": NS}],
    }
    env.lc.kubectl("create", "serviceaccount", account)
    for obj in (role, binding):
        env.lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(obj))
    token = env.lc.kubectl("create", "token", account, "--duration=1h").stdout.strip()
    kubeconfig = env.lc.control_plane.kubeconfig_for_token(token, work / "operator-sa.kubeconfig")
    return OperatorProcess(
        {**env.lc.control_plane.env, "KUBECONFIG": str(kubeconfig)},
        NS,
        work / "operator-sa.log",
        resync_s=RESYNC_S,
        probe_timeout_s=0.5,
    )


def test_a_policyserver_at_rest_costs_no_api_request(env: Env, tmp_path: Path) -> None:
    """Every pass used to GET each child (404s for those not there), ask for a StorageClass the Role forbids (403)
    and re-apply the StatefulSet and Services: 2156 requests in these 40 passes before the change.  At rest a pass reads the operator's watches
    and writes nothing.  The operator runs as its own ServiceAccount with the chart's Role, so its requests are
    told apart (APF's flow schema); what it still makes at rest is watch renewals, and its log holds no 403 (the
    apiserver's 403 count is cluster-wide: other clients' refusals moved it by 2 in one run)."""
    name = "atrest"
    env.lc.operator.stop()
    operator = operator_as_service_account(env, tmp_path)
    try:
        operator.start()
        env.apply(env.doc(name))
        env.wait(name, lambda s: s.get("phase") == C.PHASE_READY, "Ready")
        operator.settle(passes=6)  # the last writes of the rollout (status, rank annotations) are done
        before, passes = operator_requests(env), operator.passes()
        wait_for(lambda: operator.passes() >= passes + 40, 120, what="40 passes at rest")
        made = operator_requests(env) - before
        # Watches are not free: the apiserver ends each after WATCH_TIMEOUT_S and the informer reopens it from its
        # resourceVersion (kopf's own watches alike), so a window shorter than that may hold at most one renewal
        # per watch, whatever the passes do.  One request per pass would be 40.
        renewals = len(CACHED_KINDS) + KOPF_WATCHES
        assert made <= renewals, f"{made:g} requests in 40 passes at rest (log: {operator.log})"
        assert env.lc.status(name)["phase"] == C.PHASE_READY
        assert not re.search(r"\b403\b|[Ff]orbidden", operator.log.read_text())
        env.delete(name)
    finally:
        operator.stop()
        env.lc.operator.start()
