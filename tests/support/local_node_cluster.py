"""A whole cluster on this machine: API emulator + the real operator + the local node.

Used by ``tests/test_e2e.py`` and ``python -m tests.support.demo_cluster``::

    with LocalCluster(workdir, namespace="robots") as cluster:
        cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        cluster.kubectl("wait", "--for=condition=Available", "policyserver/NAME", "--timeout=300s")
        cluster.node.processes("robots", "NAME-0")

The operator is ``policyserver operator`` in a subprocess (its log in
``workdir/operator.log``), talking HTTP to the emulator through a kubeconfig,
exactly as it would to a cluster; the node runs what it creates.
:func:`for_local_node` turns a PolicyServer sample into one this machine can
run (a loopback checkpoint source, CPU device, few steps, a free port).
:func:`phase_timings` says where the time from ``kubectl apply`` to
Available went.
"""

from __future__ import annotations

import copy
import json
import re
import subprocess
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_operator import constants as C
from policy_operator.operator.manifests import FETCH_CONTAINER, SERVER_CONTAINER, VERIFY_CONTAINER, Names

from .kube_emulator import KubeEmulator
from .local_node import LocalNode, NodeEvent
from .net import free_port, wait_for
from .servers import VENV_BIN, stop_process

REPO = Path(__file__).resolve().parents[2]
CRD = REPO / "crds" / "policyservers.yaml"
OPERATOR_START_S = 60.0


class OperatorProcess:
    """``policyserver operator --namespace NS --standalone`` against the emulator, with a liveness endpoint."""

    def __init__(self, kube: KubeEmulator, namespace: str, log: Path, *, resync_s: float = 1.0,
                 probe_timeout_s: float = 1.0) -> None:
        self.kube, self.namespace, self.log = kube, namespace, log
        self.resync_s, self.probe_timeout_s = resync_s, probe_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.liveness = ""

    def start(self) -> OperatorProcess:
        self.liveness = f"http://127.0.0.1:{free_port()}/healthz"
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [str(VENV_BIN / "policyserver"), "operator", "--namespace", self.namespace, "--standalone",
                 "--resync-seconds", str(self.resync_s), "--probe-timeout", str(self.probe_timeout_s),
                 "--liveness", self.liveness, "--log-format", "plain"],
                env=self.kube.env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                start_new_session=True)
        wait_for(self.probe, OPERATOR_START_S, what=f"operator liveness (log: {self.log})")
        return self

    def probe(self) -> dict[str, Any]:
        assert self.proc is not None and self.proc.poll() is None, f"the operator exited:\n{self.log_tail()}"
        with urllib.request.urlopen(self.liveness, timeout=2) as response:
            return json.loads(response.read())

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc is None:
            return
        stop_process(self.proc)
        self.proc = None


class LocalCluster:
    """Emulator, CRD, namespace, operator and local node, started in that order and stopped in reverse."""

    def __init__(self, workdir: str | Path, namespace: str, *, backoff_s: float = 10.0, resync_s: float = 1.0) -> None:
        self.workdir = Path(workdir)
        self.namespace = namespace
        self.kube = KubeEmulator(self.workdir / "kube")
        self.operator = OperatorProcess(self.kube, namespace, self.workdir / "operator.log", resync_s=resync_s)
        self.node = LocalNode(self.kube, [namespace], backoff_s=backoff_s)
        self._started: list[Any] = []

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalCluster:
        self.workdir.mkdir(parents=True, exist_ok=True)
        try:
            self.kube.start()
            self._started.append(self.kube)
            self.kube.apply_crd(CRD)
            self.kube.create_namespace(self.namespace)
            self.node.start()
            self._started.append(self.node)
            self.operator.start()
            self._started.append(self.operator)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Operator first (it would recreate what the node kills), then every pod's processes, then the API."""
        for part in reversed(self._started):
            part.stop()
        self._started.clear()

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120.0,
                check: bool = True) -> subprocess.CompletedProcess[str]:
        """kubectl against the emulator, in this cluster's namespace unless ``args`` name another."""
        ns = [] if any(a in ("-n", "--namespace", "-A") or a.startswith("--namespace=") for a in args) \
            else ["-n", self.namespace]
        return self.kube.kubectl(*ns, *args, input=input, timeout=timeout, check=check)

    def status(self, name: str) -> dict[str, Any]:
        obj = self.kube.get(C.API_VERSION, C.PLURAL, name, self.namespace)
        return (obj or {}).get("status") or {}

    def describe(self) -> str:
        """What a failure message needs: operator log tail, then each pod's node events and log tails."""
        return f"--- operator log (tail)\n{self.operator.log_tail()}\n{self.node.describe(self.namespace)}"


