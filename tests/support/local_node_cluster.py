"""A whole cluster on this machine: the real control plane + the real operator + the local node.

Used by ``tests/test_e2e.py``, ``tests/test_operator_integration.py`` and
``python -m tests.support.demo_cluster``::

    with LocalCluster(control_plane, workdir, namespace="robots") as cluster:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        cluster.kubectl("wait", "--for=condition=Available", "policyserver/NAME", "--timeout=300s")
        cluster.node.processes("robots", "NAME-0")
        cluster.node.service_url("robots", "NAME", "http", scheme="ws")

The control plane (``tests/support/control_plane.py``) is shared: a session
fixture in the tests, a private one in the demo.  A LocalCluster adds what
one test module needs on top: the CRD (applied, idempotent), its namespace,
a local node, and the operator -- ``policyserver operator`` in a subprocess
(its log in ``workdir/operator.log``), talking to the API server through the
admin kubeconfig, exactly as it would to any cluster.  ``stop()`` deletes the
namespace and waits until it is gone (the operator still runs and releases
its finalizers, the node still runs so pods end gracefully and volumes are
released and deleted), then stops the operator and the node: the next
module starts from a clean cluster.

:func:`for_local_node` turns a PolicyServer sample into one this machine can
run (a loopback checkpoint source, CPU device, few steps, a free port).
:func:`phase_timings` says where the time from ``kubectl apply`` to
Available went.
"""

from __future__ import annotations

import contextlib
import copy
import json
import re
import signal
import subprocess
import urllib.request
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes.client

from policy_operator import constants as C
from policy_operator.operator.manifests import FETCH_CONTAINER, SERVER_CONTAINER, VERIFY_CONTAINER, Names

from .local_node import LocalNode, NodeEvent
from .local_node_api import Api
from .local_node_proc import parse_time
from .net import free_port, wait_for
from .servers import VENV_BIN, stop_process

if TYPE_CHECKING:
    from .control_plane import ControlPlane

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "policyservers.yaml"
CRD_NAME = f"{C.PLURAL}.{C.GROUP}"
OPERATOR_START_S = 60.0
NAMESPACE_GONE_S = 180.0


class OperatorProcess:
    """``policyserver operator --namespace NS`` with a liveness endpoint; restartable and killable."""

    def __init__(
        self,
        env: dict[str, str],
        namespace: str,
        log: Path,
        *,
        resync_s: float = 1.0,
        probe_timeout_s: float = 1.0,
        peering: Iterable[str] = ("--standalone",),
        log_format: str = "plain",
    ) -> None:
        self.env, self.namespace, self.log = env, namespace, log
        self.resync_s, self.probe_timeout_s = resync_s, probe_timeout_s
        self.peering, self.log_format = list(peering), log_format
        self.proc: subprocess.Popen[bytes] | None = None
        self.liveness = ""

    def start(self) -> OperatorProcess:
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    str(VENV_BIN / "policyserver"),
                    "operator",
                    "--namespace",
                    self.namespace,
                    *self.peering,
                    "--resync-seconds",
                    str(self.resync_s),
                    "--probe-timeout",
                    str(self.probe_timeout_s),
                    "--liveness",
                    self.liveness,
                    "--log-format",
                    self.log_format,
                ],
                env=self.env,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        wait_for(self.probe, OPERATOR_START_S, what=f"operator liveness (log: {self.log})")
        return self

    def probe(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.poll() is None, f"the operator exited:\n{self.log_tail()}"
        with urllib.request.urlopen(self.liveness, timeout=2) as response:
            return json.loads(response.read())

    def passes(self) -> int:
        return int(self.probe()["reconciler"]["passes"])

    def settle(self, passes: int = 4, timeout: float = 60.0) -> None:
        """Let the resync timer run a few full passes (what "nothing more happens" is measured against)."""
        start = self.passes()
        wait_for(lambda: self.passes() >= start + passes, timeout, what=f"{passes} reconcile passes")

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """SIGTERM (kopf releases what it holds) or SIGKILL (a crash: nothing is released)."""
        if self.proc is None:
            return
        stop_process(self.proc, sig)
        self.proc = None


def install_crd(control_plane: ControlPlane) -> None:
    """``kubectl apply`` the CRD (idempotent) and wait until it is served.

    Polled here rather than by ``kubectl wait --for=condition=Established``: on a CRD created a moment ago
    ``status.conditions`` is still null, and kubectl wait then exits 1 ("accessor error: <nil> is of the type
    <nil>, expected []interface{}") instead of waiting.
    """
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(CRD))

    def established() -> bool:
        crd = json.loads(control_plane.kubectl("get", f"crd/{CRD_NAME}", "-o", "json").stdout)
        return any(
            c.get("type") == "Established" and c.get("status") == "True"
            for c in (crd.get("status") or {}).get("conditions") or []
        )

    wait_for(established, 60, interval=0.2, what=f"CRD {CRD_NAME} Established")


