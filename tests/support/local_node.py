"""A local node for the real control plane: the kubelet, plus a Service proxy and a volume provisioner.

The control plane (``tests/support/control_plane.py``: etcd, kube-apiserver,
kube-controller-manager, kube-scheduler) has every controller but no node.
``LocalNode`` registers one and runs the pods the real scheduler binds to it
as processes on this machine::

    with ControlPlane(tmp) as cp, LocalNode(cp.kubeconfig, namespaces=["demo"]) as node:
        cp.kubectl("apply", "-n", "demo", "-f", "policyserver.yaml")   # + the operator
        node.pods("demo")                  # the PodRunners it runs
        node.processes("demo", "ps-0")     # every live process of that pod (torchrun and its ranks)
        node.logs("demo", "ps-0", "server")
        node.service_url("demo", "ps", "http", scheme="ws")   # ws://127.0.0.1:PORT, through the proxy

What it plays:

* **kubelet** (``local_node_pod``): registers the Node (capacity and
  allocatable: ``nvidia.com/gpu`` (``gpus``, default 8), CPU, memory, pods;
  Ready, addresses, node info) and renews its Lease in ``kube-node-lease``
  every 10 s, so the node-lifecycle controller keeps it Ready and untainted.
  It watches the pods bound to it (``spec.nodeName``), gives each its own
  loopback IP (``status.podIP`` = 127.x.y.z: Linux routes all of
  127.0.0.0/8 to lo), sets up volumes, runs init containers then containers
  with their env and path-mapped volumes (``local_node_proc``), probes
  (``local_node_probes``), restarts, writes status through the status
  subresource, and finishes graceful deletions (DELETE with grace 0 and the
  pod's uid as precondition) as a kubelet does.
* **kube-proxy** (``local_node_proxy``): a 127.0.0.1 port per Service port of
  the namespaces it serves, forwarding to ready endpoints.
* **a storage provisioner** (``local_node_storage``): the default
  StorageClass ``local-node`` and a ``local`` PersistentVolume (one directory)
  per claim of that class; released volumes are deleted.

The real controllers do the rest: the StatefulSet, Job, garbage-collector,
PV/PVC-protection and namespace controllers, and the scheduler, which fits
pods to the Node's allocatable resources (a pod asking for more GPUs than
``gpus`` stays Pending, Unschedulable).

Everything the manifest says about images, security contexts, resource
*limits* and read-only mounts is ignored; see docs/e2e.md for that list and
for how paths and the pod's address are mapped.  ``stop()`` kills every
process it started (``shutdown``), then deregisters the Node, whatever state
the API is in.
"""

from __future__ import annotations

import contextlib
import datetime
import ipaddress
import logging
import platform
import random
import shutil
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes.client
import urllib3.exceptions

from .local_node_api import Api
from .local_node_pod import PodRunner
from .local_node_proc import ProcInfo, kill_tagged, rfc3339, tagged_processes
from .local_node_proxy import ServicePort, ServiceProxy
from .local_node_storage import LABEL_HOSTNAME, Provisioner, VolumeError

log = logging.getLogger("local_node")

VENV_BIN = Path(sys.executable).parent
GPU_RESOURCE = "nvidia.com/gpu"
LEASE_NAMESPACE = "kube-node-lease"
LEASE_DURATION_S = 40  # the kubelet's default
LEASE_RENEW_S = 10.0  # the kubelet renews at a quarter of the duration
WATCH_TIMEOUT_S = 20
TERMINAL_PHASES = ("Succeeded", "Failed")
API_ERRORS = (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError)
# what the API server's watch and list calls go through: (group version, plural, scoped to the node's namespaces)
WATCHED = (("v1", "pods"), ("v1", "services"), ("v1", "persistentvolumeclaims"), ("v1", "persistentvolumes"))


@dataclass(frozen=True)
class NodeEvent:
    """One step in a pod's life as the node saw it (for timings and for failure messages)."""

    t: float
    namespace: str
    pod: str
    container: str | None
    what: str


