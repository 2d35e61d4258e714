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

import copy
import hashlib
import json
import threading
from collections.abc import Iterable, Mapping
from typing import Any, Final

import kubernetes.client
import kubernetes.config
import urllib3.exceptions
from kubernetes.client import V1ManagedFieldsEntry
from kubernetes.dynamic import DynamicClient
from kubernetes.dynamic.exceptions import DynamicApiError, ResourceNotFoundError
from kubernetes.dynamic.resource import Resource

from policy_operator.constants import ANNOTATION_APPLIED_HASH, API_VERSION, FIELD_MANAGER
from policy_operator.operator.informer import Informer, Store
from policy_operator.operator.kube_objects import typed_list

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
    "Secret": "v1",  # create only: a PolicyServer's compile key (never read, listed or changed)
}


class KubeError(RuntimeError):
    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status


class TransientError(KubeError):
    """Connection trouble, 429, 5xx, or a write conflict: the same call may work a moment later."""


class Rejected(KubeError):
    """The API server refused the request (400/403/422, a 500 about the body...): repeating it unchanged will not
    help."""


class NotFound(KubeError):
    """404."""


# 500s about the request itself, not the server's state: server-side apply could not build a typed object from the
# body (a duplicate key of a list map such as env or topologySpreadConstraints, a field the schema lacks).  The same
# body gets the same answer every time, so retrying it is a loop, not a recovery.
PERMANENT_SERVER_ERRORS = (
    "failed to create typed patch object",
    "failed to create typed live object",
    "duplicate entries for key",
    "field not declared in schema",
)


def is_transient(status: int, message: str) -> bool:
    """Whether the same request may succeed later: connection trouble, a conflict, throttling, an overloaded server.

    Every other answer (4xx, and the 500s of :data:`PERMANENT_SERVER_ERRORS`) is a rejection of the request.
    """
    if status in (409, 429):
        return True
    return status >= 500 and not any(m in message for m in PERMANENT_SERVER_ERRORS)


def _sorted_error(what: str, exc: Exception) -> KubeError:
    if isinstance(exc, DynamicApiError):
        status = int(exc.status or 0)
        message = f"{what}: {status} {exc.summary()}"
        if status == 404:
            return NotFound(message, status)
        if is_transient(status, message):
            return TransientError(message, status)
        return Rejected(message, status)
    if isinstance(exc, ResourceNotFoundError):  # the CRD is not (yet) served: installing it fixes this
        return TransientError(f"{what}: {exc}")
    return TransientError(f"{what}: {exc}")


# The kinds a pass reads by name or label, served from watches (operator/informer.py) instead of a request each
CACHED_KINDS: Final = (
    "PolicyServer",
    "PersistentVolumeClaim",
    "Job",
    "StatefulSet",
    "Service",
    "PodDisruptionBudget",
    "Pod",
)
POOL_SIZE: Final = 32
# managedFields entries that are not a hand edit of what the operator applies
OWN_SUBRESOURCES: Final = ("status", "scale")