def for_local_node(doc: dict[str, Any], *, source: str, port: int, steps: int = 2,
                   extra_args: Iterable[str] = ()) -> dict[str, Any]:
    """A PolicyServer sample made runnable here: ``source`` (a loopback URL), ``device: cpu``, ``steps``, ``port``.

    Everything else (layout, replicas, guidance, secrets, storage) stays as the sample has it; the local node
    ignores what cannot apply on one machine (resources, tolerations, storage classes).
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
LOG_MARKS = (("torchrun spawning ranks", re.compile(r"torch/distributed/run\.py")),
             ("rank 0 joined gloo group", re.compile(r"rank 0/\d+ joined")),
             ("rank 0 listening", re.compile(r"policyserver: listening on")),
             ("replica 0 loaded + warmed up", re.compile(r"replica 0 warmed up")),
             ("policyserver: ready", re.compile(r"policyserver: ready")))


@dataclass(frozen=True)
class Phase:
    name: str
    start: float
    end: float

    @property
    def seconds(self) -> float:
        return self.end - self.start


def _first(events: list[NodeEvent], pod_prefix: str, container: str | None, what: str) -> float | None:
    return next((e.t for e in events if e.pod.startswith(pod_prefix) and e.container == container
                 and e.what.startswith(what)), None)


def _log_marks(text: str) -> dict[str, float]:
    from .local_node_controllers import parse_time

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
    """Consecutive phases from ``kubectl apply`` to Available, from the node's events and the server's log."""
    node, ns = cluster.node, cluster.namespace
    events = [e for e in node.events if e.namespace == ns]
    fetch_pod = f"{Names(name).policyserver}-fetch-"
    server_pod = f"{Names(name).statefulset}-0"
    points = [("kubectl apply", applied_at),
              ("fetch pod scheduled", _first(events, fetch_pod, None, "scheduled")),
              ("fetch started", _first(events, fetch_pod, FETCH_CONTAINER, "started")),
              ("fetch done", _first(events, fetch_pod, FETCH_CONTAINER, "exited 0")),
              ("server pod scheduled", _first(events, server_pod, None, "scheduled")),
              ("verify done", _first(events, server_pod, VERIFY_CONTAINER, "exited 0")),
              ("torchrun started", _first(events, server_pod, SERVER_CONTAINER, "started"))]
    marks = _log_marks(node.logs(ns, server_pod, SERVER_CONTAINER, run=0, timestamps=True))
    points += [(k, marks.get(k)) for k, _ in LOG_MARKS]
    points.append(("Available", available_at))
    known = [(label, t) for label, t in points if t is not None]
    return [Phase(f"{a} -> {b}", ta, tb) for (a, ta), (b, tb) in zip(known, known[1:])]


def format_timings(phases: list[Phase]) -> str:
    total = phases[-1].end - phases[0].start if phases else 0.0
    width = max([len(p.name) for p in phases] + [34])
    rows = [f"  {p.name:<{width}} {p.seconds:6.2f} s" for p in phases]
    return "\n".join(rows + [f"  {'total: kubectl apply -> Available':<{width}} {total:6.2f} s"])