def _now_micro() -> str:
    """metav1.MicroTime, as a Lease's renewTime wants it."""
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LocalNode:
    """Registers Node ``name``, runs the pods bound to it, proxies Services of ``namespaces``; ``start()``/``stop()``."""

    def __init__(
        self,
        kubeconfig: str | Path,
        *,
        namespaces: Sequence[str] | None = None,
        name: str = "local-node",
        gpus: int = 8,
        cpu: str = "64",
        memory: str = "512Gi",
        max_pods: int = 110,
        root: str | Path | None = None,
        first_ip: str | None = None,
        host_ip: str = "127.0.0.1",
        backoff_s: float = 10.0,
        backoff_cap_s: float = 300.0,
        resync_s: float = 1.0,
        image_env: Mapping[str, str] | None = None,
        storage_classes: Sequence[str] = (),
    ) -> None:
        self.api = Api(kubeconfig)
        self.namespaces = list(namespaces) if namespaces is not None else None  # None: the proxy serves every one
        self.name = name
        self.capacity = {
            "cpu": cpu,
            "memory": memory,
            "pods": str(max_pods),
            "ephemeral-storage": "1Ti",
            GPU_RESOURCE: str(gpus),
        }
        self.node_id = uuid.uuid4().hex[:12]
        self._own_root = root is None
        # short: TMPDIR lives under it, and unix socket paths must stay under 108 bytes
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="ln-"))
        self.host_ip = host_ip
        self.backoff_s, self.backoff_cap_s = backoff_s, backoff_cap_s
        self.resync_s = resync_s
        # what an image would provide: its PATH (the venv's scripts: policyserver, torchrun) and ENV lines
        self.base_env = {
            "PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            **(image_env or {}),
        }
        self.errors: list[BaseException] = []
        self.events: list[NodeEvent] = []
        # pods get 127.A.B.2, .3, ... in a /24 of their own, so two nodes (two test runs) rarely meet
        if first_ip is None:
            first_ip = f"127.{random.randint(16, 254)}.{random.randint(0, 255)}.2"
        self.first_ip = first_ip
        self._next_ip = int(ipaddress.IPv4Address(first_ip))
        self.proxy = ServiceProxy(host_ip)
        self.storage = Provisioner(self.api, name, self.root, extra_classes=storage_classes)
        self._runners: dict[str, PodRunner] = {}  # by pod uid
        self._lock = threading.RLock()
        self._dirty = threading.Event()
        self._stopping = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- lifecycle ----------------------------------------------------------------------------

    def __enter__(self) -> LocalNode:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> LocalNode:
        if self._threads:
            raise RuntimeError("this LocalNode was already started")
        self.storage.ensure_storage_class()
        self._register()
        self._renew_lease()
        self.proxy.start()
        for gv, plural in WATCHED:
            self._threads.append(
                threading.Thread(target=self._watch, args=(gv, plural), daemon=True, name=f"watch:{plural}")
            )
        self._threads.append(threading.Thread(target=self._heartbeat, name="local-node-lease", daemon=True))
        self._threads.append(threading.Thread(target=self._loop, name="local-node", daemon=True))
        for t in self._threads:
            t.start()
        self._wait_schedulable()
        return self

    def _wait_schedulable(self, timeout: float = 60.0) -> None:
        """Until the node-lifecycle controller lifts the ``not-ready`` taint that admission puts on every new Node.

        (The TaintNodesByCondition admission plugin taints a Node at creation; the controller removes the taint
        once it has seen the Ready condition, within its 5 s monitor period.)  Pods created before then would
        wait in the scheduler's queue; waiting here makes ``start()`` mean "pods can land now".
        """
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            node = self.api.get("v1", "nodes", self.name) or {}
            if node and not (node.get("spec") or {}).get("taints"):
                return
            time.sleep(0.2)
        raise TimeoutError(f"Node {self.name} still tainted after {timeout:.0f}s: {node.get('spec')}")

    def stop(self, grace_s: float = 3.0, *, deregister: bool = True) -> None:
        """Stop syncing, kill every pod's processes (SIGTERM, SIGKILL after ``grace_s``), then delete the Node.

        No pod status is written: as when a machine goes away, the pods stay in the API until the pod
        garbage collector removes those of a Node that is gone.
        """
        self._stopping.set()
        self._dirty.set()
        for t in self._threads:
            if t.name == "local-node":
                t.join(timeout=30)
        with self._lock:
            runners = list(self._runners.values())
        for r in runners:
            r.shutdown(grace_s)
        for r in runners:
            r.join(timeout=grace_s + 20)
        left = kill_tagged(f"{self.node_id}/")
        if left:
            self.errors.append(RuntimeError(f"processes survived the local node's shutdown: {left}"))
        self.proxy.stop()
        if deregister:
            for gv, plural, ns in (("coordination.k8s.io/v1", "leases", LEASE_NAMESPACE), ("v1", "nodes", None)):
                with contextlib.suppress(*API_ERRORS):
                    self.api.delete(gv, plural, self.name, ns)
        self.api.close()
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def raise_errors(self) -> None:
        if self.errors:
            raise AssertionError(f"the local node failed: {self.errors!r}") from self.errors[0]

    # --- what tests look at -------------------------------------------------------------------

    def ips(self, count: int) -> list[str]:
        """The first ``count`` pod IPs this node hands out (to pick a port free on all of them)."""
        first = int(ipaddress.IPv4Address(self.first_ip))
        return [str(ipaddress.IPv4Address(first + i)) for i in range(count)]

    def pods(self, namespace: str | None = None) -> list[PodRunner]:
        with self._lock:
            return [r for r in self._runners.values() if namespace is None or r.namespace == namespace]

    def pod(self, namespace: str, name: str) -> PodRunner | None:
        """The newest runner of that pod name (a StatefulSet pod is recreated under the same name)."""
        runners = [r for r in self.pods(namespace) if r.name == name]
        return max(runners, key=lambda r: r.start_time) if runners else None

    def runner(self, namespace: str, name: str) -> PodRunner:
        """``pod``, for a pod the caller expects this node to run (an AssertionError naming it when it does not)."""
        runner = self.pod(namespace, name)
        assert runner is not None, f"the node runs no pod {namespace}/{name}"
        return runner

    def processes(
        self, namespace: str | None = None, pod: str | None = None, container: str | None = None
    ) -> list[ProcInfo]:
        """Live processes of the node, of one pod's current run, or of one of its containers."""
        if pod is None:
            procs = tagged_processes(f"{self.node_id}/")
            if namespace is None:
                return procs
            tags = {r.tag for r in self.pods(namespace)}
            return [p for p in procs if any(p.tag.startswith(t) for t in tags)]
        assert namespace is not None, "processes(pod=...) needs the namespace too"
        runner = self.pod(namespace, pod)
        if runner is None:
            return []
        procs = tagged_processes(runner.tag)
        if container is not None:
            procs = [p for p in procs if p.tag[len(runner.tag) :].split("#", 1)[0] == container]
        return procs

    def logs(self, namespace: str, pod: str, container: str, *, run: int = -1, timestamps: bool = False) -> str:
        """A container's log (``run=-1``: the current run, ``-2``: the previous one, like ``--previous``)."""
        runner = self.pod(namespace, pod)
        if runner is None:
            return ""
        files = sorted((runner.log_dir / container).glob("[0-9]*.log"), key=lambda p: int(p.stem))
        try:
            text = files[run].read_text(errors="replace")
        except (IndexError, OSError):
            return ""
        if timestamps:
            return text
        return "\n".join(line.split(" ", 1)[1] if " " in line else "" for line in text.splitlines())

    def service_address(
        self, namespace: str, service: str, port: int | str | None = None, timeout: float = 30.0
    ) -> tuple[str, int]:
        """(host, port) of a Service port on this machine, waiting (bounded) for the proxy to open it."""
        deadline = time.monotonic() + timeout
        while True:
            found = self.proxy.address(namespace, service, port)
            if found is not None:
                return found
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"the node's proxy serves no port {port!r} of Service {namespace}/{service} "
                    f"after {timeout:.0f}s (namespaces served: {self.namespaces or 'all'})"
                )
            self._dirty.set()
            time.sleep(0.1)

    def service_url(
        self,
        namespace: str,
        service: str,
        port: int | str | None = None,
        *,
        scheme: str = "http",
        timeout: float = 30.0,
    ) -> str:
        """``scheme://127.0.0.1:PORT`` reaching the Service port (by name or number) through the node's proxy."""
        host, host_port = self.service_address(namespace, service, port, timeout)
        return f"{scheme}://{host}:{host_port}"

    def describe(self, namespace: str | None = None) -> str:
        """Every pod's events and last log lines: what a failing test should print."""
        out = []
        for r in self.pods(namespace):
            out.append(f"--- pod {r.namespace}/{r.name} ({r.ip}) phase={r.phase}")
            out += [
                f"  {e.t - r.start_time:7.2f}s {e.container or '-'}: {e.what}"
                for e in self.events
                if e.namespace == r.namespace and e.pod == r.name and e.t >= r.start_time
            ]
            for c in r.containers:
                tail = self.logs(r.namespace, r.name, c.name).splitlines()[-15:]
                out += [f"  [{c.name}] {line}" for line in tail]
        return "\n".join(out)

    # --- used by the pod runners -------------------------------------------------------------

    def backoff(self, restarts: int) -> float:
        """The kubelet's crash-loop backoff: base, doubling, capped."""
        return min(self.backoff_cap_s, self.backoff_s * 2 ** max(0, restarts - 1))

    def record(self, runner: PodRunner, container: str | None, what: str) -> None:
        self.events.append(NodeEvent(time.time(), runner.namespace, runner.name, container, what))
        log.debug("%s/%s %s: %s", runner.namespace, runner.name, container or "-", what)

    def claim_dir(self, namespace: str, claim: str) -> Path:
        """The directory of a bound claim; the volume error the kubelet would report if there is none."""
        return self.storage.path(namespace, claim)

    def _allocate_ip(self) -> str:
        with self._lock:
            used = {r.ip for r in self._runners.values() if not r.deleted.is_set()}
            while True:
                ip = str(ipaddress.IPv4Address(self._next_ip))
                self._next_ip += 1
                if ip not in used and not ip.endswith((".0", ".255")):
                    return ip

    # --- the Node and its Lease ---------------------------------------------------------------------

    def _node(self) -> dict[str, Any]:
        now = rfc3339(time.time())
        version = self.api.dynamic.version.get("kubernetes", {}).get("gitVersion", "v0.0.0")

        def condition(kind: str, ok: bool, reason: str, message: str) -> dict[str, Any]:
            return {
                "type": kind,
                "status": "True" if ok else "False",
                "reason": reason,
                "message": message,
                "lastHeartbeatTime": now,
                "lastTransitionTime": now,
            }

        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        return {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": self.name,
                "labels": {
                    LABEL_HOSTNAME: self.name,
                    "kubernetes.io/os": "linux",
                    "kubernetes.io/arch": arch,
                    "beta.kubernetes.io/os": "linux",
                    "beta.kubernetes.io/arch": arch,
                },
            },
            "spec": {},
            "status": {
                "capacity": dict(self.capacity),
                "allocatable": dict(self.capacity),
                "conditions": [
                    condition(
                        "MemoryPressure", False, "KubeletHasSufficientMemory", "kubelet has sufficient memory available"
                    ),
                    condition("DiskPressure", False, "KubeletHasNoDiskPressure", "kubelet has no disk pressure"),
                    condition("PIDPressure", False, "KubeletHasSufficientPID", "kubelet has sufficient PID available"),
                    condition("Ready", True, "KubeletReady", "kubelet is posting ready status (local node)"),
                ],
                "addresses": [
                    {"type": "InternalIP", "address": self.host_ip},
                    {"type": "Hostname", "address": self.name},
                ],
                "daemonEndpoints": {"kubeletEndpoint": {"Port": 0}},  # no kubelet API: kubectl logs/exec do not work
                "nodeInfo": {
                    "machineID": self.node_id,
                    "systemUUID": self.node_id,
                    "bootID": self.node_id,
                    "kernelVersion": platform.release(),
                    "osImage": "local node (pods are host processes)",
                    "containerRuntimeVersion": "local-node://0",
                    "kubeletVersion": version,
                    "kubeProxyVersion": "",
                    "operatingSystem": "linux",
                    "architecture": arch,
                },
            },
        }

    def _register(self) -> None:
        """Create the Node (status included, as the kubelet does); an existing one of that name is taken over."""
        body = self._node()
        try:
            self.api.create("v1", "nodes", body)
        except kubernetes.client.ApiException as exc:
            if exc.status != 409:
                raise
            self.api.patch_status("v1", "nodes", self.name, body["status"])

    def _renew_lease(self) -> None:
        spec = {"holderIdentity": self.name, "leaseDurationSeconds": LEASE_DURATION_S, "renewTime": _now_micro()}
        try:
            self.api.patch("coordination.k8s.io/v1", "leases", self.name, {"spec": spec}, LEASE_NAMESPACE)
        except kubernetes.client.ApiException as exc:
            if exc.status != 404:
                raise
            node = self.api.get("v1", "nodes", self.name)
            owner = (
                [{"apiVersion": "v1", "kind": "Node", "name": self.name, "uid": node["metadata"]["uid"]}]
                if node
                else []
            )
            self.api.create(
                "coordination.k8s.io/v1",
                "leases",
                {"metadata": {"name": self.name, "ownerReferences": owner}, "spec": spec},
                LEASE_NAMESPACE,
            )

    def _heartbeat(self) -> None:
        while not self._stopping.wait(LEASE_RENEW_S):
            try:
                if self.api.get("v1", "nodes", self.name) is None:  # deleted behind our back: register again
                    self._register()
                self._renew_lease()
            except API_ERRORS as exc:
                log.info("local node heartbeat: %s", exc)

    # --- watching --------------------------------------------------------------------------------

    def _watch(self, group_version: str, plural: str) -> None:
        """Wake the sync loop on every event (level-triggered: the loop reads fresh state)."""
        while not self._stopping.is_set():
            try:
                for _ in self.api.watch(group_version, plural, timeout_s=WATCH_TIMEOUT_S):
                    self._dirty.set()
                    if self._stopping.is_set():
                        return
            except Exception:  # noqa: BLE001 - the API went away, or 410 Gone: watch again
                self._stopping.wait(0.5)

    # --- the sync loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._dirty.wait(self.resync_s)
            self._dirty.clear()
            if self._stopping.is_set():
                return
            try:
                self._sync()
            except API_ERRORS as exc:  # the API went away or hiccuped: next pass
                log.info("local node sync: %s", exc)
            except Exception as exc:  # noqa: BLE001 - a node bug: keep it for the test, keep running
                log.exception("local node sync failed")
                self.errors.append(exc)

    def _sync(self) -> None:
        pods = self.api.list("v1", "pods")
        self.storage.sync(self.api.list("v1", "persistentvolumeclaims"), self.api.list("v1", "persistentvolumes"))
        self._sync_pods([p for p in pods if (p.get("spec") or {}).get("nodeName") == self.name])
        services = [
            s
            for s in self.api.list("v1", "services")
            if self.namespaces is None or s["metadata"]["namespace"] in self.namespaces
        ]
        self.proxy.update(service_endpoints(services, pods))

    def _sync_pods(self, pods: list[dict[str, Any]]) -> None:
        present = set()
        for pod in pods:
            meta = pod["metadata"]
            uid = meta["uid"]
            present.add(uid)
            with self._lock:
                runner = self._runners.get(uid)
            if meta.get("deletionTimestamp"):
                if runner is not None:
                    runner.request_delete(meta.get("deletionGracePeriodSeconds"))
                else:  # nothing of it runs here: confirm at once
                    with contextlib.suppress(*API_ERRORS):
                        self.api.delete("v1", "pods", meta["name"], meta["namespace"], grace_period=0, uid=uid)
                continue
            if runner is not None:
                continue
            if (pod.get("status") or {}).get("phase") in TERMINAL_PHASES:
                continue
            runner = PodRunner(self, pod, self._allocate_ip())
            with self._lock:
                self._runners[uid] = runner
            self.record(runner, None, f"admitted at {runner.ip}")
            runner.start()
        with self._lock:
            gone = [(uid, r) for uid, r in self._runners.items() if uid not in present]
        for uid, runner in gone:
            if runner.deleted.is_set():
                with self._lock:
                    self._runners.pop(uid, None)
            else:  # deleted from the API behind the kubelet's back (force delete): still stop it
                runner.shutdown(float(runner.spec.get("terminationGracePeriodSeconds", 30)))


