"""A small dict-in, dict-out client for the few kinds the operator touches.

The ``kubernetes`` package's typed models drop fields they do not know and
turn camelCase into snake_case; the reconciler compares and builds plain
manifests, so it talks JSON through the client's ``ApiClient`` (which keeps
authentication, in-cluster token refresh and TLS) instead.  Errors are
sorted into the two kinds the handlers treat differently: transient ones
(retry with backoff) and rejections (report in status, do not hammer).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import kubernetes.client
import kubernetes.config
import urllib3.exceptions

from policy_operator.constants import API_VERSION, PLURAL

MERGE_PATCH = "application/merge-patch+json"
JSON_PATCH = "application/json-patch+json"
REQUEST_TIMEOUT = (5.0, 30.0)  # connect, read


@dataclass(frozen=True)
class Kind:
    api: str  # "/api/v1" or "/apis/apps/v1"
    plural: str


KINDS: dict[str, Kind] = {
    "PersistentVolumeClaim": Kind("/api/v1", "persistentvolumeclaims"),
    "Service": Kind("/api/v1", "services"),
    "Pod": Kind("/api/v1", "pods"),
    "Job": Kind("/apis/batch/v1", "jobs"),
    "StatefulSet": Kind("/apis/apps/v1", "statefulsets"),
    "PolicyServer": Kind(f"/apis/{API_VERSION}", PLURAL),
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


class AlreadyExists(KubeError):
    """409 on create: someone (maybe an earlier life of this operator) created it first."""


def _message(status: int, data: bytes) -> str:
    try:
        body = json.loads(data)
        return str(body.get("message") or body)
    except ValueError:
        return data.decode("utf-8", "replace")[:500] or f"HTTP {status}"


class KubeClient:
    def __init__(self, api_client: kubernetes.client.ApiClient) -> None:
        self.api_client = api_client

    @classmethod
    def from_environment(cls) -> KubeClient:
        """In-cluster service account when there is one, else $KUBECONFIG / ~/.kube/config (like kopf's own login)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        return cls(kubernetes.client.ApiClient())

    def close(self) -> None:
        self.api_client.close()

    # --- raw ------------------------------------------------------------------------------

    def request(self, method: str, path: str, body: Any = None, *, content_type: str = "application/json",
                query: Mapping[str, str] | None = None) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = content_type
        try:
            _, url, headers, body, _ = self.api_client.param_serialize(
                method=method, resource_path=path, query_params=list((query or {}).items()), header_params=headers,
                body=body, auth_settings=["BearerToken"])
            response = self.api_client.call_api(method, url, header_params=headers, body=body,
                                                _request_timeout=REQUEST_TIMEOUT)
            response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise TransientError(f"{method} {path}: {exc}") from exc
        status, data = response.status, response.data or b""
        if 200 <= status < 300:
            return json.loads(data) if data else None
        message = f"{method} {path}: {status} {_message(status, data)}"
        if status == 404:
            raise NotFound(message, status)
        if status == 409 and method == "POST":
            raise AlreadyExists(message, status)
        if status in (409, 429) or status >= 500:
            raise TransientError(message, status)
        raise Rejected(message, status)

    @staticmethod
    def path(kind: str, namespace: str | None, name: str | None = None, subresource: str | None = None) -> str:
        k = KINDS[kind]
        path = k.api + (f"/namespaces/{namespace}" if namespace else "") + f"/{k.plural}"
        if name:
            path += f"/{name}"
        if subresource:
            path += f"/{subresource}"
        return path

    # --- verbs ------------------------------------------------------------------------------

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.request("GET", self.path(kind, namespace, name))
        except NotFound:
            return None

    def list(self, kind: str, namespace: str, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        query = {"labelSelector": ",".join(f"{k}={v}" for k, v in selector.items())} if selector else None
        return list(self.request("GET", self.path(kind, namespace), query=query).get("items") or [])

    def create(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj["metadata"]
        return self.request("POST", self.path(obj["kind"], meta["namespace"]), obj)

    def patch(self, kind: str, namespace: str, name: str, patch: Any, *, subresource: str | None = None,
              json_patch: bool = False) -> dict[str, Any]:
        return self.request("PATCH", self.path(kind, namespace, name, subresource), patch,
                            content_type=JSON_PATCH if json_patch else MERGE_PATCH)
