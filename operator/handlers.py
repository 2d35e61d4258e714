"""kopf wiring: which events start a reconcile pass, and how its failures are retried.

Thin on purpose: every handler calls :func:`reconcile.reconcile` for one
PolicyServer under that object's lock, so creation, updates, the periodic
resync and child events (a Job finished, a StatefulSet's pods changed) all
converge the same way.  Decisions live in the pure modules; this file only
maps outcomes onto kopf's retry semantics:

* an invalid spec -> ``kopf.PermanentError`` from change handlers (no retry
  storm; the next edit is a new change) and nothing from the timer;
* a transient API error -> ``kopf.TemporaryError`` with a delay;
* an object the API rejected -> recorded in status by the reconciler, retried
  by the timer at its normal pace.

Handlers are registered on an explicit registry by :func:`register`, so the
CLI and tests can run several independent operators in one process.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, cast

import kopf

from policy_operator.constants import (
    ANNOTATION_LAST_HANDLED,
    COMPONENT_FETCH,
    COMPONENT_SERVER,
    FINALIZER,
    GROUP,
    KIND,
    LABEL_COMPONENT,
    LABEL_MANAGED_BY,
    MANAGED_BY,
    PLURAL,
    VERSION,
)
from policy_operator.operator import conditions
from policy_operator.operator.kube import Kube, KubeError, TransientError
from policy_operator.operator.rank_probe import PROBE_TIMEOUT_S
from policy_operator.operator.reconcile import Outcome, reconcile

Logger = logging.Logger | logging.LoggerAdapter[Any]  # what kopf hands its handlers
RETRY_DELAY_S = 5.0
DEFAULT_RESYNC_S = 10.0


@dataclass(frozen=True)
class OperatorConfig:
    resync_seconds: float = DEFAULT_RESYNC_S
    probe_timeout: float = PROBE_TIMEOUT_S
    retry_delay: float = RETRY_DELAY_S
    namespaced: bool = True  # a Role suffices: no namespace or CRD scanning


@dataclass
class Stats:
    """What the liveness probe reports."""

    passes: int = 0
    failures: int = 0
    last_pass: float = 0.0
    last_error: str = ""
    lock: threading.Lock = field(default_factory=threading.Lock)

    def as_dict(self) -> dict[str, Any]:
        return {
            "passes": self.passes,
            "failures": self.failures,
            "secondsSinceLastPass": round(time.time() - self.last_pass, 1) if self.last_pass else None,
            "lastError": self.last_error,
        }


class _Lock:
    """A ``threading.Lock`` that can be weakly referenced (the built-in one cannot)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()


class ObjectLocks:
    """One lock per PolicyServer, so two handlers never reconcile the same object at once.

    Held in a weak dictionary: an entry lives only while some pass holds or
    waits for it, so the table does not grow with every PolicyServer that ever
    existed.
    """

    def __init__(self) -> None:
        self._locks: weakref.WeakValueDictionary[tuple[str, str], _Lock] = weakref.WeakValueDictionary()
        self._guard = threading.Lock()

    @contextlib.contextmanager
    def hold(self, namespace: str, name: str) -> Iterator[None]:
        with self._guard:
            entry = self._locks.get((namespace, name))
            if entry is None:
                entry = self._locks[(namespace, name)] = _Lock()
        with entry.lock:
            yield

    def __len__(self) -> int:
        return len(self._locks)


def configure_settings(settings: kopf.OperatorSettings, config: OperatorConfig) -> None:
    """kopf's state goes to our own annotations (status belongs to the CRD schema) and Events say who we are."""
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=GROUP)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(
        prefix=GROUP, key=ANNOTATION_LAST_HANDLED.split("/", 1)[1]
    )
    settings.posting.reporting_component = MANAGED_BY
    settings.posting.level = logging.WARNING
    settings.execution.max_workers = 16
    settings.scanning.disabled = config.namespaced
    settings.batching.error_delays = (1, 2, 5, 10, 20, 30)
    # A PolicyServer deleted while its (synchronous) resync timer runs must not wait
    # kopf's default 60 s to notice the timer ended before the finalizer is released.
    settings.background.cancellation_polling = 0.5


def _post(owner: dict[str, Any], event: conditions.Event) -> None:
    kopf.event(kopf.Body(cast(kopf.RawBody, owner)), type=event.type, reason=event.reason, message=event.message)


def _owner_name(body: kopf.Body) -> str | None:
    for ref in body.metadata.get("ownerReferences") or []:
        if ref.get("kind") == KIND and ref.get("apiVersion", "").startswith(f"{GROUP}/") and ref.get("controller"):
            return ref.get("name")
    return None


