"""The objects a PolicyServer owns, kept in memory by watches, so that a reconcile pass at rest asks the API nothing.

A pass reads the PolicyServer, its claim, Jobs, StatefulSet, Services, budget
and pods.  Read from the API, that is about ten requests a pass whether
anything changed or not (and 404s for children that do not exist yet).  An
informer -- one LIST, then a WATCH from its resourceVersion, per kind and
namespace -- costs one long request per kind and namespace, renewed every
``WATCH_TIMEOUT_S``, however many passes and PolicyServers there are.

A store serves reads only once its first LIST is in; until then (the first
passes after start, a namespace seen for the first time) reads go to the API.
The operator's own writes are put in with the API's answer (write-through), so
the pass after a create never plans it again; a watch event older than what a
store holds (a lower resourceVersion) is dropped.  A watch the operator may not
open (403) is not asked again: reads of that kind keep going to the API.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

import kubernetes.client
import kubernetes.watch
import urllib3.exceptions
from kubernetes.dynamic.exceptions import DynamicApiError
from kubernetes.dynamic.resource import Resource

log = logging.getLogger(__name__)

WATCH_TIMEOUT_S: Final = 300  # the apiserver ends a watch after this; it is reopened from the last resourceVersion
RETRY_S: Final = 1.0  # after a watch or list failed (the apiserver restarting, 410 Gone): list again
FORBIDDEN: Final = (401, 403)


def resource_version(obj: Mapping[str, Any] | None) -> int:
    """The object's resourceVersion as a number (etcd's revision; 0 when absent or opaque)."""
    try:
        return int(((obj or {}).get("metadata") or {}).get("resourceVersion") or 0)
    except ValueError:
        return 0


def matches(obj: Mapping[str, Any], selector: Mapping[str, str]) -> bool:
    """Equality-based label selector, as ``Kube.list`` writes them."""
    labels = (obj.get("metadata") or {}).get("labels") or {}
    return all(labels.get(k) == v for k, v in selector.items())


class Store:
    """The objects of one kind in one namespace, by name."""

    def __init__(self) -> None:
        self._objects: dict[str, dict[str, Any]] = {}
        self._gone: dict[str, int] = {}  # name -> resourceVersion at deletion: older events of it are stale
        self._lock = threading.Lock()
        self.synced = threading.Event()

    def replace(self, items: Iterable[dict[str, Any]]) -> None:
        with self._lock:
            self._objects = {o["metadata"]["name"]: o for o in items}
            self._gone.clear()
        self.synced.set()

    def put(self, obj: dict[str, Any]) -> None:
        """Keep ``obj`` unless a newer version of it (or its deletion) is already known."""
        name, version = obj["metadata"]["name"], resource_version(obj)
        with self._lock:
            if version and (version <= self._gone.get(name, 0) or version < resource_version(self._objects.get(name))):
                return
            self._gone.pop(name, None)
            self._objects[name] = obj

    def remove(self, name: str, version: int) -> None:
        with self._lock:
            current = self._objects.get(name)
            if current is not None and version and version < resource_version(current):
                return
            self._objects.pop(name, None)
            self._gone[name] = max(version, resource_version(current), self._gone.get(name, 0))

    def get(self, name: str) -> dict[str, Any] | None:
        with self._lock:
            return self._objects.get(name)

    def list(self, selector: Mapping[str, str]) -> list[dict[str, Any]]:
        with self._lock:
            return [o for o in self._objects.values() if matches(o, selector)]


class Informer:
    """A store per (kind, namespace), each filled by a LIST and kept current by a WATCH in a thread of its own.

    ``resource`` finds the dynamic client's Resource of a kind (``Kube`` owns
    discovery).  Stores start on first use: ``store()`` returns None until the
    first LIST of that kind and namespace is in.
    """

    def __init__(self, resource: Callable[[str], Resource], kinds: Iterable[str]) -> None:
        self._resource = resource
        self.kinds = frozenset(kinds)
        self._stores: dict[tuple[str, str], Store] = {}
        self._refused: set[tuple[str, str]] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._watchers: list[kubernetes.watch.Watch] = []

    def store(self, kind: str, namespace: str) -> Store | None:
        """The synced store of ``kind`` in ``namespace``; None (read the API) while it fills or may not exist."""
        if kind not in self.kinds or not namespace or self._stop.is_set():
            return None
        key = (kind, namespace)
        with self._lock:
            if key in self._refused:
                return None
            store = self._stores.get(key)
            if store is None:
                store = self._stores[key] = Store()
                threading.Thread(
                    target=self._run, args=(kind, namespace, store), daemon=True, name=f"informer-{kind}-{namespace}"
                ).start()
        return store if store.synced.is_set() else None

    def put(self, kind: str, namespace: str, obj: dict[str, Any] | None) -> None:
        """Write-through: the API's answer to one of the operator's own writes."""
        store = self._stores.get((kind, namespace))
        if store is not None and obj and (obj.get("metadata") or {}).get("name"):
            store.put(obj)

    def forget(self, kind: str, namespace: str, name: str, answer: Mapping[str, Any] | None) -> None:
        """An object the operator deleted: gone from the store now, whatever the watch says later about older
        versions of it (an object with finalizers comes back through the watch, with its deletionTimestamp)."""
        store = self._stores.get((kind, namespace))
        if store is not None:
            store.remove(name, resource_version(answer))

    def stop(self) -> None:
        self._stop.set()
        for watcher in list(self._watchers):
            watcher.stop()

    def _run(self, kind: str, namespace: str, store: Store) -> None:
        watcher = kubernetes.watch.Watch()
        self._watchers.append(watcher)
        while not self._stop.is_set():
            try:
                resource = self._resource(kind)
                listed = resource.get(namespace=namespace, serialize=False, _request_timeout=(5.0, 60.0))
                body = _json(listed)
                version = str((body.get("metadata") or {}).get("resourceVersion") or "")
                items = body.get("items") or []
                for item in items:  # a list's items lack them; a watch event's object has them
                    item.setdefault("apiVersion", resource.group_version)
                    item.setdefault("kind", resource.kind)
                store.replace(items)
                while not self._stop.is_set():
                    version = self._watch(watcher, resource, namespace, version, store)
            except (DynamicApiError, kubernetes.client.ApiException) as exc:
                if int(getattr(exc, "status", 0) or 0) in FORBIDDEN:
                    log.warning(
                        "not watching %s in %s (%s): reading them from the API on every pass",
                        kind,
                        namespace,
                        getattr(exc, "reason", exc),
                    )
                    with self._lock:
                        self._refused.add((kind, namespace))
                        self._stores.pop((kind, namespace), None)
                    return
                log.debug("watch of %s in %s ended: %s", kind, namespace, exc)
            except (urllib3.exceptions.HTTPError, OSError, ValueError, KeyError) as exc:
                log.debug("watch of %s in %s failed: %s", kind, namespace, exc)
            store.synced.clear()  # until the next LIST: events may have been missed
            self._stop.wait(RETRY_S)

    def _watch(
        self, watcher: kubernetes.watch.Watch, resource: Resource, namespace: str, version: str, store: Store
    ) -> str:
        """One WATCH from ``version`` until the apiserver ends it; the last resourceVersion seen."""
        for event in watcher.stream(
            resource.get,
            namespace=namespace,
            resource_version=version,
            allow_watch_bookmarks=True,
            timeout_seconds=WATCH_TIMEOUT_S,
            _request_timeout=(5.0, WATCH_TIMEOUT_S + 30.0),
            serialize=False,
            deserialize=False,
        ):
            kind, obj = event.get("type"), event.get("object") or {}
            if kind == "ERROR":
                raise kubernetes.client.ApiException(status=int(obj.get("code") or 0), reason=obj.get("message"))
            version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
            if kind == "BOOKMARK":
                continue
            if kind == "DELETED":
                store.remove(obj["metadata"]["name"], resource_version(obj))
            else:
                store.put(obj)
            if self._stop.is_set():
                break
        return version


def _json(response: Any) -> dict[str, Any]:
    import json

    with contextlib.suppress(AttributeError):
        response = response.data
    return dict(json.loads(response))