def delete_namespace(
    api: Api, namespace: str, timeout: float = NAMESPACE_GONE_S, *, orphaned_finalizers: Iterable[tuple[str, str]] = ()
) -> None:
    """Delete a namespace and wait (bounded) until the namespace controller has emptied and removed it.

    The namespace controller re-checks a namespace whose pods are still terminating only after their grace
    period, so this takes as long as the slowest pod's shutdown, up to its ``terminationGracePeriodSeconds``.
    ``orphaned_finalizers`` names kinds (group version, plural) whose controller is not running any more (an
    operator the test stopped): their finalizers are cleared once the objects are being deleted, as an admin
    would, or the namespace would never go.
    """
    with contextlib.suppress(kubernetes.client.ApiException):
        api.delete("v1", "namespaces", namespace)

    def gone() -> bool:
        for gv, plural in orphaned_finalizers:
            for obj in api.list(gv, plural, namespace):
                if obj["metadata"].get("deletionTimestamp") and obj["metadata"].get("finalizers"):
                    with contextlib.suppress(kubernetes.client.ApiException):
                        api.patch(gv, plural, obj["metadata"]["name"], {"metadata": {"finalizers": None}}, namespace)
        return api.get("v1", "namespaces", namespace) is None

    wait_for(gone, timeout, interval=0.2, what=f"namespace {namespace} deleted")


