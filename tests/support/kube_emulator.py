"""A Kubernetes API server for tests: kmock's emulator made faithful, served on 127.0.0.1.

There is no real cluster here.  ``KubeEmulator`` runs ``kube_apiserver.ApiServer``
(a ``kmock.KubernetesEmulator`` subclass with kube-apiserver semantics) as an
HTTP server on a free loopback port, in its own thread and event loop, so
that real clients -- kubectl, the kopf operator, the ``kubernetes`` client,
the local node -- talk to it over HTTP exactly as they would to a cluster::

    from tests.support.kube_emulator import KubeEmulator

    with KubeEmulator() as kube:                      # or the `kube` fixture (kube_fixtures.py)
        kube.create_namespace("demo")
        kube.apply_crd("crds/policyservers.yaml")      # POSTs the CRD; its kind is served at once
        kube.kubectl("apply", "-f", "ps.yaml", "-n", "demo")   # real kubectl, own kubeconfig + cache
        ps = kube.get("policyoperator.io/v1alpha1", "policyservers", "demo-ps", "demo")   # None if absent
        kube.patch_status("batch/v1", "jobs", "fetch", {"succeeded": 1}, namespace="demo")
        pods = kube.list("v1", "pods", "demo", label_selector="app.kubernetes.io/name=policy-server")
        core = kubernetes.client.CoreV1Api(kube.api_client)   # typed client, same server

Resources are addressed as (group_version, plural): ``("v1", "pods")``,
``("apps/v1", "statefulsets")``.  Helper errors are the client's own
``kubernetes.client.ApiException`` (``.status``, ``.body`` holds the Status).

kopf: register ``kube.kopf_login(registry)`` (an ``@kopf.on.login`` returning
``kopf_connection_info(kube.url)``) and run ``kopf.testing.KopfRunner(["run",
"--standalone", "-A"], registry=registry)``; an operator in a subprocess gets
``env=kube.env`` (KUBECONFIG points at the emulator; kopf's default login
reads it).

kmock stays reachable: ``kube.api`` is the handler, so a test can inject faults
(``kube.api["get /api/v1/pods"] << 500``), assert on the requests it recorded
(``list(kube.api)``, ``kube.api["patch"]``, ``kube.api[kmock.resource("v1/pods")]``) or
inspect ``kube.api.objects[...]`` with its history.  Mutating ``kube.api``
from the test thread races the server thread; write through HTTP instead.

Internal errors of the emulator (a bug, not a 4xx answer) are kept in
``internal_errors``; the fixtures fail the test on them.  What is emulated and
what is not: docs/testing.md, section "Kubernetes API emulator".
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator
from functools import cached_property
from pathlib import Path
from typing import Any

import aiohttp.web
import kmock
import kopf
import kubernetes.client
import kubernetes.config
import yaml

from .kube_apiserver import ApiServer
from .kube_patches import JSON_PATCH, MERGE, STRATEGIC

KUBECTL = shutil.which("kubectl") or "/usr/bin/kubectl"
PATCH_TYPES = {"merge": MERGE, "json": JSON_PATCH, "strategic": STRATEGIC}
TOKEN = "kube-emulator"  # sent by clients, never checked: the emulator has no authn/authz


class KubectlError(subprocess.CalledProcessError):
    """kubectl exited non-zero; the message carries its stderr, which is where kubectl says why."""

    def __str__(self) -> str:
        return f"{super().__str__()}\nstdout: {self.stdout}\nstderr: {self.stderr}"


def api_path(
    group_version: str, plural: str, name: str | None = None, namespace: str | None = None, subresource: str | None = None
) -> str:
    """The REST path of a resource.

    ``api_path("apps/v1", "statefulsets", "s", "ns")`` is /apis/apps/v1/namespaces/ns/statefulsets/s.
    """
    if not group_version or not plural or group_version.count("/") > 1:
        raise ValueError(f"expected a group_version like 'v1' or 'apps/v1' and a plural, got {group_version!r}, {plural!r}")
    path = f"/api/{group_version}" if "/" not in group_version else f"/apis/{group_version}"
    if namespace:
        path += f"/namespaces/{namespace}"
    path += f"/{plural}"
    if name:
        path += f"/{name}"
    if subresource:
        path += f"/{subresource}"
    return path


def kopf_connection_info(url: str, namespace: str = "default") -> kopf.ConnectionInfo:
    """What an ``@kopf.on.login`` handler returns to point kopf at the emulator."""
    return kopf.ConnectionInfo(server=url, scheme="Bearer", token=TOKEN, default_namespace=namespace)


class KubeEmulator:
    """Start/stop the emulated API server and reach it: ``url``, ``kubeconfig``, ``kubectl()``, ``api_client``, helpers."""

    def __init__(
        self,
        workdir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        history_limit: int = 10_000,
        start_timeout: float = 10.0,
    ) -> None:
        self._own_workdir = workdir is None
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kube-emulator-"))
        self.host = host
        self.history_limit = history_limit
        self.start_timeout = start_timeout
        self.url = ""
        self.kubeconfig = self.workdir / "kubeconfig"
        self._api: ApiServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._failure: BaseException | None = None
        self._errors: list[Exception] | None = None

    # --- lifecycle ------------------------------------------------------------------------

    def __enter__(self) -> KubeEmulator:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    def start(self) -> KubeEmulator:
        if self._thread is not None:
            raise RuntimeError("this KubeEmulator was already started; make a new one")
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(self.start_timeout):
            raise TimeoutError(f"the Kubernetes emulator did not start within {self.start_timeout}s")
        if self._failure is not None:
            raise RuntimeError("the Kubernetes emulator failed to start") from self._failure
        self._write_kubeconfig()
        return self

    def stop(self) -> None:
        if self._thread is None or self._loop is None or self._stop is None:
            return
        if "api_client" in self.__dict__:
            self.api_client.close()
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(timeout=15)
        if self._thread.is_alive():
            raise RuntimeError("the Kubernetes emulator thread did not stop within 15s")
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to start(), which raises it in the test thread
            self._failure = exc
            self._ready.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        api = ApiServer(history_limit=self.history_limit)
        async with api:
            # Not kmock.Server: it also patches aiohttp's resolver process-wide, which breaks when
            # several emulators in several threads stop out of order; a plain aiohttp runner suffices.
            runner = aiohttp.web.ServerRunner(
                aiohttp.web.Server(api, handler_cancellation=True, access_log=None), shutdown_timeout=2.0
            )
            await runner.setup()
            site = aiohttp.web.TCPSite(runner, self.host, 0)
            await site.start()
            host, port = runner.addresses[0][:2]
            self.url = f"http://{host}:{port}"
            self._api = api
            self._ready.set()
            try:
                await self._stop.wait()
            finally:
                self._errors = list(api.errors)
                api.close()
                await runner.cleanup()

    def _write_kubeconfig(self) -> None:
        self.kubeconfig.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "current-context": "kube-emulator",
                    "clusters": [{"name": "kube-emulator", "cluster": {"server": self.url}}],
                    "users": [{"name": "kube-emulator", "user": {"token": TOKEN}}],
                    "contexts": [
                        {
                            "name": "kube-emulator",
                            "context": {"cluster": "kube-emulator", "user": "kube-emulator", "namespace": "default"},
                        }
                    ],
                }
            )
        )

    @property
    def api(self) -> ApiServer:
        """The kmock handler behind the server: reactions, ``requests``, ``objects``, ``resources``."""
        if self._api is None:
            raise RuntimeError("the Kubernetes emulator is not started")
        return self._api

    @property
    def internal_errors(self) -> list[Exception]:
        """Exceptions the emulator raised while serving that are not Kubernetes API errors (i.e. its own bugs)."""
        errors = self._errors if self._errors is not None else (self.api.errors if self._api is not None else [])
        return [e for e in errors if not isinstance(e, kmock.KubernetesError)]

    def raise_internal_errors(self) -> None:
        if self.internal_errors:
            raise AssertionError(
                f"the Kubernetes emulator failed internally: {self.internal_errors!r}"
            ) from self.internal_errors[0]

    @property
    def env(self) -> dict[str, str]:
        """Environment for subprocess clients (kubectl, ``kopf run``, helm): KUBECONFIG -> this emulator."""
        env = dict(os.environ)
        env.update(KUBECONFIG=str(self.kubeconfig), NO_PROXY="127.0.0.1,localhost", no_proxy="127.0.0.1,localhost")
        return env

    # --- clients ----------------------------------------------------------------------------

    def kubectl(
        self, *args: str, check: bool = True, input: str | None = None, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Run the real kubectl against the emulator with its own kubeconfig and discovery cache."""
        argv = [KUBECTL, f"--kubeconfig={self.kubeconfig}", f"--cache-dir={self.workdir / 'kubectl-cache'}", *args]
        proc = subprocess.run(argv, capture_output=True, text=True, input=input, timeout=timeout, env=self.env, check=False)
        if check and proc.returncode != 0:
            raise KubectlError(proc.returncode, argv, proc.stdout, proc.stderr)
        return proc

    @cached_property
    def api_client(self) -> kubernetes.client.ApiClient:
        """A ``kubernetes`` ApiClient configured from this emulator's kubeconfig (closed on stop)."""
        return kubernetes.config.new_client_from_config(config_file=str(self.kubeconfig))

    def kopf_login(self, registry: kopf.OperatorRegistry | None = None) -> None:
        """Register an ``@kopf.on.login`` handler (on ``registry`` or kopf's default one) that logs into this emulator."""
        url = self.url

        @kopf.on.login(registry=registry)
        def login_to_kube_emulator(**_: Any) -> kopf.ConnectionInfo:
            return kopf_connection_info(url)

    def request(
        self,
        method: str,
        path: str,
        body: Any = None,
        *,
        content_type: str = "application/json",
        params: dict[str, str] | None = None,
    ) -> Any:
        """One HTTP call through ``api_client``; returns the decoded JSON, raises ``ApiException`` on >= 400."""
        url = self.url + path + ("?" + urllib.parse.urlencode(params) if params else "")
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        response = self.api_client.call_api(method, url, header_params=headers, body=body, _request_timeout=30)
        response.read()
        if not 200 <= response.status < 300:
            kubernetes.client.ApiException.from_response(
                http_resp=response, body=response.data.decode("utf-8", "replace"), data=None
            )
            raise kubernetes.client.ApiException(http_resp=response)  # for statuses from_response does not map
        return json.loads(response.data) if response.data else None

    # --- object helpers ------------------------------------------------------------------------

    def create(self, group_version: str, plural: str, body: dict[str, Any], namespace: str | None = None) -> dict[str, Any]:
        return self.request("POST", api_path(group_version, plural, namespace=namespace), body)

    def get(self, group_version: str, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        """The object, or None when it does not exist (handy inside ``wait_for``)."""
        try:
            return self.request("GET", api_path(group_version, plural, name, namespace))
        except kubernetes.client.ApiException as exc:
            if exc.status == 404:
                return None
            raise

    def list(
        self,
        group_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        params = {k: v for k, v in (("labelSelector", label_selector), ("fieldSelector", field_selector)) if v}
        return self.request("GET", api_path(group_version, plural, namespace=namespace), params=params)["items"]

    def patch(
        self,
        group_version: str,
        plural: str,
        name: str,
        patch: Any,
        namespace: str | None = None,
        *,
        subresource: str | None = None,
        patch_type: str = "merge",
    ) -> dict[str, Any]:
        """PATCH with ``patch_type`` "merge" (RFC 7386), "json" (RFC 6902 ops) or "strategic" (built-ins only)."""
        if patch_type not in PATCH_TYPES:
            raise ValueError(f"patch_type must be one of {sorted(PATCH_TYPES)}, got {patch_type!r}")
        return self.request(
            "PATCH", api_path(group_version, plural, name, namespace, subresource), patch, content_type=PATCH_TYPES[patch_type]
        )

    def patch_status(
        self, group_version: str, plural: str, name: str, status: dict[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        """Merge ``status`` into the object's .status through the status subresource (what a controller or kubelet does)."""
        return self.patch(group_version, plural, name, {"status": status}, namespace, subresource="status")

    def replace(
        self,
        group_version: str,
        plural: str,
        body: dict[str, Any],
        namespace: str | None = None,
        *,
        subresource: str | None = None,
    ) -> dict[str, Any]:
        return self.request("PUT", api_path(group_version, plural, body["metadata"]["name"], namespace, subresource), body)

    def delete(
        self,
        group_version: str,
        plural: str,
        name: str,
        namespace: str | None = None,
        *,
        propagation: str = "Background",
        grace_period: int | None = None,
    ) -> dict[str, Any]:
        options: dict[str, Any] = {"kind": "DeleteOptions", "apiVersion": "v1", "propagationPolicy": propagation}
        if grace_period is not None:
            options["gracePeriodSeconds"] = grace_period
        return self.request("DELETE", api_path(group_version, plural, name, namespace), options)

    def create_namespace(self, name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
        return self.create("v1", "namespaces", {"metadata": {"name": name, "labels": labels or {}}})

    def apply_crd(self, path: str | os.PathLike[str]) -> list[dict[str, Any]]:
        """Create (or replace) every CustomResourceDefinition in a YAML file; their kinds are served on return."""
        docs = [doc for doc in yaml.safe_load_all(Path(path).read_text()) if doc]
        if not docs or any(doc.get("kind") != "CustomResourceDefinition" for doc in docs):
            raise ValueError(
                f"{path} must hold only CustomResourceDefinition documents, found kinds {[d.get('kind') for d in docs]}"
            )
        stored = []
        for doc in docs:
            existing = self.get("apiextensions.k8s.io/v1", "customresourcedefinitions", doc["metadata"]["name"])
            if existing is None:
                stored.append(self.create("apiextensions.k8s.io/v1", "customresourcedefinitions", doc))
            else:
                doc["metadata"]["resourceVersion"] = existing["metadata"]["resourceVersion"]
                stored.append(self.replace("apiextensions.k8s.io/v1", "customresourcedefinitions", doc))
        return stored

    def events(self, namespace: str | None = None, *, involved_name: str | None = None) -> Iterator[dict[str, Any]]:
        """core/v1 Events (what kopf posts with kopf.info/warn), optionally for one involved object."""
        selector = f"involvedObject.name={involved_name}" if involved_name else None
        yield from self.list("v1", "events", namespace, field_selector=selector)