class Reconciler:
    """What every handler shares: the API client (made on first use), one lock per PolicyServer, the liveness
    counts, and the pass itself with kopf's retry semantics for its failures."""

    def __init__(self, config: OperatorConfig, kube_factory: Callable[[], Kube]) -> None:
        self.config, self._kube_factory = config, kube_factory
        self.locks = ObjectLocks()
        self.stats = Stats()
        self.clients: list[Kube] = []

    def kube(self) -> Kube:
        if not self.clients:
            self.clients.append(self._kube_factory())
        return self.clients[0]

    def run(self, namespace: str | None, name: str | None, logger: Logger) -> Outcome | None:
        assert namespace and name, "PolicyServers are namespaced"
        with self.locks.hold(namespace, name):
            try:
                outcome = reconcile(
                    self.kube(), namespace, name, post_event=_post, probe_timeout=self.config.probe_timeout
                )
            except TransientError as exc:
                self._failed(exc)
                raise kopf.TemporaryError(
                    f"transient API error, retrying: {exc}", delay=self.config.retry_delay
                ) from exc
            except KubeError as exc:
                self._failed(exc)
                raise kopf.TemporaryError(f"API error: {exc}", delay=self.config.retry_delay * 6) from exc
        with self.stats.lock:
            self.stats.passes += 1
            self.stats.last_pass = time.time()
        if outcome is not None:
            logger.debug(f"reconciled: phase={outcome.status.phase} ready={outcome.status.ready}")
        return outcome

    def _failed(self, exc: Exception) -> None:
        with self.stats.lock:
            self.stats.failures += 1
            self.stats.last_error = str(exc)

    def seen(self, kind: str, namespace: str | None, body: kopf.Body) -> None:
        """What kopf's watch just delivered is at least as new as the operator's own watch of it."""
        client = self.kube()
        if client.informer is not None and namespace:
            client.informer.put(kind, namespace, copy.deepcopy(dict(cast(dict[str, Any], body))))


def register(
    registry: kopf.OperatorRegistry, config: OperatorConfig, kube_factory: Callable[[], Kube] = Kube.from_environment
) -> None:
    """Register the operator's handlers on ``registry``: each is a line or two over one ``Reconciler``."""
    reconciler = Reconciler(config, kube_factory)
    run, seen = reconciler.run, reconciler.seen

    @kopf.on.login(registry=registry)
    def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
        """The same credentials as Kube: in-cluster service account, else the kubeconfig."""
        return kopf.login_via_client(**kwargs)

    @kopf.on.startup(registry=registry)
    def startup(settings: kopf.OperatorSettings, logger: Logger, **_: Any) -> None:
        configure_settings(settings, config)
        reconciler.kube()
        logger.info(f"policy-operator reconciling {PLURAL}.{GROUP}/{VERSION} every {config.resync_seconds}s")

    @kopf.on.cleanup(registry=registry)
    def cleanup(**_: Any) -> None:
        for client in reconciler.clients:
            client.close()

    @kopf.on.resume(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")
    @kopf.on.create(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")
    @kopf.on.update(GROUP, VERSION, PLURAL, registry=registry, id="reconcile")
    def on_change(namespace: str | None, name: str, body: kopf.Body, logger: Logger, **_: Any) -> None:
        seen(KIND, namespace, body)
        outcome = run(namespace, name, logger)
        if outcome is not None and outcome.spec_error is not None:
            raise kopf.PermanentError(f"invalid spec: {outcome.spec_error}")

    @kopf.timer(GROUP, VERSION, PLURAL, interval=config.resync_seconds, registry=registry, id="resync")
    def resync(namespace: str | None, name: str, logger: Logger, **_: Any) -> None:
        run(namespace, name, logger)  # an invalid spec was reported by on_change; no retry storm here

    def on_child(body: kopf.Body, namespace: str | None, logger: Logger, type: str, **_: Any) -> None:
        owner = _owner_name(body)
        if owner and type:  # no type: the initial listing, which the resume handlers cover
            if type != "DELETED":
                seen(str(body.get("kind")), namespace, body)
            run(namespace, owner, logger)

    kopf.on.event(
        "batch",
        "v1",
        "jobs",
        labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: COMPONENT_FETCH},
        registry=registry,
        id="fetch-job",
    )(on_child)
    kopf.on.event(
        "apps",
        "v1",
        "statefulsets",
        labels={LABEL_MANAGED_BY: MANAGED_BY, LABEL_COMPONENT: COMPONENT_SERVER},
        registry=registry,
        id="statefulset",
    )(on_child)

    @kopf.on.probe(id="reconciler", registry=registry)
    def reconciler_probe(**_: Any) -> dict[str, Any]:
        with reconciler.stats.lock:
            return reconciler.stats.as_dict()