class LocalCluster:
    """CRD, namespace, local node and operator on a running control plane; stopped in reverse order."""

    def __init__(
        self,
        control_plane: ControlPlane,
        workdir: str | Path,
        namespace: str,
        *,
        backoff_s: float = 10.0,
        resync_s: float = 1.0,
        gpus: int = 8,
        storage_classes: Iterable[str] = (),
        operator: bool = True,
    ) -> None:
        self.control_plane = control_plane
        self.workdir = Path(workdir)
        self.namespace = namespace
        self.api = Api(control_plane.kubeconfig)
        self.node = LocalNode(
            control_plane.kubeconfig,
            namespaces=[namespace],
            backoff_s=backoff_s,
            gpus=gpus,
            name=f"node-{namespace}",
            storage_classes=list(storage_classes),
        )
        self.operator = OperatorProcess(control_plane.env, namespace, self.workdir / "operator.log", resync_s=resync_s)
        self.run_operator = operator
        self._started: list[str] = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            install_crd(self.control_plane)
            self.control_plane.create_namespace(self.namespace)
            self._started.append("namespace")
            self.node.start()
            self._started.append("node")
            if self.run_operator:
                self.operator.start()
                self._started.append("operator")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """The namespace first, while the operator (it releases its finalizers) and the node (it ends the pods
        gracefully) still run; then the operator; then the node (every process left is killed)."""
        errors: list[BaseException] = []
        if "namespace" in self._started:
            operator_alive = self.operator.proc is not None and self.operator.proc.poll() is None
            try:
                delete_namespace(
                    self.api, self.namespace, orphaned_finalizers=() if operator_alive else [(C.API_VERSION, C.PLURAL)]
                )
            except Exception as exc:  # noqa: BLE001 - stop the rest, then report
                errors.append(exc)
        self.operator.stop()
        if "node" in self._started:
            self.node.stop()
        self._started.clear()
        self.api.close()
        if errors:
            raise errors[0]

    def kubectl(
        self, *args: str, input: str | None = None, timeout: float = 120.0, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        """kubectl as the admin, in this cluster's namespace unless ``args`` name another."""
        ns = (
            []
            if any(a in ("-n", "--namespace", "-A") or a.startswith("--namespace=") for a in args)
            else ["-n", self.namespace]
        )
        return self.control_plane.kubectl(*ns, *args, input=input, timeout=timeout, check=check)

    def get(self, group_version: str, plural: str, name: str) -> dict[str, Any] | None:
        return self.api.get(group_version, plural, name, self.namespace)

    def existing(self, group_version: str, plural: str, name: str) -> dict[str, Any]:
        return self.api.existing(group_version, plural, name, self.namespace)

    def list(self, group_version: str, plural: str, selector: str | None = None) -> list[dict[str, Any]]:
        return self.api.list(group_version, plural, self.namespace, label_selector=selector)

    def status(self, name: str) -> dict[str, Any]:
        return (self.get(C.API_VERSION, C.PLURAL, name) or {}).get("status") or {}

    def wait_status(
        self, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float
    ) -> dict[str, Any]:
        """Poll the PolicyServer's status until ``predicate`` holds; a timeout fails with the last status and
        :meth:`describe`, which is what a reader of a failed cluster test needs first."""
        last: dict[str, Any] = {}

        def check() -> Any:
            nonlocal last
            last = self.status(name)
            return predicate(last)

        try:
            wait_for(check, timeout, interval=0.2, what=what)
        except TimeoutError as exc:
            raise AssertionError(f"{exc}; status: {json.dumps(last, indent=1)[:4000]}\n{self.describe()}") from None
        return last

    def describe(self) -> str:
        """What a failure message needs: operator log tail, pods as the API has them, each pod's node events and
        log tails."""
        pods = []
        for pod in self.list("v1", "pods"):
            status = pod.get("status") or {}
            conds = " ".join(
                f"{c['type']}={c['status']}" + (f"({c.get('message')})" if c.get("message") else "")
                for c in status.get("conditions") or []
            )
            pods.append(
                f"  {pod['metadata']['name']} on {pod['spec'].get('nodeName') or '-'}: {status.get('phase')} {conds}"
            )
        return (
            f"--- operator log (tail)\n{self.operator.log_tail()}\n--- pods in the API\n"
            + "\n".join(pods)
            + f"\n{self.node.describe(self.namespace)}"
        )


def for_local_node(
    doc: dict[str, Any], *, source: str, port: int, steps: int = 2, extra_args: Iterable[str] = ()
) -> dict[str, Any]:
    """A PolicyServer sample made runnable here: ``source`` (a loopback URL), ``device: cpu``, ``steps``, ``port``.

    Everything else (layout, replicas, guidance, secrets, storage, resource requests, tolerations) stays as the
    sample has it: the scheduler fits the requests to the node's allocatable CPU and memory; the local node
    enforces no limit.
    """
    doc = copy.deepcopy(doc)
    spec = doc["spec"]
    spec["checkpoint"]["source"] = source
    spec["checkpoint"].pop("sha256", None)  # the sample's hashes are for the sample's weights
    runtime = spec.setdefault("runtime", {})
    runtime.update(device="cpu", steps=steps)
    if extra_args:
        runtime["extraArgs"] = [*runtime.get("extraArgs", []), *extra_args]
    spec.setdefault("service", {})["port"] = port
    return doc


def free_port_on(hosts: Iterable[str]) -> int:
    """A port that is free on every address in ``hosts`` (pods share the spec's port on their own IPs)."""
    import socket

    hosts = list(hosts)
    for _ in range(50):
        port = free_port()
        try:
            for host in hosts:
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError(f"no port free on all of {hosts}")


# --- where the time goes -----------------------------------------------------------------------

_LINE = re.compile(r"^(\S+Z) (.*)$")
# lines of the server container's log that end a phase: torchrun imported torch and spawns the ranks; every
# rank imported torch and joined the gloo job; rank 0 bound the port; checkpoint loaded and warmed up; ready
LOG_MARKS = (
    ("torchrun spawning ranks", re.compile(r"torch/distributed/run\.py")),
    ("rank 0 joined gloo group", re.compile(r"rank 0/\d+ joined")),
    ("rank 0 listening", re.compile(r"policyserver: listening on")),
    ("replica 0 loaded + warmed up", re.compile(r"replica 0 warmed up")),
    ("policyserver: ready", re.compile(r"policyserver: ready")),
)


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _first(events: list[NodeEvent], pod_prefix: str, container: str | None, what: str) -> float | None:
    return next(
        (e.t for e in events if e.pod.startswith(pod_prefix) and e.container == container and e.what.startswith(what)),
        None,
    )


def _log_marks(text: str) -> dict[str, float]:
    marks: dict[str, float] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        for name, rx in LOG_MARKS:
            if name not in marks and rx.search(m.group(2)):
                t = parse_time(m.group(1))
                if t is not None:
                    marks[name] = t
    return marks


def phase_timings(cluster: LocalCluster, name: str, applied_at: float, available_at: float) -> list[Phase]:
    """Consecutive phases from ``kubectl apply`` to Available, from the node's events and the server's log.

    "on the node" is when the node saw the pod bound to it: the operator's write, the Job or StatefulSet
    controller's pod and the scheduler's binding all happen before it.
    """
    node, ns = cluster.node, cluster.namespace
    events = [e for e in node.events if e.namespace == ns]
    fetch_pod = f"{Names(name).policyserver}-fetch-"
    server_pod = f"{Names(name).statefulset}-0"
    points = [
        ("kubectl apply", applied_at),
        ("fetch pod on the node", _first(events, fetch_pod, None, "admitted")),
        ("fetch started", _first(events, fetch_pod, FETCH_CONTAINER, "started")),
        ("fetch done", _first(events, fetch_pod, FETCH_CONTAINER, "exited 0")),
        ("server pod on the node", _first(events, server_pod, None, "admitted")),
        ("verify done", _first(events, server_pod, VERIFY_CONTAINER, "exited 0")),
        ("torchrun started", _first(events, server_pod, SERVER_CONTAINER, "started")),
    ]
    marks = _log_marks(node.logs(ns, server_pod, SERVER_CONTAINER, run=0, timestamps=True))
    points += [(k, marks.get(k)) for k, _ in LOG_MARKS]
    points.append(("Available", available_at))
    known = [(label, t) for label, t in points if t is not None]
    return [Phase(f"{a} -> {b}", ta, tb) for (a, ta), (b, tb) in zip(known, known[1:], strict=False)]


def format_timings(phases: list[Phase]) -> str:
    total = phases[-1].end - phases[0].start if phases else 0.0
    width = max([len(p.name) for p in phases] + [34])
    rows = [f"  {p.name:<{width}} {p.seconds:6.2f} s" for p in phases]
    return "\n".join(rows + [f"  {'total: kubectl apply -> Available':<{width}} {total:6.2f} s"])
