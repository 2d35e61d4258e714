"""A real Kubernetes control plane for the tests: etcd, kube-apiserver, kube-controller-manager, kube-scheduler.

Why real: the project's users run ``kubectl apply`` and ``helm install``
against real clusters; only a real apiserver evaluates and cost-checks the
CRD's CEL rules, enforces RBAC and immutable fields, serves ``kubectl
explain``, and only the real controllers know StatefulSet/Job/GC semantics.

All five programs come from one binary built from ``tests/cluster/`` (one
pinned Kubernetes release, see its ``main.go``), so kubectl always matches the
server.  Each component runs as its own process in its own process group on
127.0.0.1 only; :meth:`ControlPlane.stop` signals exactly those groups, also
after a start that failed half-way.  Every wait is bounded and a failure
carries the tail of the component's log (``WORKDIR/logs/NAME.log``).

    with ControlPlane(tmp_path) as cp:
        cp.kubectl("apply", "-f", "crds/policyservers.yaml")
        CoreV1Api(cp.api_client).list_namespace()

``make cluster-up`` / ``make cluster-down`` run the same code through
``python -m tests.support.control_plane up|down``, keeping pids, ports and the
kubeconfig in ``.cache/cluster/`` (see docs/testing.md).

No node runs here: the kubelet stand-in is ``tests/support/local_node*.py``.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import dataclasses
import fcntl
import hashlib
import json
import os
import re
import secrets
import shutil
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.support.net import free_port

if TYPE_CHECKING:
    import kubernetes.client

REPO = Path(__file__).resolve().parents[2]
MODULE_DIR = REPO / "tests" / "cluster"
CACHE_DIR = REPO / ".cache" / "cluster"
BIN_DIR = CACHE_DIR / "bin"
BINARY = BIN_DIR / "kube-multicall"
KUBECTL = BIN_DIR / "kubectl"
STAMP = BIN_DIR / "kube-multicall.stamp"
# What the binary is built from: a change to any of them rebuilds it.
BUILD_INPUTS = ("go.mod", "go.sum", "main.go")

# `make cluster-up`'s control plane: its workdir and the record `down` reads.
CLI_WORKDIR = CACHE_DIR / "run"
CLI_STATE = CACHE_DIR / "state.json"
CLI_KUBECONFIG = CACHE_DIR / "kubeconfig"

HOST = "127.0.0.1"
SERVICE_CIDR = "10.0.0.0/24"  # virtual ClusterIPs only: nothing ever connects to them
CLUSTER_NAME = "policy-test"
ADMIN_USER = "admin"

# Bounded waits, generous for a loaded 2-core CI machine.
ETCD_START_S = 60.0
APISERVER_START_S = 180.0
COMPONENT_START_S = 120.0
SERVICE_ACCOUNT_S = 120.0
NAMESPACE_S = 120.0
STOP_GRACE_S = 15.0
LOG_TAIL_LINES = 30


class ControlPlaneError(RuntimeError):
    """A component did not build, start or answer in time; the message carries its log tail."""


class KubectlError(subprocess.CalledProcessError):
    """A failed ``kubectl`` whose message includes what kubectl said (CalledProcessError's does not)."""

    def __str__(self) -> str:
        return f"{' '.join(map(str, self.cmd))} exited {self.returncode}:\n{self.stderr or ''}{self.stdout or ''}"


# --- the binary -------------------------------------------------------------------------
def kubernetes_version() -> str:
    """The release the binary is built from: the ``k8s.io/kubernetes`` requirement of tests/cluster/go.mod."""
    found = re.search(r"^\s*k8s\.io/kubernetes (v\d+\.\d+\.\d+)\s*$", (MODULE_DIR / "go.mod").read_text(), re.M)
    if found is None:
        raise ControlPlaneError(f"{MODULE_DIR / 'go.mod'} requires no k8s.io/kubernetes release")
    return found.group(1)


def build_command(output: Path) -> list[str]:
    """``go build`` with the version stamped in as Kubernetes' own build does (hack/lib/version.sh).

    Without it every component reports ``v0.0.0-master``: kubectl refuses to
    compare versions and the components cannot tell which release's
    defaults and feature gates they are.
    """
    version = kubernetes_version()
    major, minor, _ = version[1:].split(".")
    stamps = [
        f"-X k8s.io/{package}.{key}={value}"
        for package in ("client-go/pkg/version", "component-base/version")
        for key, value in (
            ("gitVersion", version),
            ("gitMajor", major),
            ("gitMinor", minor),
            ("gitCommit", ""),
            ("gitTreeState", "archive"),
        )
    ]
    return ["go", "build", "-trimpath", "-buildvcs=false", f"-ldflags=-s -w {' '.join(stamps)}", "-o", str(output), "."]


def source_hash() -> str:
    """Hash of the module's build inputs and the build command: the stamp that decides whether the binary is current."""
    digest = hashlib.sha256(" ".join(build_command(BINARY)).encode() + b"\0")
    for name in BUILD_INPUTS:
        digest.update(name.encode() + b"\0" + (MODULE_DIR / name).read_bytes() + b"\0")
    return digest.hexdigest()


def binary_is_current() -> bool:
    return BINARY.is_file() and STAMP.is_file() and STAMP.read_text().strip() == source_hash()


def ensure_binary(*, log: Any = sys.stderr) -> Path:
    """Build ``.cache/cluster/bin/kube-multicall`` (and its ``kubectl`` link) unless it is current; return it.

    A file lock serialises concurrent callers (``make test`` and a developer's
    pytest), and the binary is swapped in atomically, so nobody ever runs a
    half-written one.  ``-mod=readonly`` (go build's default) makes a
    go.sum out of step with go.mod an error instead of a silent edit.
    """
    BIN_DIR.mkdir(parents=True, exist_ok=True)
    with open(BIN_DIR / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not binary_is_current():
            _build(log)
        _link(KUBECTL)
    return BINARY


def _build(log: Any) -> None:
    # the official tarball's place: a non-interactive shell (CI) may not have it on PATH
    go = shutil.which("go") or shutil.which("go", path="/usr/local/go/bin")
    if go is None:
        raise ControlPlaneError(
            "`go` is not on PATH: the control plane is built from tests/cluster/ "
            "(Go >= the `go` line of tests/cluster/go.mod)"
        )
    want = source_hash()
    tmp = BIN_DIR / "kube-multicall.partial"
    cmd = build_command(tmp)
    print(
        f"building the control plane {kubernetes_version()} from {MODULE_DIR.relative_to(REPO)}/ "
        f"into {BINARY.relative_to(REPO)}\n  (CGO_ENABLED=0 {' '.join(cmd[:3])} ...: 10-20 min on 2 cores "
        "with cold Go caches, a minute or two warm)",
        file=log,
        flush=True,
    )
    started = time.monotonic()
    result = subprocess.run(
        [go, *cmd[1:]],
        cwd=MODULE_DIR,
        env={**os.environ, "CGO_ENABLED": "0"},
        capture_output=True,
        text=True,
        check=False,
    )
    if result.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ControlPlaneError(f"go build failed ({result.returncode}):\n{_tail(result.stdout + result.stderr, 60)}")
    os.replace(tmp, BINARY)
    STAMP.write_text(want + "\n")
    print(
        f"built {BINARY.relative_to(REPO)} in {time.monotonic() - started:.0f} s "
        f"({BINARY.stat().st_size / 2**20:.0f} MiB)",
        file=log,
        flush=True,
    )


def _link(path: Path) -> None:
    """``path`` -> kube-multicall (relative), which then runs the component named like the link."""
    if path.is_symlink() and os.readlink(path) == BINARY.name:
        return
    path.unlink(missing_ok=True)
    path.symlink_to(BINARY.name)


# --- processes --------------------------------------------------------------------------
def _start_time(pid: int) -> int | None:
    """Start time of a live (non-zombie) process, or None: it tells a reused pid apart."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return None if fields[0] in ("Z", "X") else int(fields[19])


def _tail(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


@dataclasses.dataclass
class Component:
    """One started component: its process group leader (pid = pgid) and its start time."""

    name: str
    pid: int
    start_time: int
    log: Path
    proc: subprocess.Popen[bytes] | None = dataclasses.field(default=None, repr=False, compare=False)

    def alive(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:
            return False
        return _start_time(self.pid) == self.start_time

    def log_tail(self) -> str:
        try:
            return _tail(self.log.read_text(errors="replace"))
        except OSError as exc:
            return f"(no log: {exc})"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """SIGTERM the component's process group, SIGKILL it after ``grace``; never anyone else's."""
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self.alive():
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, sig)
            deadline = time.monotonic() + grace
            while self.alive() and time.monotonic() < deadline:
                time.sleep(0.1)
        if self.proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=grace)

    def record(self) -> dict[str, Any]:
        return {"name": self.name, "pid": self.pid, "start_time": self.start_time, "log": str(self.log)}

    @classmethod
    def from_record(cls, record: dict[str, Any]) -> Component:
        return cls(record["name"], int(record["pid"]), int(record["start_time"]), Path(record["log"]))


# --- the control plane ------------------------------------------------------------------
class ControlPlane:
    """etcd + kube-apiserver + kube-controller-manager + kube-scheduler as local processes (one binary, tests/cluster/).

    ``controllers=False`` / ``scheduler=False`` leave those out (an apiserver
    alone starts in seconds and is enough for admission tests).  Files under
    ``workdir``: ``kubeconfig`` (admin: a token in ``system:masters``),
    ``pki/`` (the service-account key, the token file), ``apiserver-certs/``
    (the serving certificate the apiserver generated for 127.0.0.1),
    ``etcd/``, ``logs/NAME.log``, ``kubectl-cache/``.
    """

    def __init__(
        self, workdir: Path, *, controllers: bool = True, scheduler: bool = True, ports: dict[str, int] | None = None
    ) -> None:
        """``ports``: a component's port to use instead of a free one (``etcd_client``, ``etcd_peer``,
        ``apiserver``, ``controller_manager``, ``scheduler``), e.g. a taken one to see a start fail."""
        self.workdir = Path(workdir).resolve()
        self._fixed_ports = dict(ports or {})
        self.controllers = controllers
        self.scheduler = scheduler
        self.kubectl_bin = KUBECTL
        self.kubeconfig = self.workdir / "kubeconfig"
        self.components: list[Component] = []
        self.ports: dict[str, int] = {}
        self.admin_token = secrets.token_urlsafe(32)
        self._api_client: kubernetes.client.ApiClient | None = None

    # -- lifecycle --
    @property
    def url(self) -> str:
        return f"https://{HOST}:{self.ports['apiserver']}"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"

    @property
    def serving_cert(self) -> Path:
        """The apiserver's generated serving certificate, followed by the CA that signed it."""
        return self.workdir / "apiserver-certs" / "apiserver.crt"

    @property
    def ca_cert(self) -> Path:
        """That CA alone: what clients trust, and what the controller manager publishes as the cluster's root CA."""
        return self.workdir / "pki" / "ca.crt"

    @property
    def env(self) -> dict[str, str]:
        """os.environ for subprocesses that talk to this cluster: KUBECONFIG, this release's kubectl first on PATH."""
        env = dict(os.environ)
        env["KUBECONFIG"] = str(self.kubeconfig)
        env["KUBECACHEDIR"] = str(self.workdir / "kubectl-cache")
        env["PATH"] = f"{self.kubectl_bin.parent}{os.pathsep}{env.get('PATH', '')}"
        return env

    def start(self) -> None:
        """Start every component in order and wait for each; on any failure stop what was started, then raise."""
        binary = ensure_binary()
        try:
            self._prepare()
            self._start_etcd(binary)
            self._start_apiserver(binary)
            self._extract_ca()
            self._write_kubeconfig(self.kubeconfig, self.admin_token)
            if self.controllers:
                self._start_controller_manager(binary)
            if self.scheduler:
                self._start_scheduler(binary)
            if self.controllers:
                # The ServiceAccount admission plugin refuses pods until the
                # namespace's `default` ServiceAccount exists; it is the sign
                # that the controllers really run.
                self._wait_default_service_account("default")
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Stop exactly the processes this object started, newest first (safe to call twice)."""
        if self._api_client is not None:
            with contextlib.suppress(Exception):
                self._api_client.close()
            self._api_client = None
        for component in reversed(self.components):
            component.stop()
        self.components.clear()

    def __enter__(self) -> ControlPlane:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def record(self) -> dict[str, Any]:
        """What ``cluster-down`` needs to stop this control plane from another process."""
        return {
            "workdir": str(self.workdir),
            "url": self.url,
            "kubeconfig": str(self.kubeconfig),
            "ports": self.ports,
            "components": [c.record() for c in self.components],
        }

    # -- clients --
    def kubectl(
        self, *args: str, input: str | None = None, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        """Run this release's kubectl as the admin; ``check`` raises :class:`KubectlError` with its output."""
        result = subprocess.run(
            [str(self.kubectl_bin), *args],
            input=input,
            capture_output=True,
            text=True,
            env=self.env,
            cwd=REPO,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise KubectlError(result.returncode, result.args, result.stdout, result.stderr)
        return result

    @property
    def api_client(self) -> kubernetes.client.ApiClient:
        """An admin ``kubernetes`` ApiClient built from the kubeconfig (one per control plane)."""
        if self._api_client is None:
            import kubernetes.config

            self._api_client = kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))
        return self._api_client

    def kubeconfig_for_token(self, token: str, path: Path) -> Path:
        """A kubeconfig for this cluster that authenticates with ``token`` only (RBAC applies, no admin)."""
        self._write_kubeconfig(Path(path), token, user="token-user")
        return Path(path)

    def create_namespace(self, name: str) -> None:
        """Create ``name`` unless it exists; with controllers, wait until pods can be created in it."""
        from kubernetes.client import CoreV1Api, V1Namespace, V1ObjectMeta
        from kubernetes.client.exceptions import ApiException

        core = CoreV1Api(self.api_client)
        deadline = time.monotonic() + NAMESPACE_S
        while True:
            try:
                core.create_namespace(V1Namespace(metadata=V1ObjectMeta(name=name)))
                break
            except ApiException as exc:
                if exc.status != 409:
                    raise
            try:
                status = core.read_namespace(name).status
                if status is None or status.phase != "Terminating":
                    break
            except ApiException as exc:
                if exc.status != 404:
                    raise
                continue  # gone between the create and the read: create it again
            # a namespace of the same name is still being emptied by the namespace controller
            if time.monotonic() > deadline:
                raise ControlPlaneError(f"namespace {name} still Terminating after {NAMESPACE_S:.0f} s")
            time.sleep(0.5)
        if self.controllers:
            self._wait_default_service_account(name)

    # -- internals --
    def _prepare(self) -> None:
        for sub in ("etcd", "apiserver-certs", "logs", "pki", "kubectl-cache"):
            path = self.workdir / sub
            if sub == "etcd" and path.exists():
                shutil.rmtree(path)  # a fresh cluster each start: a stale member would refuse the new ports
            path.mkdir(parents=True, exist_ok=True)
        pki = self.workdir / "pki"
        # The key that signs (apiserver) and verifies (controller-manager) service-account tokens.
        subprocess.run(
            ["openssl", "genrsa", "-out", str(pki / "sa.key"), "2048"], check=True, capture_output=True, timeout=60
        )
        (pki / "tokens.csv").write_text(f'{self.admin_token},{ADMIN_USER},{ADMIN_USER},"system:masters"\n')
        for path in (pki / "sa.key", pki / "tokens.csv"):
            path.chmod(0o600)
        for name in ("etcd_client", "etcd_peer", "apiserver", "controller_manager", "scheduler"):
            self.ports[name] = self._fixed_ports.get(name) or free_port(HOST)

    def _spawn(self, binary: Path, name: str, args: list[str]) -> Component:
        log = self.logs / f"{name}.log"
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                [str(binary), name, *args],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        start_time = _start_time(proc.pid)
        component = Component(name, proc.pid, start_time if start_time is not None else -1, log, proc)
        self.components.append(component)
        return component

    def _wait(self, component: Component, probe: Any, timeout: float, what: str) -> None:
        """Poll ``probe`` until it is truthy; fail at once if the component exits, or after ``timeout``.

        Either failure carries the tail of the component's log.  Errors of the
        probe itself (connection refused while it starts) are retried.
        """
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        while time.monotonic() < deadline:
            if not component.alive():
                raise ControlPlaneError(
                    f"{component.name} exited while starting ({what}); {component.log}:\n{component.log_tail()}"
                )
            try:
                if probe():
                    return
            except Exception as exc:  # noqa: BLE001 - refused/503 until the component is up
                last = exc
            time.sleep(0.25)
        raise ControlPlaneError(
            f"timed out after {timeout:.0f} s waiting for {what} (last error: {last!r}); "
            f"{component.log}:\n{component.log_tail()}"
        )

    def _start_etcd(self, binary: Path) -> None:
        client = f"http://{HOST}:{self.ports['etcd_client']}"
        peer = f"http://{HOST}:{self.ports['etcd_peer']}"
        etcd = self._spawn(
            binary,
            "etcd",
            [
                "--name=etcd",
                f"--data-dir={self.workdir / 'etcd'}",
                f"--listen-client-urls={client}",
                f"--advertise-client-urls={client}",
                f"--listen-peer-urls={peer}",
                f"--initial-advertise-peer-urls={peer}",
                f"--initial-cluster=etcd={peer}",
                "--initial-cluster-state=new",
                "--unsafe-no-fsync",  # test data: durability across a power cut is not needed, speed is
                "--log-level=warn",
            ],
        )
        self._wait(etcd, lambda: _http_json(f"{client}/health").get("health") == "true", ETCD_START_S, "etcd /health")

    def _start_apiserver(self, binary: Path) -> None:
        pki, port = self.workdir / "pki", self.ports["apiserver"]
        apiserver = self._spawn(
            binary,
            "kube-apiserver",
            [
                f"--etcd-servers=http://{HOST}:{self.ports['etcd_client']}",
                f"--bind-address={HOST}",
                f"--advertise-address={HOST}",
                f"--secure-port={port}",
                # No --tls-cert-file: the apiserver writes a self-signed serving
                # certificate for the advertise address (127.0.0.1) into --cert-dir.
                f"--cert-dir={self.workdir / 'apiserver-certs'}",
                f"--token-auth-file={pki / 'tokens.csv'}",
                "--authorization-mode=Node,RBAC",
                f"--service-account-issuer=https://{HOST}:{port}",
                f"--service-account-key-file={pki / 'sa.key'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--allow-privileged=true",
                # The `kubernetes` Service's endpoints would be 127.0.0.1, which
                # endpoint validation refuses (loopback): nothing in-cluster needs them.
                "--endpoint-reconciler-type=none",
                "--profiling=false",
            ],
        )
        self._wait(apiserver, lambda: self._get("/readyz") == "ok", APISERVER_START_S, "kube-apiserver /readyz")

    def _start_controller_manager(self, binary: Path) -> None:
        port = self.ports["controller_manager"]
        manager = self._spawn(
            binary,
            "kube-controller-manager",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={port}",
                "--leader-elect=false",
                "--controllers=*",
                "--use-service-account-credentials",  # each controller acts as its own ServiceAccount, RBAC enforced
                f"--service-account-private-key-file={self.workdir / 'pki' / 'sa.key'}",
                f"--root-ca-file={self.ca_cert}",  # published as kube-root-ca.crt in every namespace
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--profiling=false",
            ],
        )
        self._wait(
            manager,
            lambda: _https_text(f"https://{HOST}:{port}/healthz") == "ok",
            COMPONENT_START_S,
            "kube-controller-manager /healthz",
        )

    def _start_scheduler(self, binary: Path) -> None:
        port = self.ports["scheduler"]
        scheduler = self._spawn(
            binary,
            "kube-scheduler",
            [
                f"--kubeconfig={self.kubeconfig}",
                f"--bind-address={HOST}",
                f"--secure-port={port}",
                "--leader-elect=false",
                "--profiling=false",
            ],
        )
        self._wait(
            scheduler,
            lambda: _https_text(f"https://{HOST}:{port}/readyz") == "ok",
            COMPONENT_START_S,
            "kube-scheduler /readyz",
        )

    def _extract_ca(self) -> None:
        """Write the CA of the apiserver's generated bundle (the blocks after its serving certificate) to ca.crt.

        The controller manager refuses a root CA file whose first certificate
        is not a CA (its ClusterTrustBundle publisher checks the CA bit).
        """
        blocks = re.findall(
            r"-----BEGIN CERTIFICATE-----.*?-----END CERTIFICATE-----\n?", self.serving_cert.read_text(), re.S
        )
        if len(blocks) < 2:
            raise ControlPlaneError(
                f"{self.serving_cert}: expected a serving certificate and its CA, found {len(blocks)} certificate(s)"
            )
        self.ca_cert.write_text("".join(blocks[1:]))

    def _wait_default_service_account(self, namespace: str) -> None:
        manager = next(c for c in self.components if c.name == "kube-controller-manager")
        path = f"/api/v1/namespaces/{namespace}/serviceaccounts/default"
        self._wait(
            manager,
            lambda: self._get(path) is not None,
            SERVICE_ACCOUNT_S,
            f"ServiceAccount {namespace}/default (made by the controller manager)",
        )

    def _get(self, path: str) -> str | None:
        """GET ``path`` from the apiserver as the admin, TLS verified against its own certificate; None on 404."""
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {self.admin_token}"})
        context = ssl.create_default_context(cafile=str(self.serving_cert))
        try:
            with urllib.request.urlopen(request, timeout=5, context=context) as reply:
                return reply.read().decode()
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def _write_kubeconfig(self, path: Path, token: str, user: str = ADMIN_USER) -> None:
        config = {
            "apiVersion": "v1",
            "kind": "Config",
            "preferences": {},
            "clusters": [
                {
                    "name": CLUSTER_NAME,
                    "cluster": {
                        "server": self.url,
                        "certificate-authority-data": base64.b64encode(self.ca_cert.read_bytes()).decode(),
                    },
                }
            ],
            "users": [{"name": user, "user": {"token": token}}],
            "contexts": [{"name": CLUSTER_NAME, "context": {"cluster": CLUSTER_NAME, "user": user}}],
            "current-context": CLUSTER_NAME,
        }
        import yaml  # here, not at the top: `build` runs before the venv exists (Makefile, cluster-binary)

        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        path.chmod(0o600)


