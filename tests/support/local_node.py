"""A local node for the Kubernetes API emulator: a kubelet plus the StatefulSet and Job controllers.

``kube_emulator.KubeEmulator`` stores objects and nothing runs them.  The
local node watches the emulator like a kubelet (pods) and a controller
manager (Jobs, StatefulSets, PersistentVolumeClaims) would, for the objects
matching its label selector in its namespaces, and runs each pod's
containers as processes on this machine::

    with KubeEmulator() as kube, LocalNode(kube, ["demo"]) as node:
        kube.kubectl("apply", "-n", "demo", "-f", "policyserver.yaml")   # + the operator
        node.pods("demo")                  # the PodRunners it runs
        node.processes("demo", "ps-0")     # every live process of that pod (torchrun and its ranks)
        node.logs("demo", "ps-0", "server")

What it plays:

* **scheduler + kubelet** (``local_node_pod``): binds each pod to itself
  (``POST pods/NAME/binding``), gives it its own loopback IP (127.0.0.2,
  127.0.0.3, ... as ``status.podIP``: Linux routes all of 127.0.0.0/8 to lo),
  sets up volumes, runs init containers then containers with their env and
  path-mapped volumes (``local_node_proc``), probes (``local_node_probes``),
  restarts, status, graceful deletion.
* **StatefulSet and Job controllers** (``local_node_controllers``).
* **PV provisioner**: a claim is Bound as soon as it exists and is one
  directory on this machine, shared by every pod that mounts it; it is
  removed when the claim is deleted and no pod uses it.

Everything the manifest says about images, resources, scheduling
constraints, security contexts and read-only mounts is ignored; see
docs/e2e.md for that list and for how paths and the pod's address are mapped.
``stop()`` kills every process it started (``shutdown``), whatever state the
API is in.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import logging
import shutil
import sys
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes.client

from policy_operator.constants import LABEL_MANAGED_BY, MANAGED_BY

from . import local_node_controllers as controllers
from .kube_emulator import KubeEmulator, api_path
from .local_node_pod import PodRunner
from .local_node_proc import ProcInfo, kill_tagged, tagged_processes

log = logging.getLogger("local_node")

VENV_BIN = Path(sys.executable).parent
DEFAULT_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"
WATCHED = (("v1", "pods"), ("batch/v1", "jobs"), ("apps/v1", "statefulsets"), ("v1", "persistentvolumeclaims"))
WATCH_TIMEOUT_S = 20


@dataclass(frozen=True)
class NodeEvent:
    """One step in a pod's life as the node saw it (for timings and for failure messages)."""

    t: float
    namespace: str
    pod: str
    container: str | None
    what: str


