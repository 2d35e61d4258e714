"""The surge state machine of a rollout (operator/plan.py, ``plan_rollout``): pure, one observation at a time.

Each test hands the planner a StatefulSet (and the surge pod) as the API
would show them at one point of a rollout and checks the next step: start
the extra pod with the new template while the old ones serve, go on once it
is Ready, scale back once every pod is updated, or fall back to in-place
replacement with a Warning when the extra pod does not fit.
"""

from __future__ import annotations

from typing import Any

import pytest

from policy_operator import constants as C
from policy_operator.operator import child_status
from policy_operator.operator import plan as pl
from policy_operator.operator.spec import parse_spec

OWNER = {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": "ps", "namespace": "ns", "uid": "uid-1"}}
READY = child_status.CheckpointState(child_status.CheckpointPhase.READY, child_status.Reason.DOWNLOADED, "", "j")
OLD, NEW = "hash-old", "hash-new"


def sts(template_hash: str, replicas: int, *, surge: str | None = None, ready: int | None = None,
        updated: int = 0, current: str = "rev-1", update: str = "rev-2", generation: int = 3,
        observed: int = 3) -> dict[str, Any]:
    annotations = {C.ANNOTATION_TEMPLATE_HASH: template_hash}
    if surge is not None:
        annotations[C.ANNOTATION_SURGE] = surge
    return {"metadata": {"name": "ps", "generation": generation, "annotations": annotations},
            "spec": {"replicas": replicas},
            "status": {"replicas": replicas, "readyReplicas": replicas if ready is None else ready,
                       "updatedReplicas": updated, "currentRevision": current, "updateRevision": update,
                       "observedGeneration": observed}}


def pod(ready: bool = False, revision: str = "rev-2", unschedulable: str | None = None,
        deleting: bool = False) -> dict[str, Any]:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable is not None:
        conditions.append({"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                           "message": unschedulable})
    meta: dict[str, Any] = {"name": "ps-1", "labels": {"controller-revision-hash": revision}}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return {"metadata": meta, "status": {"conditions": conditions}}


def test_no_statefulset_or_no_replicas_is_no_surge() -> None:
    assert pl.plan_rollout(1, None, NEW, None) == pl.Rollout(1)
    assert pl.plan_rollout(0, sts(OLD, 1), NEW, None) == pl.Rollout(0)


def test_stable_statefulset_stays_as_it_is() -> None:
    assert pl.plan_rollout(2, sts(NEW, 2, updated=2, current="rev-2"), NEW, None) == pl.Rollout(2)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_change_starts_one_extra_pod_with_the_new_template(replicas: int) -> None:
    step = pl.plan_rollout(replicas, sts(OLD, replicas), NEW, None)
    # ordinals < partition keep the old template: only the extra pod (ordinal N) gets the new one
    assert (step.replicas, step.partition, step.surge) == (replicas + 1, replicas, f"{NEW}/{pl.SURGE_STARTING}")
    assert step.event is not None and step.event.type == "Normal" and step.event.reason == "SurgeStarted"
    assert f"ps-{replicas}" in step.event.message


def test_nothing_serving_replaces_in_place() -> None:
    """A broken old template (no pod Ready) has nobody to keep serving: no extra pod."""
    assert pl.plan_rollout(1, sts(OLD, 1, ready=0), NEW, None) == pl.Rollout(1)


@pytest.mark.parametrize("surge_pod", [None, pod(ready=False), pod(ready=True, revision="rev-1"),
                                       pod(ready=True, deleting=True)],
                         ids=["not created yet", "starting", "ready on the old revision", "being deleted"])
def test_starting_waits_for_the_extra_pod(surge_pod: dict[str, Any] | None) -> None:
    observed = sts(NEW, 2, surge=f"{NEW}/{pl.SURGE_STARTING}", ready=1, updated=1)
    step = pl.plan_rollout(1, observed, NEW, surge_pod)
    assert step == pl.Rollout(2, 1, f"{NEW}/{pl.SURGE_STARTING}")  # the same answer every pass, no event
    assert pl.plan_rollout(1, observed, NEW, surge_pod) == step


def test_extra_pod_ready_rolls_the_others_while_it_serves() -> None:
    observed = sts(NEW, 2, surge=f"{NEW}/{pl.SURGE_STARTING}", ready=2, updated=1)
    step = pl.plan_rollout(1, observed, NEW, pod(ready=True))
    assert (step.replicas, step.partition, step.surge) == (2, 0, f"{NEW}/{pl.SURGE_ROLLING}")
    assert step.event is not None and step.event.reason == "SurgeReady"


def test_extra_pod_that_does_not_fit_falls_back_to_in_place_with_a_warning() -> None:
    observed = sts(NEW, 2, surge=f"{NEW}/{pl.SURGE_STARTING}", ready=1, updated=0)
    why = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    step = pl.plan_rollout(1, observed, NEW, pod(unschedulable=why))
    assert (step.replicas, step.partition, step.surge) == (1, 0, None)
    assert step.event is not None and step.event.type == "Warning" and step.event.reason == "SurgeUnschedulable"
    assert why in step.event.message and "in place" in step.event.message
    # next pass: the StatefulSet is back at 1 pod without the annotation, rolling in place
    after = sts(NEW, 1, ready=1, updated=0)
    assert pl.plan_rollout(1, after, NEW, None) == pl.Rollout(1)


def test_rolling_scales_back_only_once_every_pod_is_updated_and_ready() -> None:
    surge = f"{NEW}/{pl.SURGE_ROLLING}"
    half = sts(NEW, 3, surge=surge, ready=2, updated=2)
    assert pl.plan_rollout(2, half, NEW, None) == pl.Rollout(3, 0, surge)
    not_seen = sts(NEW, 3, surge=surge, updated=3, current="rev-2", generation=4, observed=3)
    assert pl.plan_rollout(2, not_seen, NEW, None) == pl.Rollout(3, 0, surge)  # the controller lags the spec
    done = sts(NEW, 3, surge=surge, updated=3, current="rev-2")
    step = pl.plan_rollout(2, done, NEW, None)
    assert (step.replicas, step.partition, step.surge) == (2, 0, None)
    assert step.event is not None and step.event.reason == "SurgeComplete" and "ps-2" in step.event.message


def test_a_second_change_during_a_surge_starts_over_at_the_newest_template() -> None:
    observed = sts(NEW, 2, surge=f"{NEW}/{pl.SURGE_ROLLING}", ready=2, updated=1)
    step = pl.plan_rollout(1, observed, "hash-newer", pod(ready=True))
    assert (step.replicas, step.partition, step.surge) == (2, 1, f"hash-newer/{pl.SURGE_STARTING}")


def test_a_stale_or_foreign_annotation_is_dropped() -> None:
    assert pl.plan_rollout(1, sts(NEW, 1, surge=f"{OLD}/{pl.SURGE_ROLLING}"), NEW, None) == pl.Rollout(1)
    assert pl.plan_rollout(1, sts(NEW, 1, surge="garbage"), NEW, None) == pl.Rollout(1)
    assert pl.surge_of(sts(NEW, 1, surge="garbage")) is None


def _spec(**overrides: Any):
    body: dict[str, Any] = {"image": "img:1", "checkpoint": {"source": "hf://org/p"}, "replicas": 1}
    body.update(overrides)
    return parse_spec(body, name="ps", namespace="ns")


def _sts_write(result: pl.Plan) -> pl.Write:
    [write] = [w for w in result.writes if w.kind == "StatefulSet"]
    return write


def test_plan_writes_the_surge_into_the_statefulset_it_applies() -> None:
    """Through plan(): a steps change at replicas 1 on a serving StatefulSet, pass after pass."""
    before, after = _spec(), _spec(runtime={"steps": 4})
    first = pl.plan(before, OWNER, pl.Observed(), READY)
    running = _sts_write(first).body
    running["status"] = {"replicas": 1, "readyReplicas": 1, "updatedReplicas": 1, "currentRevision": "rev-1",
                         "updateRevision": "rev-1", "observedGeneration": 1}
    running["metadata"]["generation"] = 1
    # pass 1: the change is seen, one extra pod with the new template
    start = _sts_write(pl.plan(after, OWNER, pl.Observed(statefulset=running), READY))
    assert start.body["spec"]["replicas"] == 2
    assert start.body["spec"]["updateStrategy"] == {"type": "RollingUpdate", "rollingUpdate": {"partition": 1}}
    new_hash = start.body["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]
    assert start.body["metadata"]["annotations"][C.ANNOTATION_SURGE] == f"{new_hash}/{pl.SURGE_STARTING}"
    assert start.event is not None and "rolling pods to template" in start.event.message
    assert "scaling" not in start.event.message  # the extra pod is the surge's, said by its own Event
    # pass 2: the extra pod is Ready on the new revision -> partition 0
    start.body["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 1, "currentRevision": "rev-1",
                            "updateRevision": "rev-2", "observedGeneration": 2}
    start.body["metadata"]["generation"] = 2
    rolled = pl.plan(after, OWNER, pl.Observed(statefulset=start.body, surge_pod=pod(ready=True)), READY)
    roll = _sts_write(rolled)
    assert roll.body["spec"]["replicas"] == 2 and roll.body["spec"]["updateStrategy"]["rollingUpdate"] == {"partition": 0}
    assert [e.reason for e in rolled.warnings] == ["SurgeReady"]
    # pass 3: both pods updated and Ready -> back to 1 pod, annotation gone (server-side apply removes it)
    roll.body["status"] = {"replicas": 2, "readyReplicas": 2, "updatedReplicas": 2, "currentRevision": "rev-2",
                           "updateRevision": "rev-2", "observedGeneration": 3}
    roll.body["metadata"]["generation"] = 3
    done = pl.plan(after, OWNER, pl.Observed(statefulset=roll.body), READY)
    back = _sts_write(done)
    assert back.body["spec"]["replicas"] == 1 and C.ANNOTATION_SURGE not in back.body["metadata"]["annotations"]
    assert [e.reason for e in done.warnings] == ["SurgeComplete"]
