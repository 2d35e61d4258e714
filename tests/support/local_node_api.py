"""Plain-dict access to a real Kubernetes API for the local node and the cluster tests.

The kubelet stand-in (``local_node``) and the tests read and write a handful
of kinds by ``(group_version, plural)``; the installed client's
``DynamicClient`` does the work (discovery, serialization, watches, the
status subresource), and this wrapper only turns its answers into dicts and
its 404s into ``None``, so a test reads as ``api.get("v1", "pods", name, ns)``.
Every other error stays ``kubernetes.client.ApiException`` (the dynamic
client's errors subclass it).
"""

from __future__ import annotations

import builtins
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import kubernetes.client
import kubernetes.config
import kubernetes.watch
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import NotFoundError
from kubernetes.dynamic.resource import Resource

from .net import wait_for

STRATEGIC = "application/strategic-merge-patch+json"
MERGE = "application/merge-patch+json"
TIMEOUT = (5.0, 30.0)  # connect, read: an API call that hangs is a failure, not a stuck test


class Api:
    """get / list / create / patch / patch_status / delete / watch / events, on plain dicts."""

    def __init__(self, kubeconfig: str | Path, *, connections: int = 32) -> None:
        self.kubeconfig = Path(kubeconfig)
        configuration = kubernetes.client.Configuration()
        kubernetes.config.load_kube_config(config_file=str(kubeconfig), client_configuration=configuration)
        configuration.connection_pool_maxsize = connections  # watches hold connections; the node runs several
        self.api_client = kubernetes.client.ApiClient(configuration)
        self.dynamic = DynamicClient(self.api_client)
        self._resources: dict[tuple[str, str], Resource] = {}

    def close(self) -> None:
        self.api_client.close()

    def resource(self, group_version: str, plural: str) -> Resource:
        key = (group_version, plural)
        if key not in self._resources:
            self._resources[key] = self.dynamic.resources.get(api_version=group_version, name=plural)
        return self._resources[key]

    # --- reads ---------------------------------------------------------------------------------

    def get(self, group_version: str, plural: str, name: str, namespace: str | None = None) -> dict[str, Any] | None:
        try:
            return (
                self.resource(group_version, plural)
                .get(name=name, namespace=namespace, _request_timeout=TIMEOUT)
                .to_dict()
            )
        except NotFoundError:
            return None

    def existing(self, group_version: str, plural: str, name: str, namespace: str | None = None) -> dict[str, Any]:
        """``get``, for an object the caller expects to exist (an AssertionError naming it when it does not)."""
        obj = self.get(group_version, plural, name, namespace)
        assert obj is not None, f"no {group_version} {plural} {name}" + (f" in {namespace}" if namespace else "")
        return obj

    def list(
        self,
        group_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        label_selector: str | None = None,
        field_selector: str | None = None,
    ) -> list[dict[str, Any]]:
        found = self.resource(group_version, plural).get(
            namespace=namespace, label_selector=label_selector, field_selector=field_selector, _request_timeout=TIMEOUT
        )
        return list(found.to_dict().get("items") or [])

    def events(self, namespace: str, *, involved_name: str | None = None) -> builtins.list[dict[str, Any]]:
        """core/v1 Events (what kopf and the controllers post), oldest first."""
        selector = f"involvedObject.name={involved_name}" if involved_name else None
        items = self.list("v1", "events", namespace, field_selector=selector)
        return sorted(items, key=lambda e: e.get("lastTimestamp") or e.get("eventTime") or "")

    def wait_event(
        self, namespace: str, involved_name: str, type_: str, reason: str, *, message: str = "", timeout: float = 30.0
    ) -> dict[str, Any]:
        """The first Event of ``type_``/``reason`` (its message containing ``message``) about ``involved_name``.

        kopf posts Events from its own queue, after the status patch of the
        same pass: a test that saw the status must still wait for the Event.
        """

        def found() -> dict[str, Any] | None:
            return next(
                (
                    e
                    for e in self.events(namespace, involved_name=involved_name)
                    if e.get("type") == type_ and e.get("reason") == reason and message in (e.get("message") or "")
                ),
                None,
            )

        return wait_for(found, timeout, what=f"a {type_} {reason} Event about {involved_name}")

    def watch(
        self,
        group_version: str,
        plural: str,
        namespace: str | None = None,
        *,
        field_selector: str | None = None,
        label_selector: str | None = None,
        timeout_s: int = 30,
    ) -> Iterator[tuple[str, dict[str, Any]]]:
        """(type, object) until the server ends the watch after ``timeout_s`` (the caller loops)."""
        for event in self.dynamic.watch(
            self.resource(group_version, plural),
            namespace=namespace,
            field_selector=field_selector,
            label_selector=label_selector,
            timeout=timeout_s,
            watcher=kubernetes.watch.Watch(),
        ):
            yield event["type"], event["raw_object"]

    # --- writes --------------------------------------------------------------------------------

    def create(
        self, group_version: str, plural: str, body: Mapping[str, Any], namespace: str | None = None
    ) -> dict[str, Any]:
        return (
            self.resource(group_version, plural)
            .create(body=dict(body), namespace=namespace, _request_timeout=TIMEOUT)
            .to_dict()
        )

    def patch(
        self,
        group_version: str,
        plural: str,
        name: str,
        patch: Mapping[str, Any],
        namespace: str | None = None,
        *,
        content_type: str = MERGE,
    ) -> dict[str, Any]:
        return (
            self.resource(group_version, plural)
            .patch(
                body=dict(patch), name=name, namespace=namespace, content_type=content_type, _request_timeout=TIMEOUT
            )
            .to_dict()
        )

    def patch_status(
        self,
        group_version: str,
        plural: str,
        name: str,
        status: Mapping[str, Any],
        namespace: str | None = None,
        *,
        content_type: str = STRATEGIC,
        uid: str | None = None,
    ) -> dict[str, Any]:
        """Through the status subresource; strategic merge keeps conditions others wrote (merged by type).

        ``uid`` in the patch is a precondition, as the kubelet sends it: the status of a pod never lands
        on a newer pod of the same name (409 instead).
        """
        body: dict[str, Any] = {"status": dict(status)}
        if uid is not None:
            body["metadata"] = {"uid": uid}
        resource = self.resource(group_version, plural).subresources["status"]
        return resource.patch(
            body=body, name=name, namespace=namespace, content_type=content_type, _request_timeout=TIMEOUT
        ).to_dict()

    def token(
        self,
        namespace: str,
        service_account: str,
        *,
        audiences: builtins.list[str],
        expiration_s: int,
        pod: tuple[str, str] | None = None,
    ) -> str:
        """A ServiceAccount token from the TokenRequest API, bound to a pod (name, uid) as the kubelet asks for."""
        spec: dict[str, Any] = {"audiences": audiences, "expirationSeconds": expiration_s}
        if pod is not None:
            spec["boundObjectRef"] = {"apiVersion": "v1", "kind": "Pod", "name": pod[0], "uid": pod[1]}
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": spec}
        resource = self.resource("v1", "serviceaccounts").subresources["token"]
        answer = resource.create(body=body, name=service_account, namespace=namespace, _request_timeout=TIMEOUT)
        return str(answer.to_dict()["status"]["token"])

    def delete(
        self,
        group_version: str,
        plural: str,
        name: str,
        namespace: str | None = None,
        *,
        grace_period: int | None = None,
        uid: str | None = None,
    ) -> bool:
        """False when it was already gone; ``uid`` is a precondition (the kubelet's, so a new pod of the same
        name is never deleted by mistake)."""
        body: dict[str, Any] = {"apiVersion": "v1", "kind": "DeleteOptions"}
        if grace_period is not None:
            body["gracePeriodSeconds"] = grace_period
        if uid is not None:
            body["preconditions"] = {"uid": uid}
        try:
            self.resource(group_version, plural).delete(
                name=name, namespace=namespace, body=body, _request_timeout=TIMEOUT
            )
        except NotFoundError:
            return False
        return True
