"""The observe step of a reconcile pass: read a PolicyServer's children and probe its pods' ranks.

Every pass reads the current state from the API instead of trusting the event
that woke it, which is what makes the operator level-triggered and
restart-safe: all names are deterministic, so a pass after a crash finds what
the previous one created.  Reads only; deciding is ``plan.py``/``status.py``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from policy_operator.constants import COMPONENT_FETCH, LABEL_CHECKPOINT_KEY
from policy_operator.operator import manifests, rank_probe
from policy_operator.operator.kube import Kube
from policy_operator.operator.manifests import Names
from policy_operator.operator.plan import Observed
from policy_operator.operator.rank_probe import PodHealth
from policy_operator.operator.spec import PolicyServerSpec


def children(kube: Kube, spec: PolicyServerSpec) -> Observed:
    ns, names = spec.namespace, Names(spec.name)
    job = kube.get("Job", ns, names.job(spec.checkpoint.key))
    job_pods = kube.list("Pod", ns, {**manifests.selector_labels(spec.name, COMPONENT_FETCH),
                                     LABEL_CHECKPOINT_KEY: spec.checkpoint.key}) if job else []
    return Observed(
        pvc=kube.get("PersistentVolumeClaim", ns, manifests.claim_name(spec)),
        job=job,
        job_pods=job_pods,
        statefulset=kube.get("StatefulSet", ns, names.statefulset),
        service=kube.get("Service", ns, names.service),
        headless_service=kube.get("Service", ns, names.headless_service),
    )


def ranks(kube: Kube, spec: PolicyServerSpec, statefulset: Mapping[str, Any] | None, *,
          probe_timeout: float) -> tuple[list[dict[str, Any]], list[PodHealth]]:
    """The server pods and each one's per-rank readiness from its own ``/readyz`` (concurrently, bounded)."""
    if statefulset is None:
        return [], []
    pods = kube.list("Pod", spec.namespace, manifests.selector_labels(spec.name))
    return pods, rank_probe.poll_pods(pods, spec.service.port, spec.layout.world_size, timeout=probe_timeout)
