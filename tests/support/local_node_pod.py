"""One pod on the local node: volumes, init containers, containers, probes, status, termination.

A :class:`PodRunner` thread is the kubelet's pod worker for one pod: it sets
up the volumes (emptyDir: a per-pod directory; persistentVolumeClaim: the
directory of the claim's bound volume, shared by every pod that mounts it;
secret/configMap: files; hostPath: the path itself), runs the init containers in order, each to completion, then starts
every container as a host process (``local_node_proc``), runs their probes,
restarts them as ``restartPolicy`` says (with the node's exponential backoff)
and writes the pod's status through the status subresource (a strategic
merge patch: the scheduler's ``PodScheduled`` condition and the API server's
``qosClass`` stay theirs).  On deletion it runs each container's preStop
hook, SIGTERMs the entrypoint, SIGKILLs whatever of the container is left
when ``terminationGracePeriodSeconds`` (or the deletion's grace period) is
over, writes the final status and confirms the deletion (DELETE with
``gracePeriodSeconds=0`` and the pod's uid as precondition), as a kubelet does.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes.client
import urllib3.exceptions

from policy_operator.constants import ENV_HOST

from . import local_node_probes as probes
from .local_node_proc import ContainerConfigError, ContainerProcess, PathMap, argv_of, expand, kill_tagged, rfc3339
from .local_node_storage import VolumeError

if TYPE_CHECKING:
    from .local_node import LocalNode

log = logging.getLogger("local_node")

TICK_S = 0.2
CONFIG_RETRY_S = 1.0
DEFAULT_GRACE_S = 30


API_ERRORS = (kubernetes.client.ApiException, urllib3.exceptions.HTTPError, OSError)


@dataclass
class ContainerRun:
    """One container of the pod across its restarts."""

    spec: dict[str, Any]
    init: bool = False
    proc: ContainerProcess | None = None
    runs: int = 0
    state: dict[str, Any] = field(default_factory=lambda: {"waiting": {"reason": "PodInitializing"}})
    last_state: dict[str, Any] = field(default_factory=dict)
    next_start: float = 0.0
    started: bool = False
    ready: bool = False
    done: bool = False  # terminated and will not restart
    workers: dict[str, probes.ProbeWorker] = field(default_factory=dict)
    killer: threading.Thread | None = None
    kill_reason: str = ""

    @property
    def name(self) -> str:
        return str(self.spec.get("name"))

    @property
    def restart_count(self) -> int:
        return max(0, self.runs - 1)

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.finished_at is None and self.proc.start_error is None

    def stop_probes(self) -> None:
        for worker in self.workers.values():
            worker.stop()
        self.workers.clear()


def _waiting(run: ContainerRun) -> bool:
    """Not started yet, or exited and backing off before its restart."""
    return run.proc is None or (run.proc.finished_at is not None and run.next_start > 0)


class PodRunner:
    """The kubelet's work for one pod; ``start()``, then ``request_delete()`` / ``shutdown()``."""

    def __init__(self, node: LocalNode, pod: Mapping[str, Any], ip: str) -> None:
        meta = pod["metadata"]
        self.node = node
        self.namespace, self.name, self.uid = meta["namespace"], meta["name"], meta["uid"]
        self.pod = pod
        self.spec: dict[str, Any] = pod.get("spec") or {}
        self.ip = ip
        self.dir = node.root / "pods" / f"{self.name}-{self.uid[:8]}"
        self.log_dir = node.root / "logs" / f"{self.namespace}_{self.name}_{self.uid[:8]}"
        self.tag = f"{node.node_id}/{self.uid}/"
        self.restart_policy = self.spec.get("restartPolicy") or "Always"
        self.inits = [ContainerRun(dict(c), init=True) for c in self.spec.get("initContainers") or []]
        self.mains = [ContainerRun(dict(c)) for c in self.spec.get("containers") or []]
        self.volumes: dict[str, Path] | None = None
        self.claims: set[tuple[str, str]] = set()
        self.stage = "volumes"  # volumes -> init -> main -> done
        self.phase = "Pending"
        self.start_time = time.time()
        self.waiting_message = ""
        self.finished = threading.Event()  # the pod will run nothing more (terminal, or deleted)
        self.deleted = threading.Event()  # deletion confirmed to the API (or the node shut down)
        self._wake = threading.Event()
        self._delete_grace: float | None = None
        self._offline = False  # the node is shutting down: no API writes, no hooks
        self._transitions: dict[str, tuple[str, str]] = {}
        self._written: dict[str, Any] | None = None
        self._paths_of: dict[str, PathMap] = {}
        self._thread = threading.Thread(target=self._run, name=f"pod:{self.namespace}/{self.name}", daemon=True)

    # --- control -------------------------------------------------------------------------

    def start(self) -> PodRunner:
        self._thread.start()
        return self

    def wake(self) -> None:
        self._wake.set()

    def request_delete(self, grace_s: float | None) -> None:
        """The pod got a deletionTimestamp: stop it within ``grace_s`` (the pod's own grace when None)."""
        if self._delete_grace is None:
            spec_grace = self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S)
            self._delete_grace = float(spec_grace if grace_s is None else grace_s)
            self.wake()

    def shutdown(self, grace_s: float) -> None:
        """The node stops: kill everything within ``grace_s``, skip hooks and API writes."""
        self._offline = True
        self._delete_grace = min(grace_s, self._delete_grace if self._delete_grace is not None else grace_s)
        self.wake()

    def join(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return not self._thread.is_alive()

    @property
    def containers(self) -> list[ContainerRun]:
        return self.inits + self.mains

    def container(self, name: str) -> ContainerRun:
        for run in self.containers:
            if run.name == name:
                return run
        raise KeyError(f"pod {self.namespace}/{self.name} has no container {name!r}")

    # --- the worker loop -------------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._write_status()
            while self._delete_grace is None and self.stage != "done":
                self._step()
                self._write_status()
                self._wake.wait(TICK_S)
                self._wake.clear()
            if self.stage == "done":
                self.finished.set()
                self._write_status()
                while self._delete_grace is None:
                    self._wake.wait(1.0)
                    self._wake.clear()
            self._terminate(self._delete_grace)
        except Exception as exc:  # noqa: BLE001 - a node bug must be visible to the test, not kill the thread silently
            log.exception("pod %s/%s: worker failed", self.namespace, self.name)
            self.node.errors.append(exc)
            kill_tagged(self.tag)
        finally:
            self.finished.set()
            self._confirm_deletion()

    def _step(self) -> None:
        if self.stage == "volumes":
            try:
                self._setup_volumes()
            except (VolumeError, ContainerConfigError, *API_ERRORS) as exc:
                self.waiting_message = str(exc)
                self._wake.wait(CONFIG_RETRY_S)
                return
            self.waiting_message = ""
            self.stage = "init" if self.inits else "main"
            self.node.record(self, None, "sandbox ready")
        if self.stage == "init":
            self._step_init()
        if self.stage == "main":
            self._step_main()

    def _step_init(self) -> None:
        index = next((i for i, r in enumerate(self.inits) if not r.done), None)
        if index is None:
            self.stage = "main"
            return
        run = self.inits[index]
        if _waiting(run):
            if time.time() >= run.next_start:
                self._start(run)
            return
        assert run.proc is not None  # started: not _waiting(run)
        code = run.proc.poll()
        if code is None:
            return
        terminated = self._terminated_state(run, code)
        if code == 0:
            run.state, run.done = terminated, True
            if all(r.done for r in self.inits):
                self.stage = "main"
            return
        if self.restart_policy == "Never":
            run.state, run.done = terminated, True
            self.phase, self.stage = "Failed", "done"
            for main in self.mains:
                main.done = True
            return
        self._back_off(run, terminated)

    def _step_main(self) -> None:
        for run in self.mains:
            if run.done:
                continue
            if _waiting(run):
                if time.time() >= run.next_start and run.killer is None:
                    self._start(run)
                continue
            assert run.proc is not None  # started: not _waiting(run)
            code = run.proc.poll()
            if code is None:
                self._check_probes(run)
                continue
            if run.killer is not None:
                run.killer.join(timeout=0)
                if run.killer.is_alive():
                    continue
                run.killer = None
            run.stop_probes()
            run.started = run.ready = False
            terminated = self._terminated_state(run, code)
            if self.restart_policy == "Always" or (self.restart_policy == "OnFailure" and code != 0):
                self._back_off(run, terminated)
            else:
                run.state, run.done = terminated, True
        if all(r.done for r in self.mains):
            failed = any((r.state.get("terminated") or {}).get("exitCode", 0) != 0 for r in self.mains)
            self.phase, self.stage = ("Failed" if failed else "Succeeded"), "done"
        elif any(r.runs for r in self.mains):
            self.phase = "Running"

    def _back_off(self, run: ContainerRun, terminated: dict[str, Any]) -> None:
        delay = self.node.backoff(run.runs)
        run.last_state = terminated
        run.state = {
            "waiting": {
                "reason": "CrashLoopBackOff",
                "message": f"back-off {delay:g}s restarting failed container={run.name} "
                f"pod={self.name}_{self.namespace}({self.uid})",
            }
        }
        run.next_start = time.time() + delay
        self.node.record(self, run.name, f"back-off {delay:g}s")

    # --- containers ------------------------------------------------------------------------

    def _start(self, run: ContainerRun) -> None:
        run.next_start = 0.0
        try:
            paths = self._paths(run)
            env = self._env(run, paths)
            argv = argv_of(run.spec, env, paths)
            cwd = paths.host(run.spec["workingDir"]) if run.spec.get("workingDir") else str(self.dir)
        except (ContainerConfigError, *API_ERRORS) as exc:
            run.state = {"waiting": {"reason": "CreateContainerConfigError", "message": str(exc)}}
            run.next_start = time.time() + CONFIG_RETRY_S
            return
        Path(cwd).mkdir(parents=True, exist_ok=True)
        run.runs += 1
        run.proc = ContainerProcess(
            argv, env, cwd, self.log_dir / run.name / f"{run.runs - 1}.log", f"{self.tag}{run.name}#{run.runs - 1}/"
        ).start()
        run.state = {"running": {"startedAt": rfc3339(run.proc.started_at)}}
        run.kill_reason = ""
        self._paths_of[run.name] = paths
        self.node.record(self, run.name, "started" if run.proc.start_error is None else run.proc.start_error)
        if run.init:
            return
        if run.spec.get("startupProbe"):
            run.workers[probes.STARTUP] = self._probe(run, probes.STARTUP)
        else:
            self._container_started(run)

    def _probe(self, run: ContainerRun, kind: str) -> probes.ProbeWorker:
        return probes.ProbeWorker(
            kind,
            run.spec[probes.PROBE_FIELDS[kind]],
            ip=self.ip,
            container=run.spec,
            exec_fn=lambda cmd, timeout: self._exec(run, cmd, timeout),
            on_change=self.wake,
        ).start()

    def _container_started(self, run: ContainerRun) -> None:
        run.started = True
        for kind in (probes.LIVENESS, probes.READINESS):
            if run.spec.get(probes.PROBE_FIELDS[kind]):
                run.workers[kind] = self._probe(run, kind)

    def _check_probes(self, run: ContainerRun) -> None:
        if run.killer is not None:
            return
        startup = run.workers.get(probes.STARTUP)
        if startup is not None and startup.result is True and not run.started:
            run.workers.pop(probes.STARTUP).stop()
            self._container_started(run)
            self.node.record(self, run.name, "startup probe succeeded")
        for kind in (probes.STARTUP, probes.LIVENESS):
            worker = run.workers.get(kind)
            if worker is not None and worker.result is False:
                self._kill(run, f"{kind.capitalize()} probe failed: {worker.message}")
                return
        readiness = run.workers.get(probes.READINESS)
        ready = run.started and (readiness is None or readiness.result is True)
        if ready != run.ready:
            run.ready = ready
            self.node.record(self, run.name, "ready" if ready else "not ready")

    def _kill(self, run: ContainerRun, reason: str) -> None:
        """What the kubelet does to a container that failed its liveness or startup probe."""
        run.kill_reason = reason
        run.stop_probes()
        run.ready = False
        grace = float(self.spec.get("terminationGracePeriodSeconds", DEFAULT_GRACE_S))
        self.node.record(self, run.name, f"killing: {reason}")
        run.killer = threading.Thread(
            target=self._stop_container,
            args=(run, time.time() + grace, True),
            daemon=True,
            name=f"kill:{self.name}/{run.name}",
        )
        run.killer.start()

    def _stop_container(self, run: ContainerRun, deadline: float, hooks: bool) -> None:
        proc = run.proc
        if proc is None or proc.poll() is not None:
            return
        pre_stop = ((run.spec.get("lifecycle") or {}).get("preStop")) if hooks and not run.init else None
        if pre_stop:
            ok, message = probes.run_handler(
                pre_stop,
                ip=self.ip,
                container=run.spec,
                timeout=max(0.0, deadline - time.time()),
                exec_fn=lambda cmd, timeout: self._exec(run, cmd, timeout),
            )
            self.node.record(self, run.name, f"preStop: {message}")
        proc.stop(max(0.0, deadline - time.time()))

    def _exec(self, run: ContainerRun, command: Sequence[str], timeout: float) -> int:
        """An exec probe or hook: a process of the container (same env, paths and tag)."""
        base = run.proc
        if base is None or base.finished_at is not None:
            return 1
        paths = self._paths_of.get(run.name, PathMap())
        argv = [paths.host(expand(str(a), base.env)) for a in command]
        probe = ContainerProcess(
            argv, base.env, base.cwd, self.log_dir / run.name / "exec.log", f"{base.tag}exec{time.monotonic_ns()}/"
        ).start()
        if probe.proc is None:
            return 1
        try:
            probe.proc.wait(timeout)
        except subprocess.TimeoutExpired:  # a timed-out exec probe fails, and is killed
            probe.stop(0)
            return 1
        code = probe.poll()
        return 1 if code is None else code

    def _terminated_state(self, run: ContainerRun, code: int) -> dict[str, Any]:
        proc = run.proc
        assert proc is not None
        if proc.start_error is not None:
            reason = "StartError"
        elif code == 0:
            reason = "Completed"
        else:
            reason = "Error"
        term: dict[str, Any] = {
            "exitCode": code,
            "reason": reason,
            "startedAt": rfc3339(proc.started_at),
            "finishedAt": rfc3339(proc.finished_at or time.time()),
            "containerID": f"local://{proc.pid or 0}",
        }
        if code >= 128 and proc.start_error is None:
            term["signal"] = code - 128
        message = proc.start_error or ""
        if not message and code != 0 and run.spec.get("terminationMessagePolicy") == "FallbackToLogsOnError":
            message = proc.termination_message()
        if run.kill_reason:
            message = f"{run.kill_reason}\n{message}".strip()
        if message:
            term["message"] = message
        self.node.record(self, run.name, f"exited {code}")
        return {"terminated": term}

    # --- volumes, paths, environment ---------------------------------------------------------

    def volume(self, name: str) -> Path:
        """The host directory of volume ``name``, for tests (the volumes are set up before any container runs)."""
        assert self.volumes is not None, f"pod {self.namespace}/{self.name}: its volumes are not set up yet"
        return self.volumes[name]

    def _setup_volumes(self) -> None:
        volumes: dict[str, Path] = {}
        for v in self.spec.get("volumes") or []:
            name = v["name"]
            if "emptyDir" in v:
                path = self.dir / "volumes" / name
                path.mkdir(parents=True, exist_ok=True)
            elif "persistentVolumeClaim" in v:
                claim = v["persistentVolumeClaim"]["claimName"]
                path = self.node.claim_dir(self.namespace, claim)
                self.claims.add((self.namespace, claim))
            elif "hostPath" in v:
                path = Path(v["hostPath"]["path"])
            elif any(k in v for k in ("secret", "configMap", "downwardAPI")):
                source = {k: v[k] for k in ("secret", "configMap", "downwardAPI") if k in v}
                path = self._write_files(name, self._projection(name, source), v[next(iter(source))])
            elif "projected" in v:
                files: dict[str, tuple[bytes, int | None]] = {}
                for source in v["projected"].get("sources") or []:
                    files.update(self._projection(name, source))
                path = self._write_files(name, files, v["projected"])
            else:
                kinds = sorted(k for k in v if k != "name")
                raise VolumeError(f"volume {name!r}: {kinds} volumes are not supported by the local node")
            volumes[name] = path
        self.volumes = volumes

    def _source(self, kind: str, name: str) -> dict[str, bytes] | None:
        plural = "secrets" if kind == "Secret" else "configmaps"
        obj = self.node.api.get("v1", plural, name, self.namespace)
        if obj is None:
            return None
        data: dict[str, bytes] = {}
        if kind == "Secret":
            data.update({k: base64.b64decode(v) for k, v in (obj.get("data") or {}).items()})
            data.update({k: str(v).encode() for k, v in (obj.get("stringData") or {}).items()})
        else:
            data.update({k: str(v).encode() for k, v in (obj.get("data") or {}).items()})
            data.update({k: base64.b64decode(v) for k, v in (obj.get("binaryData") or {}).items()})
        return data

    def _projection(self, volume: str, source: Mapping[str, Any]) -> dict[str, tuple[bytes, int | None]]:
        """One source of a volume of files (secret, configMap, downwardAPI, serviceAccountToken): path -> (bytes, mode)."""
        if "secret" in source or "configMap" in source:
            kind, src = ("Secret", source["secret"]) if "secret" in source else ("ConfigMap", source["configMap"])
            ref = src.get("secretName") or src.get("name")
            data = self._source(kind, str(ref))
            if data is None:
                if src.get("optional"):
                    return {}
                raise VolumeError(f'MountVolume.SetUp failed for volume "{volume}": {kind.lower()} "{ref}" not found')
            files = {}
            for item in src.get("items") or [{"key": k, "path": k} for k in data]:
                if item["key"] not in data:
                    if src.get("optional"):
                        continue
                    raise VolumeError(
                        f'MountVolume.SetUp failed for volume "{volume}": '
                        f"couldn't find key {item['key']} in {kind} {self.namespace}/{ref}"
                    )
                files[item["path"]] = (data[item["key"]], item.get("mode"))
            return files
        if "downwardAPI" in source:
            files = {}
            for item in source["downwardAPI"].get("items") or []:
                if "fieldRef" not in item:
                    raise VolumeError(
                        f"volume {volume!r}: downwardAPI {sorted(item)} is not supported by the local node"
                    )
                try:
                    files[item["path"]] = (self._field(item["fieldRef"]["fieldPath"]).encode(), item.get("mode"))
                except ContainerConfigError as exc:
                    raise VolumeError(f"volume {volume!r}: {exc}") from None
            return files
        if "serviceAccountToken" in source:
            src = source["serviceAccountToken"]
            token = self.node.api.token(
                self.namespace,
                self.spec.get("serviceAccountName") or "default",
                audiences=[src["audience"]] if src.get("audience") else [],
                expiration_s=int(src.get("expirationSeconds") or 3607),
                pod=(self.name, self.uid),
            )
            return {src["path"]: (token.encode(), None)}
        raise VolumeError(f"volume {volume!r}: projected source {sorted(source)} is not supported by the local node")

    def _write_files(self, volume: str, files: Mapping[str, tuple[bytes, int | None]], src: Mapping[str, Any]) -> Path:
        path = self.dir / "volumes" / volume
        path.mkdir(parents=True, exist_ok=True)
        default_mode = int(src.get("defaultMode", 0o644))
        for rel, (data, mode) in files.items():
            target = path / rel
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            os.chmod(target, int(mode if mode is not None else default_mode))
        return path

    def _paths(self, run: ContainerRun) -> PathMap:
        assert self.volumes is not None
        mounts: dict[str, str] = {}
        for m in run.spec.get("volumeMounts") or []:
            if m["name"] not in self.volumes:
                raise ContainerConfigError(
                    f"container {run.name!r} mounts volume {m['name']!r}, which the pod does not define"
                )
            host = self.volumes[m["name"]] / (m.get("subPath") or "")
            mounts[m["mountPath"]] = str(host).rstrip("/")
        return PathMap.of(mounts)

    def _field(self, path: str) -> str:
        meta = self.pod.get("metadata") or {}
        simple = {
            "metadata.name": self.name,
            "metadata.namespace": self.namespace,
            "metadata.uid": self.uid,
            "spec.nodeName": self.node.name,
            "spec.serviceAccountName": self.spec.get("serviceAccountName", "default"),
            "status.podIP": self.ip,
            "status.podIPs": self.ip,
            "status.hostIP": self.node.host_ip,
            "status.hostIPs": self.node.host_ip,
        }
        if path in simple:
            return str(simple[path])
        for prefix, source in (
            ("metadata.labels", meta.get("labels")),
            ("metadata.annotations", meta.get("annotations")),
        ):
            if path.startswith(f"{prefix}['") and path.endswith("']"):
                return str((source or {}).get(path[len(prefix) + 2 : -2], ""))
        raise ContainerConfigError(f"fieldRef {path!r} is not supported")

    def _key(self, kind: str, ref: Mapping[str, Any]) -> str | None:
        data = self._source(kind, str(ref.get("name")))
        if data is None:
            if ref.get("optional"):
                return None
            raise ContainerConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
        if ref.get("key") not in data:
            if ref.get("optional"):
                return None
            raise ContainerConfigError(
                f"couldn't find key {ref.get('key')} in {kind} {self.namespace}/{ref.get('name')}"
            )
        return data[str(ref["key"])].decode("utf-8", "replace")

    def _env(self, run: ContainerRun, paths: PathMap) -> dict[str, str]:
        env = dict(self.node.base_env)
        env["HOSTNAME"] = str(self.spec.get("hostname") or self.name)
        env[ENV_HOST] = self.ip  # the pod's "network namespace": see docs/e2e.md
        tmp = paths.host("/tmp")
        if tmp != "/tmp":
            env["TMPDIR"] = tmp  # the container's /tmp is an emptyDir
        for src in run.spec.get("envFrom") or []:
            kind, ref = (
                ("Secret", src["secretRef"]) if "secretRef" in src else ("ConfigMap", src.get("configMapRef") or {})
            )
            data = self._source(kind, str(ref.get("name")))
            if data is None and not ref.get("optional"):
                raise ContainerConfigError(f'{kind.lower()} "{ref.get("name")}" not found')
            for k, v in (data or {}).items():
                env[f"{src.get('prefix', '')}{k}"] = v.decode("utf-8", "replace")
        for item in run.spec.get("env") or []:
            name = item["name"]
            if "valueFrom" in item:
                source = item["valueFrom"] or {}
                if "fieldRef" in source:
                    value: str | None = self._field(source["fieldRef"]["fieldPath"])
                elif "secretKeyRef" in source:
                    value = self._key("Secret", source["secretKeyRef"])
                elif "configMapKeyRef" in source:
                    value = self._key("ConfigMap", source["configMapKeyRef"])
                else:
                    raise ContainerConfigError(
                        f"env {name}: valueFrom {sorted(source)} is not supported by the local node"
                    )
                if value is None:
                    continue
            else:
                value = expand(str(item.get("value", "")), env)
            env[name] = paths.host(value)
        return env

    # --- termination --------------------------------------------------------------------------

    def _terminate(self, grace: float | None) -> None:
        deadline = time.time() + float(grace if grace is not None else DEFAULT_GRACE_S)
        self.node.record(self, None, f"terminating (grace {deadline - time.time():.0f}s)")
        for run in self.containers:
            run.stop_probes()
            run.ready = False
        threads = [
            threading.Thread(target=self._stop_container, args=(run, deadline, not self._offline), daemon=True)
            for run in self.containers
            if run.proc is not None and run.proc.poll() is None
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.time()) + 15)
        kill_tagged(self.tag)
        for run in self.containers:
            if run.proc is not None and run.proc.finished_at is not None and "terminated" not in run.state:
                run.state = self._terminated_state(run, run.proc.poll() or 0)
            elif run.proc is None and not run.done:
                run.state = (
                    {
                        "terminated": {
                            "exitCode": 0,
                            "reason": "ContainerStatusUnknown",
                            "message": "The container could not be located when the pod was deleted",
                        }
                    }
                    if run.runs
                    else run.state
                )
            run.done = True
        if self.phase not in ("Succeeded", "Failed"):
            failed = any((r.state.get("terminated") or {}).get("exitCode", 0) != 0 for r in self.mains)
            self.phase = "Failed" if failed else "Succeeded"
        self.stage = "done"
        self._write_status()

    def _confirm_deletion(self) -> None:
        if self._delete_grace is None:
            return
        if not self._offline:
            with contextlib.suppress(*API_ERRORS):  # 404: gone already; 409: another pod has the name now
                self.node.api.delete("v1", "pods", self.name, self.namespace, grace_period=0, uid=self.uid)
        shutil.rmtree(self.dir, ignore_errors=True)
        self.node.record(self, None, "deleted")
        self.deleted.set()

    # --- status ----------------------------------------------------------------------------------

    def _container_status(self, run: ContainerRun) -> dict[str, Any]:
        status: dict[str, Any] = {
            "name": run.name,
            "image": run.spec.get("image", ""),
            "imageID": "",
            "ready": run.ready,
            "restartCount": run.restart_count,
            "state": run.state,
            "lastState": run.last_state,
        }
        if run.proc is not None:
            status["containerID"] = f"local://{run.proc.pid or 0}"
        if not run.init:
            status["started"] = run.started and run.running
        if self.waiting_message and "waiting" in run.state:
            status["state"] = {"waiting": {"reason": "ContainerCreating", "message": self.waiting_message}}
        return status

    def _cond(self, kind: str, ok: bool, reason: str = "", message: str = "") -> dict[str, Any]:
        value = "True" if ok else "False"
        previous = self._transitions.get(kind)
        if previous is None or previous[0] != value:
            self._transitions[kind] = (value, rfc3339(time.time()))
        cond = {"type": kind, "status": value, "lastProbeTime": None, "lastTransitionTime": self._transitions[kind][1]}
        if not ok and reason:
            cond.update(reason=reason, message=message)
        return cond

    def status(self) -> dict[str, Any]:
        terminal = self.phase in ("Succeeded", "Failed")
        pending_inits = [
            r.name for r in self.inits if not (r.done and (r.state.get("terminated") or {}).get("exitCode") == 0)
        ]
        unready = [r.name for r in self.mains if not r.ready]
        ready = not unready and not terminal and self._delete_grace is None
        unready_reason = "PodCompleted" if terminal else "ContainersNotReady"
        unready_message = "" if terminal else f"containers with unready status: [{' '.join(unready)}]"
        status: dict[str, Any] = {
            "phase": self.phase,
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "hostIP": self.node.host_ip,
            "hostIPs": [{"ip": self.node.host_ip}],
            "startTime": rfc3339(self.start_time),
            "conditions": [
                self._cond("PodReadyToStartContainers", self.volumes is not None and not terminal),
                self._cond(
                    "Initialized",
                    not pending_inits,
                    "ContainersNotInitialized",
                    f"containers with incomplete status: [{' '.join(pending_inits)}]",
                ),
                self._cond("Ready", ready, unready_reason, unready_message),
                self._cond("ContainersReady", ready, unready_reason, unready_message),
            ],
            "containerStatuses": [self._container_status(r) for r in self.mains],
        }
        if self.inits:
            status["initContainerStatuses"] = [self._container_status(r) for r in self.inits]
        return status

    def _write_status(self) -> None:
        if self._offline:
            return
        status = self.status()
        if status == self._written:
            return
        try:
            self.node.api.patch_status("v1", "pods", self.name, status, self.namespace, uid=self.uid)
        except kubernetes.client.ApiException as exc:
            if exc.status not in (404, 409):  # a pod gone from the API (or replaced) has no status to write
                log.warning("pod %s/%s: status write failed: %s %s", self.namespace, self.name, exc.reason, exc.body)
            return
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            log.warning("pod %s/%s: status write failed: %s", self.namespace, self.name, exc)
            return
        self._written = status

    def processes_alive(self) -> bool:
        return any(r.running for r in self.containers)

    def signal_container(self, name: str, sig: int = signal.SIGTERM) -> None:
        run = self.container(name)
        if run.proc is not None:
            run.proc.signal(sig)