# --- Service endpoints ------------------------------------------------------------------------------


def _matches(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


def _ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status") or {}
    return (
        not (pod.get("metadata") or {}).get("deletionTimestamp")
        and bool(status.get("podIP"))
        and any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    )


def _target_port(pod: Mapping[str, Any], target: int | str) -> int | None:
    if isinstance(target, int) or str(target).isdigit():
        return int(target)
    for container in (pod.get("spec") or {}).get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target:
                return int(port["containerPort"])
    return None


def service_endpoints(
    services: list[dict[str, Any]], pods: list[dict[str, Any]]
) -> dict[ServicePort, list[tuple[str, int]]]:
    """Every TCP port of every selector Service with a ClusterIP -> its ready endpoints (pod IP, target port).

    This is what the endpoint-slice controller writes and kube-proxy reads, computed here from the pods
    because the API refuses EndpointSlices whose addresses are loopback (validation: "may not be in the
    loopback range"), and on this machine every pod address is a loopback one: the real controller's
    slices for these pods never get written.  Ready means what it means there: the pod's Ready
    condition is True (as the node reports it) and the pod is not terminating.
    """
    wanted: dict[ServicePort, list[tuple[str, int]]] = {}
    for svc in services:
        meta, spec = svc["metadata"], svc.get("spec") or {}
        selector = spec.get("selector") or {}
        if not selector or spec.get("clusterIP") in (None, "", "None") or spec.get("type") == "ExternalName":
            continue  # headless, selector-less and ExternalName Services get no proxy, as with kube-proxy
        members = [
            p
            for p in pods
            if p["metadata"]["namespace"] == meta["namespace"]
            and _matches(selector, p["metadata"].get("labels") or {})
            and _ready(p)
        ]
        for port in spec.get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                continue
            key = ServicePort(meta["namespace"], meta["name"], port.get("name") or "", int(port["port"]))
            target = port.get("targetPort", port["port"])
            wanted[key] = sorted(
                {(p["status"]["podIP"], t) for p in members if (t := _target_port(p, target)) is not None}
            )
    return wanted


@contextlib.contextmanager
def local_node(kubeconfig: str | Path, **kwargs: Any) -> Iterator[LocalNode]:
    """A started node, stopped (every process killed, Node deleted) on exit; raises the node's own errors after."""
    node = LocalNode(kubeconfig, **kwargs).start()
    try:
        yield node
    finally:
        node.stop()
    node.raise_errors()


__all__ = ["LocalNode", "NodeEvent", "VolumeError", "local_node", "service_endpoints"]