class LocalNode:
    """Runs the pods, Jobs and StatefulSets matching ``label_selector`` in ``namespaces``; ``start()``/``stop()``."""

    def __init__(
        self,
        kube: KubeEmulator,
        namespaces: Sequence[str],
        *,
        name: str = "local-node",
        root: str | Path | None = None,
        label_selector: str = DEFAULT_SELECTOR,
        first_ip: str = "127.0.0.2",
        host_ip: str = "127.0.0.1",
        backoff_s: float = 10.0,
        backoff_cap_s: float = 300.0,
        resync_s: float = 1.0,
        image_env: Mapping[str, str] | None = None,
    ) -> None:
        if not namespaces:
            raise ValueError("LocalNode needs at least one namespace to watch")
        self.kube = kube
        self.namespaces = list(namespaces)
        self.name = name
        self.node_id = uuid.uuid4().hex[:12]
        self._own_root = root is None
        # short: TMPDIR lives under it, and unix socket paths must stay under 108 bytes
        self.root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="ln-"))
        self.label_selector = label_selector
        self.host_ip = host_ip
        self.backoff_s, self.backoff_cap_s = backoff_s, backoff_cap_s
        self.resync_s = resync_s
        # what an image would provide: its PATH (the venv's scripts: policyserver, torchrun) and ENV lines
        self.base_env = {"PATH": f"{VENV_BIN}:/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8",
                         "PYTHONUNBUFFERED": "1", **(image_env or {})}
        self.errors: list[BaseException] = []
        self.events: list[NodeEvent] = []
        self._next_ip = int(ipaddress.IPv4Address(first_ip))
        self._runners: dict[str, PodRunner] = {}  # by pod uid
        self._claims: dict[tuple[str, str], tuple[str, Path]] = {}  # (ns, claim) -> (claim uid, directory)
        self._wake_at: dict[str, float] = {}
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
        for ns in self.namespaces:
            for gv, plural in WATCHED:
                selector = None if plural == "persistentvolumeclaims" else self.label_selector
                t = threading.Thread(target=self._watch, args=(gv, plural, ns, selector), daemon=True,
                                     name=f"watch:{ns}/{plural}")
                self._threads.append(t)
        self._threads.append(threading.Thread(target=self._loop, name="local-node", daemon=True))
        for t in self._threads:
            t.start()
        return self

    def stop(self, grace_s: float = 3.0) -> None:
        """Stop watching and kill every pod's processes (SIGTERM, SIGKILL after ``grace_s``); no API writes."""
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
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def raise_errors(self) -> None:
        if self.errors:
            raise AssertionError(f"the local node failed: {self.errors!r}") from self.errors[0]

    # --- what tests look at -------------------------------------------------------------------

    def pods(self, namespace: str | None = None) -> list[PodRunner]:
        with self._lock:
            return [r for r in self._runners.values() if namespace is None or r.namespace == namespace]

    def pod(self, namespace: str, name: str) -> PodRunner | None:
        """The newest runner of that pod name (a StatefulSet pod is recreated under the same name)."""
        runners = [r for r in self.pods(namespace) if r.name == name]
        return max(runners, key=lambda r: r.start_time) if runners else None

    def processes(self, namespace: str | None = None, pod: str | None = None,
                  container: str | None = None) -> list[ProcInfo]:
        """Live processes of the node, of one pod's current run, or of one of its containers."""
        if pod is None:
            return tagged_processes(f"{self.node_id}/")
        assert namespace is not None, "processes(pod=...) needs the namespace too"
        runner = self.pod(namespace, pod)
        if runner is None:
            return []
        procs = tagged_processes(runner.tag)
        if container is not None:
            procs = [p for p in procs if p.tag[len(runner.tag):].split("#", 1)[0] == container]
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

    def describe(self, namespace: str | None = None) -> str:
        """Every pod's events and last log lines: what a failing test should print."""
        out = []
        for r in self.pods(namespace):
            out.append(f"--- pod {r.namespace}/{r.name} ({r.ip}) phase={r.phase}")
            out += [f"  {e.t - r.start_time:7.2f}s {e.container or '-'}: {e.what}" for e in self.events
                    if e.namespace == r.namespace and e.pod == r.name and e.t >= r.start_time]
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
        from .local_node_pod import VolumeError

        pvc = self.kube.get("v1", "persistentvolumeclaims", claim, namespace)
        if pvc is None:
            raise VolumeError(f'persistentvolumeclaim "{claim}" not found')
        return self._bind_claim(pvc)

    def _allocate_ip(self) -> str:
        with self._lock:
            used = {r.ip for r in self._runners.values() if not r.deleted.is_set()}
            while True:
                ip = str(ipaddress.IPv4Address(self._next_ip))
                self._next_ip += 1
                if ip not in used and not ip.endswith((".0", ".255")):
                    return ip

    # --- watching --------------------------------------------------------------------------------

    def _watch(self, group_version: str, plural: str, namespace: str, selector: str | None) -> None:
        """Wake the sync loop on every event (level-triggered: the loop reads fresh state)."""
        url = urllib.parse.urlsplit(self.kube.url)
        params = {"watch": "true", "timeoutSeconds": str(WATCH_TIMEOUT_S)}
        if selector:
            params["labelSelector"] = selector
        path = api_path(group_version, plural, namespace=namespace) + "?" + urllib.parse.urlencode(params)
        while not self._stopping.is_set():
            conn = http.client.HTTPConnection(url.hostname, url.port, timeout=WATCH_TIMEOUT_S + 10)
            try:
                conn.request("GET", path, headers={"Accept": "application/json"})
                response = conn.getresponse()
                if response.status != 200:
                    raise OSError(f"watch {path}: HTTP {response.status}")
                while not self._stopping.is_set() and response.readline():
                    self._dirty.set()
            except (OSError, http.client.HTTPException):
                self._stopping.wait(0.5)
            finally:
                conn.close()

    # --- the sync loop ------------------------------------------------------------------------------

    def _loop(self) -> None:
        while not self._stopping.is_set():
            self._dirty.wait(self._next_wait())
            self._dirty.clear()
            if self._stopping.is_set():
                return
            for ns in self.namespaces:
                try:
                    self._sync(ns)
                except (kubernetes.client.ApiException, OSError) as exc:  # the API went away or hiccuped: next pass
                    log.info("local node sync of %s: %s", ns, exc)
                except Exception as exc:  # noqa: BLE001 - a node bug: keep it for the test, keep running
                    log.exception("local node sync of %s failed", ns)
                    self.errors.append(exc)

    def _next_wait(self) -> float:
        now = time.time()
        soonest = min(self._wake_at.values(), default=now + self.resync_s)
        return max(0.05, min(self.resync_s, soonest - now))

    def _sync(self, ns: str) -> None:
        self._sync_claims(ns, self.kube.list("v1", "persistentvolumeclaims", ns))
        pods = self.kube.list("v1", "pods", ns, label_selector=self.label_selector)
        jobs = self.kube.list("batch/v1", "jobs", ns, label_selector=self.label_selector)
        statefulsets = self.kube.list("apps/v1", "statefulsets", ns, label_selector=self.label_selector)
        listed = {f"{plural}/{ns}/{o['metadata']['name']}" for plural, objs in (("jobs", jobs), ("statefulsets", statefulsets))
                  for o in objs}
        for key in [k for k in self._wake_at if k.split("/")[1] == ns and k not in listed]:
            del self._wake_at[key]  # a timer of an object that is gone
        for job in jobs:
            self._sync_job(ns, job, pods)
        for sts in statefulsets:
            self._sync_statefulset(ns, sts, pods)
        self._sync_pods(ns, pods)

    def _apply(self, ns: str, group_version: str, plural: str, owner: Mapping[str, Any], plan: controllers.Plan) -> None:
        for body in plan.create:
            with contextlib.suppress(kubernetes.client.ApiException):  # 409: made by the previous pass
                self.kube.create("v1", "pods", body, ns)
                self._dirty.set()
        for name in plan.delete:
            with contextlib.suppress(kubernetes.client.ApiException):  # 404: already gone
                self.kube.delete("v1", "pods", name, ns)
                self._dirty.set()
        meta = owner["metadata"]
        key = f"{plural}/{ns}/{meta['name']}"
        if plan.wake_at is not None:
            self._wake_at[key] = plan.wake_at
        else:
            self._wake_at.pop(key, None)
        if plan.delete_owner:
            with contextlib.suppress(kubernetes.client.ApiException):
                self.kube.delete(group_version, plural, meta["name"], ns)
            return
        if plan.status is not None and {**(owner.get("status") or {}), **plan.status} != (owner.get("status") or {}):
            with contextlib.suppress(kubernetes.client.ApiException):
                self.kube.patch_status(group_version, plural, meta["name"], plan.status, ns)

    def _sync_job(self, ns: str, job: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        if job["metadata"].get("deletionTimestamp"):
            return
        self._apply(ns, "batch/v1", "jobs", job, controllers.plan_job(job, pods, time.time(), self.backoff))

    def _sync_statefulset(self, ns: str, sts: dict[str, Any], pods: list[dict[str, Any]]) -> None:
        if sts["metadata"].get("deletionTimestamp"):
            return
        self._apply(ns, "apps/v1", "statefulsets", sts, controllers.plan_statefulset(sts, pods))

    def _sync_pods(self, ns: str, pods: list[dict[str, Any]]) -> None:
        present = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod.get("spec") or {}
            uid = meta["uid"]
            present.add(uid)
            if spec.get("nodeName") not in (None, "", self.name):
                continue
            with self._lock:
                runner = self._runners.get(uid)
            if meta.get("deletionTimestamp"):
                if runner is not None:
                    runner.request_delete(meta.get("deletionGracePeriodSeconds"))
                elif spec.get("nodeName") == self.name:  # nothing of it runs here: confirm at once
                    with contextlib.suppress(kubernetes.client.ApiException):
                        self.kube.delete("v1", "pods", meta["name"], ns, grace_period=0)
                continue
            if runner is not None or (pod.get("status") or {}).get("phase") in controllers.TERMINAL_PHASES:
                continue
            if not spec.get("nodeName"):
                try:
                    self.kube.request("POST", api_path("v1", "pods", meta["name"], ns, "binding"),
                                      {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                                       "target": {"apiVersion": "v1", "kind": "Node", "name": self.name}})
                except kubernetes.client.ApiException as exc:
                    log.info("binding %s/%s failed: %s", ns, meta["name"], exc.reason)
                    continue
            runner = PodRunner(self, pod, self._allocate_ip())
            with self._lock:
                self._runners[uid] = runner
            self.record(runner, None, f"scheduled at {runner.ip}")
            runner.start()
        with self._lock:
            gone = [(uid, r) for uid, r in self._runners.items() if uid not in present and r.namespace == ns]
        for uid, runner in gone:
            if runner.deleted.is_set():
                with self._lock:
                    self._runners.pop(uid, None)
            else:  # deleted from the API behind the kubelet's back (force delete): still stop it
                runner.shutdown(float(runner.spec.get("terminationGracePeriodSeconds", 30)))

    def _bind_claim(self, pvc: Mapping[str, Any]) -> Path:
        meta, spec = pvc["metadata"], pvc.get("spec") or {}
        key = (meta["namespace"], meta["name"])
        with self._lock:
            known = self._claims.get(key)
            if known is None or known[0] != meta["uid"]:
                path = self.root / "pvc" / meta["namespace"] / f"{meta['name']}-{meta['uid'][:8]}"
                path.mkdir(parents=True, exist_ok=True)
                self._claims[key] = (meta["uid"], path)
            path = self._claims[key][1]
        if (pvc.get("status") or {}).get("phase") != "Bound":
            capacity = ((spec.get("resources") or {}).get("requests") or {}).get("storage", "1Gi")
            with contextlib.suppress(kubernetes.client.ApiException):
                self.kube.patch_status("v1", "persistentvolumeclaims", meta["name"],
                                       {"phase": "Bound", "accessModes": spec.get("accessModes") or ["ReadWriteOnce"],
                                        "capacity": {"storage": capacity}}, meta["namespace"])
        return path

    def _sync_claims(self, ns: str, pvcs: list[dict[str, Any]]) -> None:
        live = {}
        for pvc in pvcs:
            if not pvc["metadata"].get("deletionTimestamp"):
                self._bind_claim(pvc)
                live[pvc["metadata"]["name"]] = pvc["metadata"]["uid"]
        with self._lock:
            stale = [(k, v) for k, v in self._claims.items() if k[0] == ns and live.get(k[1]) != v[0]]
            in_use = {c for r in self._runners.values() if not r.deleted.is_set() for c in r.claims}
        for key, (_, path) in stale:
            if key not in in_use:  # the claim is gone and no pod mounts it: reclaimPolicy Delete
                shutil.rmtree(path, ignore_errors=True)
                with self._lock:
                    self._claims.pop(key, None)


@contextlib.contextmanager
def local_node(kube: KubeEmulator, namespaces: Sequence[str], **kwargs: Any) -> Iterator[LocalNode]:
    """A started node, stopped (every process killed) on exit; raises the node's own errors after."""
    node = LocalNode(kube, namespaces, **kwargs).start()
    try:
        yield node
    finally:
        node.stop()
    node.raise_errors()
