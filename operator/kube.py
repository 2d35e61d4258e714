"""The reconciler's one Kubernetes client: the installed client's ``DynamicClient``, errors sorted.

kopf watches, posts Events and keeps its own state on its asyncio session;
every read and write the reconciler makes goes through here, from kopf's
sync-handler threads.  The dynamic client keeps manifests as plain dicts
(the typed models drop fields they do not know and rename camelCase), finds
each kind through discovery, and speaks server-side apply, so the operator
states *what it wants* and the API server merges it with what other
managers (the StatefulSet controller, an HPA, a user) own.

Errors are sorted into the kinds the handlers treat differently: transient
ones (retry with backoff) and rejections (report in status, do not hammer).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

from policy_operator.constants import API_VERSION, FIELD_MANAGER

MERGE_PATCH = "application/merge-patch+json"
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read

# kind -> apiVersion of every kind the reconciler touches (operator/rbac.py grants exactly these)
KINDS: dict[str, str] = {
    "PersistentVolumeClaim": "v1",
    "Service": "v1",
    "Pod": "v1",
    "Job": "batch/v1",
    "StatefulSet": "apps/v1",
    "PolicyServer": API_VERSION,
    "Event": "v1",  # read only: the Job's and StatefulSet's FailedCreate (kopf posts the operator's own)
    "PodDisruptionBudget": "policy/v1",
    "StorageClass": "storage.k8s.io/v1",  # read only, cluster-scoped: allowVolumeExpansion
}


class KubeError(RuntimeError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class TransientError(KubeError):
    """Connection trouble, 429, 5xx, or a write conflict: the same call may work a moment later."""


class Rejected(KubeError):
    """The API server refused the request (400/403/422...): repeating it unchanged will not help."""


class NotFound(KubeError):
    """404."""


def _sorted_error(what: str, exc: Exception) -> KubeError:
    if isinstance(exc, DynamicApiError):
        status = int(exc.status or 0)
        message = f"{what}: {status} {exc.summary()}"
        if status == 404:
            return NotFound(message, status)
        if status in (409, 429) or status >= 500:
            return TransientError(message, status)
        return Rejected(message, status)
    if isinstance(exc, ResourceNotFoundError):  # the CRD is not (yet) served: installing it fixes this
        return TransientError(f"{what}: {exc}")
    return TransientError(f"{what}: {exc}")


class Kube:
    """get / list / apply / merge-patch on plain dicts, with one field manager for everything applied."""

    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client
        self._dynamic: DynamicClient | None = None
        self._resources: dict[str, Resource] = {}
        self._discovery_lock = threading.Lock()

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account when there is one, else $KUBECONFIG / ~/.kube/config (like kopf's own login)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(kubernetes.client.ApiClient())

    def close(self) -> None:
        self.api_client.close()

    def _resource(self, kind: str) -> Resource:
        """Discovery happens on first use (not at start-up), so an operator started before its CRD recovers.

        One thread at a time: the dynamic client's discoverer rebuilds a shared cache dict on a miss, and two
        kopf handler threads discovering at once (a create and the resync timer, right after start) made one
        fail with ``KeyError: 'resources'`` inside ``invalidate_cache``.
        """
        with self._discovery_lock:
            if kind not in self._resources:
                try:
                    if self._dynamic is None:
                        self._dynamic = DynamicClient(self.api_client)
                    self._resources[kind] = self._dynamic.resources.get(api_version=KINDS[kind], kind=kind)
                except (DynamicApiError, ResourceNotFoundError, urllib3.exceptions.HTTPError, OSError) as exc:
                    raise _sorted_error(f"discover {kind}", exc) from exc
            return self._resources[kind]

    def _call(self, what: str, method: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            result = method(*args, _request_timeout=REQUEST_TIMEOUT, **kwargs)
        except (DynamicApiError, urllib3.exceptions.HTTPError, OSError) as exc:
            raise _sorted_error(what, exc) from exc
        return result.to_dict() if result is not None else None

    # --- reads ------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """One object, or None; ``namespace`` "" for a cluster-scoped kind."""
        try:
            return self._call(f"get {kind} {namespace}/{name}", self._resource(kind).get, name=name,
                              namespace=namespace or None)
        except NotFound:
            return None

    def delete(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Delete one object (background propagation); None when it was already gone."""
        try:
            return self._call(f"delete {kind} {namespace}/{name}", self._resource(kind).delete, name=name,
                              namespace=namespace, body={"propagationPolicy": "Background"})
        except NotFound:
            return None

    def pod_log(self, namespace: str, name: str, container: str, *, tail_lines: int, limit_bytes: int,
                previous: bool = False) -> str:
        """The end of one container's log (``pods/log``): the one channel a pod without API access reports through."""
        what = f"read the log of Pod {namespace}/{name}"
        try:
            return str(kubernetes.client.CoreV1Api(self.api_client).read_namespaced_pod_log(
                name, namespace, container=container, tail_lines=tail_lines, limit_bytes=limit_bytes,
                previous=previous, _request_timeout=REQUEST_TIMEOUT))
        except kubernetes.client.ApiException as exc:
            status = int(exc.status or 0)
            kind = NotFound if status == 404 else TransientError if status in (409, 429) or status >= 500 else Rejected
            detail = str(exc.body or "")[:300]
            raise kind(f"{what}: {status} {exc.reason}" + (f": {detail}" if detail else ""), status) from exc
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"{what}: {exc}") from exc

    def list(self, kind: str, namespace: str, selector: Mapping[str, str],
             fields: Mapping[str, str] | None = None) -> list[dict[str, Any]]:
        """Objects matching labels ``selector`` and, optionally, field selector ``fields`` (Events: involvedObject...)."""
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items()) or None
        field_selector = ",".join(f"{k}={v}" for k, v in (fields or {}).items()) or None
        found = self._call(f"list {kind} in {namespace}", self._resource(kind).get, namespace=namespace,
                           label_selector=label_selector, field_selector=field_selector)
        return list(found.get("items") or [])

    # --- writes -----------------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking back any field a hand edit changed."""
        meta = obj["metadata"]
        return self._call(f"apply {obj['kind']} {meta['namespace']}/{meta['name']}",
                          self._resource(obj["kind"]).server_side_apply, body=dict(obj), name=meta["name"],
                          namespace=meta["namespace"], field_manager=FIELD_MANAGER, force_conflicts=True)

    def merge_patch(self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *,
                    subresource: str | None = None) -> dict[str, Any]:
        """RFC 7386 merge patch (status, pod annotations): fields outside the patch stay as they are."""
        resource = self._resource(kind)
        target = resource.subresources[subresource] if subresource else resource
        return self._call(f"patch {kind} {namespace}/{name}" + (f"/{subresource}" if subresource else ""),
                          target.patch, body=dict(patch), name=name, namespace=namespace, content_type=MERGE_PATCH,
                          field_manager=FIELD_MANAGER)  # the operator's own: a template repair is no foreign owner