def _http_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=5) as reply:
        return json.loads(reply.read())


def _https_text(url: str) -> str:
    """GET a component's health endpoint; its certificate is an in-memory self-signed one, so unverified."""
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    with urllib.request.urlopen(url, timeout=5, context=context) as reply:
        return reply.read().decode()


# --- make cluster-up / cluster-down ---------------------------------------------------------
def _recorded() -> list[Component]:
    try:
        state = json.loads(CLI_STATE.read_text())
    except (OSError, ValueError):
        return []
    return [Component.from_record(record) for record in state.get("components", [])]


def cluster_up() -> int:
    running = [c for c in _recorded() if c.alive()]
    if running:
        print(
            f"a control plane is already running ({', '.join(c.name for c in running)}); `make cluster-down` stops it"
        )
    else:
        cluster_down(quiet=True)  # whatever is left of a crashed one
        CLI_WORKDIR.mkdir(parents=True, exist_ok=True)
        cp = ControlPlane(CLI_WORKDIR)
        cp.start()
        CLI_STATE.write_text(json.dumps(cp.record(), indent=2) + "\n")
        CLI_KUBECONFIG.unlink(missing_ok=True)
        CLI_KUBECONFIG.symlink_to(cp.kubeconfig.relative_to(CACHE_DIR))
        print(f"control plane up at {cp.url} (logs: {cp.logs.relative_to(REPO)}/)")
    print(f"  export KUBECONFIG={CLI_KUBECONFIG}\n  {KUBECTL.relative_to(REPO)} get namespaces\n  make cluster-down")
    return 0


def cluster_down(*, quiet: bool = False) -> int:
    components = _recorded()
    for component in reversed(components):
        was_alive = component.alive()
        component.stop()
        if not quiet:
            print(f"{component.name} (pid {component.pid}): {'stopped' if was_alive else 'was not running'}")
    if not components and not quiet:
        print(f"no control plane recorded in {CLI_STATE.relative_to(REPO)}")
    CLI_STATE.unlink(missing_ok=True)
    CLI_KUBECONFIG.unlink(missing_ok=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.support.control_plane", description=__doc__.split("\n")[0])
    parser.add_argument(
        "command", choices=("build", "up", "down"), help="build the binary if stale | start the control plane | stop it"
    )
    args = parser.parse_args(argv)
    try:
        if args.command == "build":
            print(ensure_binary())
            return 0
        return cluster_up() if args.command == "up" else cluster_down()
    except ControlPlaneError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