def applied_hash(body: Mapping[str, Any]) -> str:
    """A hash of the body the operator applies (without this very annotation)."""
    meta = dict(body.get("metadata") or {})
    meta["annotations"] = {k: v for k, v in (meta.get("annotations") or {}).items() if k != ANNOTATION_APPLIED_HASH}
    text = json.dumps({**body, "metadata": meta}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def with_applied_hash(body: Mapping[str, Any]) -> dict[str, Any]:
    meta = dict(body["metadata"])
    meta["annotations"] = {**(meta.get("annotations") or {}), ANNOTATION_APPLIED_HASH: applied_hash(body)}
    return {**body, "metadata": meta}


def foreign_managers(entries: Iterable[V1ManagedFieldsEntry] | None, *path: str) -> list[str]:
    """Field managers other than the operator that own fields of an object under ``path`` (``"spec", "template"``;
    none: anywhere in the object), leaving out the status and scale subresources' writers.  ``entries``: the
    object's ``metadata.managedFields``.

    Server-side apply takes back the fields the operator sets, but leaves those it never set and another manager
    added (``kubectl set env`` adds an env entry owned by ``kubectl-set``): managedFields says who wrote them.
    ``unchanged`` asks about the whole object, ``drift.py`` about the parts it puts back.
    """
    found = set()
    for entry in entries or []:
        if entry.manager == FIELD_MANAGER or entry.subresource in OWN_SUBRESOURCES:
            continue
        node: Any = entry.fields_v1 or {}
        for part in path:
            node = node.get(f"f:{part}") if isinstance(node, dict) else None
        if node:
            found.add(str(entry.manager))
    return sorted(found)


def unchanged(current: Mapping[str, Any] | None, body: Mapping[str, Any]) -> bool:
    """Whether applying ``body`` (stamped by :func:`with_applied_hash`) would change nothing: the object carries the
    same hash, and no other manager edited it since (a hand edit makes its author a manager, and an apply puts back
    what the operator owns)."""
    if current is None or (current.get("metadata") or {}).get("deletionTimestamp"):
        return False
    want = ((body.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED_HASH)
    have = ((current.get("metadata") or {}).get("annotations") or {}).get(ANNOTATION_APPLIED_HASH)
    managed = typed_list(V1ManagedFieldsEntry, (current.get("metadata") or {}).get("managedFields") or [])
    return bool(want) and want == have and not foreign_managers(managed)


class Kube:
    """get / list / apply / merge-patch on plain dicts, with one field manager for everything applied.

    With ``cached`` kinds, reads of those come from an :class:`Informer` once
    it has listed them, every write's answer goes into it, and an apply whose
    object already carries its body (``unchanged``) is not sent at all: a pass
    over a PolicyServer at rest makes no request.
    """

    def __init__(self, api_client: kubernetes.client.ApiClient, *, cached: tuple[str, ...] = ()) -> None:
        self.api_client = api_client
        self._dynamic: DynamicClient | None = None
        self._resources: dict[str, Resource] = {}
        self._discovery_lock = threading.Lock()
        self.informer = Informer(self._resource, cached) if cached else None

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster service account when there is one, else $KUBECONFIG / ~/.kube/config (like kopf's own login)."""
        try:
            kubernetes.config.load_incluster_config()
        except kubernetes.config.ConfigException:
            kubernetes.config.load_kube_config()
        configuration = kubernetes.client.Configuration.get_default_copy()
        # a watch holds a connection for minutes: room for every informer's and every handler thread's
        configuration.connection_pool_maxsize = max(configuration.connection_pool_maxsize or 0, POOL_SIZE)
        return cls(kubernetes.client.ApiClient(configuration), cached=CACHED_KINDS)

    def close(self) -> None:
        if self.informer is not None:
            self.informer.stop()
        self.api_client.close()

    def _store(self, kind: str, namespace: str) -> Store | None:
        return self.informer.store(kind, namespace) if self.informer is not None else None

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
        store = self._store(kind, namespace)
        if store is not None:
            return copy.deepcopy(store.get(name))
        try:
            return self._call(
                f"get {kind} {namespace}/{name}", self._resource(kind).get, name=name, namespace=namespace or None
            )
        except NotFound:
            return None

    def delete(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        """Delete one object (background propagation); None when it was already gone."""
        try:
            answer = self._call(
                f"delete {kind} {namespace}/{name}",
                self._resource(kind).delete,
                name=name,
                namespace=namespace,
                body={"propagationPolicy": "Background"},
            )
        except NotFound:
            answer = None
        if self.informer is not None:
            self.informer.forget(kind, namespace, name, answer)
        return answer

    def list(
        self, kind: str, namespace: str, selector: Mapping[str, str], fields: Mapping[str, str] | None = None
    ) -> list[dict[str, Any]]:
        """Objects matching labels ``selector`` and, optionally, field selector ``fields`` (Events: involvedObject...)."""
        store = None if fields else self._store(kind, namespace)
        if store is not None:
            return copy.deepcopy(store.list(selector))
        label_selector = ",".join(f"{k}={v}" for k, v in selector.items()) or None
        field_selector = ",".join(f"{k}={v}" for k, v in (fields or {}).items()) or None
        found = self._call(
            f"list {kind} in {namespace}",
            self._resource(kind).get,
            namespace=namespace,
            label_selector=label_selector,
            field_selector=field_selector,
        )
        return list(found.get("items") or [])

    # --- writes -----------------------------------------------------------------------------

    def apply(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """Server-side apply as the operator's field manager, taking back any field a hand edit changed; not sent
        when the watched object already is what it would make (``unchanged``)."""
        body, meta = with_applied_hash(obj), obj["metadata"]
        kind, namespace, name = obj["kind"], meta["namespace"], meta["name"]
        store = self._store(kind, namespace)
        current = store.get(name) if store is not None else None
        if current is not None and unchanged(current, body):
            return copy.deepcopy(current)
        answer: dict[str, Any] = self._call(
            f"apply {kind} {namespace}/{name}",
            self._resource(kind).server_side_apply,
            body=body,
            name=name,
            namespace=namespace,
            field_manager=FIELD_MANAGER,
            force_conflicts=True,
        )
        if self.informer is not None:
            self.informer.put(kind, namespace, answer)
        return answer

    def create(self, obj: Mapping[str, Any]) -> dict[str, Any]:
        """POST ``obj``, never overwriting: an object of that name already there is kept as it is. For what the
        operator may create but never read or change (a compile key Secret); the answer is not kept (it would
        hold the Secret's data)."""
        meta = obj["metadata"]
        kind, namespace, name = obj["kind"], meta["namespace"], meta["name"]
        try:
            self._call(
                f"create {kind} {namespace}/{name}", self._resource(kind).create, body=dict(obj), namespace=namespace
            )
        except TransientError as exc:
            if exc.status != 409:  # AlreadyExists: made by an earlier pass
                raise
            return {"kind": kind, "metadata": {"name": name, "namespace": namespace}, "existed": True}
        return {"kind": kind, "metadata": {"name": name, "namespace": namespace}}

    def merge_patch(
        self, kind: str, namespace: str, name: str, patch: Mapping[str, Any], *, subresource: str | None = None
    ) -> dict[str, Any]:
        """RFC 7386 merge patch (status, pod annotations): fields outside the patch stay as they are."""
        resource = self._resource(kind)
        target = resource.subresources[subresource] if subresource else resource
        answer: dict[str, Any] = self._call(
            f"patch {kind} {namespace}/{name}" + (f"/{subresource}" if subresource else ""),
            target.patch,
            body=dict(patch),
            name=name,
            namespace=namespace,
            content_type=MERGE_PATCH,
            field_manager=FIELD_MANAGER,
        )  # the operator's own: a template repair is no foreign owner
        if self.informer is not None:
            self.informer.put(kind, namespace, answer)
        return answer
