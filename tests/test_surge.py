"""Rollouts decided by the operator (operator/rollout.py, ``plan_rollout``): pure, one observation at a time.

Each test hands the planner a StatefulSet (``updateStrategy: OnDelete``) and
its pods as the API would show them at one point of a rollout and checks the
next step: one extra pod with the new template while the old ones serve, the
old pod retired by moving ``ordinals.start`` once it is Ready (so clients
reconnect once, to the pod that stays), in-place replacement one pod at a
time for perPod storage or a surge pod that does not fit, and nothing
replaced for a template another manager drifted.  Drift repair itself
(managedFields, the replacement merge patch) is checked here too.
"""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes.client import V1ManagedFieldsEntry, V1Pod, V1Service, V1StatefulSet

from policy_operator import constants as C
from policy_operator.operator import download_state, drift
from policy_operator.operator import plan as pl
from policy_operator.operator import rollout as ro
from policy_operator.operator.kube import foreign_managers
from policy_operator.operator.spec import parse_spec
from tests.support.api_objects import api_object, api_objects

OWNER = {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": "ps", "namespace": "ns", "uid": "uid-1"}}
READY = download_state.CheckpointState(download_state.CheckpointPhase.READY, download_state.Reason.DOWNLOADED, "", "j")
OLD, NEW = "hash-old", "hash-new"
SURGE = f"{NEW}/{ro.SURGE}"


def sts(
    template_hash: str,
    replicas: int,
    *,
    start: int = 0,
    surge: str | None = None,
    update: str = "rev-2",
    generation: int = 3,
    observed: int = 3,
) -> V1StatefulSet:
    annotations = {C.ANNOTATION_TEMPLATE_HASH: template_hash}
    if surge is not None:
        annotations[C.ANNOTATION_SURGE] = surge
    return api_object(
        V1StatefulSet,
        {
            "metadata": {"name": "ps", "generation": generation, "annotations": annotations},
            "spec": {"replicas": replicas, "ordinals": {"start": start}},
            "status": {"replicas": replicas, "updateRevision": update, "observedGeneration": observed},
        },
    )


def pod(
    ordinal: int,
    *,
    ready: bool = True,
    revision: str = "rev-2",
    unschedulable: str | None = None,
    deleting: bool = False,
) -> V1Pod:
    conditions = [{"type": "Ready", "status": "True" if ready else "False"}]
    if unschedulable is not None:
        conditions.append(
            {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": unschedulable}
        )
    meta: dict[str, Any] = {"name": f"ps-{ordinal}", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: revision}}
    if deleting:
        meta["deletionTimestamp"] = "2025-01-01T00:00:00Z"
    return api_object(V1Pod, {"metadata": meta, "status": {"conditions": conditions}})


def step(
    replicas: int,
    observed: V1StatefulSet | None,
    pods: list[V1Pod],
    *,
    want: str = NEW,
    per_pod: bool = False,
    drifted: bool = False,
) -> ro.Rollout:
    return ro.plan_rollout(replicas, observed, want, pods, retire_by_ordinal=not per_pod, drifted=drifted)


def test_no_statefulset_or_no_replicas_is_no_rollout() -> None:
    assert step(1, None, []) == ro.Rollout(1)
    assert step(0, sts(OLD, 1, start=4), [pod(4, revision="rev-1")]) == ro.Rollout(0, 4)


def test_a_stable_statefulset_stays_as_it_is() -> None:
    assert step(2, sts(NEW, 2, start=3), [pod(3), pod(4)]) == ro.Rollout(2, 3)


@pytest.mark.parametrize("replicas", [1, 3])
def test_a_change_starts_one_extra_pod_with_the_new_template(replicas: int) -> None:
    pods = [pod(k, revision="rev-1") for k in range(replicas)]
    first = step(replicas, sts(OLD, replicas, update="rev-1"), pods)
    assert (first.replicas, first.start, first.surge, first.delete, first.event) == (replicas + 1, 0, SURGE, (), None)
    assert first.note is not None and f"ps-{replicas} starts with the new template" in first.note


def test_nothing_serving_replaces_every_old_pod_in_place() -> None:
    """A broken old template (no pod Ready) has nobody to keep serving: no extra pod, the old pods go at once."""
    broken = [pod(0, ready=False, revision="rev-1"), pod(1, ready=False, revision="rev-1")]
    assert step(2, sts(OLD, 2, update="rev-1"), broken) == ro.Rollout(2)
    assert step(2, sts(NEW, 2), broken) == ro.Rollout(2, 0, delete=("ps-0", "ps-1"))


@pytest.mark.parametrize(
    "extra",
    [None, pod(1, ready=False), pod(1, ready=True, deleting=True)],
    ids=["not created yet", "starting", "being deleted"],
)
def test_the_surge_waits_for_the_extra_pod(extra: V1Pod | None) -> None:
    pods = [pod(0, revision="rev-1")] + ([extra] if extra else [])
    assert step(1, sts(NEW, 2, surge=SURGE), pods) == ro.Rollout(2, 0, SURGE)  # the same answer every pass


def test_one_replica_retires_the_old_pod_by_ordinal_once_the_new_one_is_ready() -> None:
    """The pod clients reconnect to is the one that stays: one reconnect per rollout, never more than 2 pods."""
    done = step(1, sts(NEW, 2, start=5, surge=SURGE), [pod(5, revision="rev-1"), pod(6)])
    assert (done.replicas, done.start, done.surge, done.delete) == (1, 6, None, ())
    assert done.event is not None and done.event.reason == "SurgeComplete" and "ps-5 goes" in done.event.message
    # the next pass: one pod, the new one, nothing more to do
    assert step(1, sts(NEW, 1, start=6), [pod(5, revision="rev-1", deleting=True), pod(6)]) == ro.Rollout(1, 6)


def test_three_replicas_retire_one_old_pod_per_ready_surge_pod() -> None:
    pods = [pod(0, revision="rev-1"), pod(1, revision="rev-1"), pod(2, revision="rev-1"), pod(3)]
    first = step(3, sts(NEW, 4, surge=SURGE), pods)
    assert (first.replicas, first.start, first.surge, first.event) == (4, 1, SURGE, None)  # ps-0 goes, ps-4 starts
    pods = [pod(1, revision="rev-1"), pod(2, revision="rev-1"), pod(3), pod(4, ready=False)]
    assert step(3, sts(NEW, 4, start=1, surge=SURGE), pods) == ro.Rollout(4, 1, SURGE)
    pods = [pod(2, revision="rev-1"), pod(3), pod(4), pod(5)]
    last = step(3, sts(NEW, 4, start=2, surge=SURGE), pods)
    assert (last.replicas, last.start, last.surge) == (3, 3, None) and last.event is not None


def test_per_pod_storage_replaces_in_place_while_the_surge_pod_serves_then_drops_it() -> None:
    """perPod claims belong to ordinals: the old pods are replaced where they are, one at a time."""
    pods = [pod(0, revision="rev-1"), pod(1, revision="rev-1"), pod(2)]
    first = step(2, sts(NEW, 3, surge=SURGE), pods, per_pod=True)
    assert (first.replicas, first.start, first.delete) == (3, 0, ("ps-0",))
    # ps-0 is on its way out, then being recreated: nothing else goes meanwhile
    for ps0 in ([pod(0, revision="rev-1", deleting=True)], [], [pod(0, ready=False)]):
        pods = [*ps0, pod(1, revision="rev-1"), pod(2)]
        assert step(2, sts(NEW, 3, surge=SURGE), pods, per_pod=True).delete == ()
    pods = [pod(0), pod(1, revision="rev-1"), pod(2)]
    assert step(2, sts(NEW, 3, surge=SURGE), pods, per_pod=True).delete == ("ps-1",)
    done = step(2, sts(NEW, 3, surge=SURGE), [pod(0), pod(1), pod(2)], per_pod=True)
    assert (done.replicas, done.surge) == (2, None) and done.event is not None
    assert done.event.reason == "SurgeComplete" and "ps-2" in done.event.message


def test_an_extra_pod_that_does_not_fit_falls_back_to_in_place_with_a_warning() -> None:
    why = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    fallback = step(1, sts(NEW, 2, surge=SURGE), [pod(0, revision="rev-1"), pod(1, ready=False, unschedulable=why)])
    assert (fallback.replicas, fallback.surge, fallback.delete) == (1, None, ())
    assert fallback.event is not None and fallback.event.type == "Warning"
    assert fallback.event.reason == "SurgeUnschedulable" and why in fallback.event.message
    # next pass: no surge, one pod serving on the old revision and nothing else: it is replaced in place
    assert step(1, sts(NEW, 1), [pod(0, revision="rev-1")]).delete == ("ps-0",)


def test_a_second_change_during_a_surge_starts_over_at_the_newest_template() -> None:
    newer = step(1, sts(NEW, 2, surge=SURGE), [pod(0, revision="rev-1"), pod(1)], want="hash-newer")
    assert (newer.replicas, newer.surge) == (2, f"hash-newer/{ro.SURGE}")
    # the controller has the newer revision: the surge pod of the intermediate one is replaced
    later = sts("hash-newer", 2, surge=f"hash-newer/{ro.SURGE}", update="rev-3")
    assert step(1, later, [pod(0, revision="rev-1"), pod(1)], want="hash-newer").delete == ("ps-1",)


def test_nothing_is_replaced_before_the_controller_saw_the_template_or_while_it_drifted() -> None:
    lagging = sts(NEW, 2, surge=SURGE, generation=4, observed=3)
    assert step(1, lagging, [pod(0, revision="rev-1"), pod(1)]) == ro.Rollout(2, 0, SURGE)
    # kubectl set env made a new update revision: the operator puts the template back, and replaces no pod for it
    assert step(2, sts(NEW, 2, update="rev-drift"), [pod(0), pod(1)], drifted=True) == ro.Rollout(2)


def test_a_stale_or_foreign_annotation_is_no_surge() -> None:
    assert ro.surge_of(sts(NEW, 1, surge=f"{NEW}/starting")) is None
    assert ro.surge_of(sts(NEW, 1, surge="garbage")) is None
    assert step(1, sts(NEW, 1, surge=f"{OLD}/{ro.SURGE}"), [pod(0)]) == ro.Rollout(1)


# --- drift: managedFields and the replacement patch -----------------------------------------------


def _managed(manager: str, fields: dict[str, Any], operation: str = "Update") -> dict[str, Any]:
    return {"manager": manager, "operation": operation, "fieldsType": "FieldsV1", "fieldsV1": fields}


def test_foreign_managers_are_those_owning_fields_under_the_path() -> None:
    env: dict[str, Any] = {
        "f:spec": {
            "f:template": {
                "f:spec": {
                    "f:containers": {
                        'k:{"name":"server"}': {
                            "f:env": {'k:{"name":"DRIFT_ADDED"}': {".": {}, "f:name": {}, "f:value": {}}}
                        }
                    }
                }
            }
        }
    }
    obj = {
        "metadata": {
            "managedFields": [
                _managed(C.FIELD_MANAGER, {"f:spec": {"f:template": {"f:metadata": {}}}}, "Apply"),
                _managed(
                    C.FIELD_MANAGER, {"f:spec": {"f:template": {"f:spec": {}}}}
                ),  # the operator's own repair patch
                _managed("kube-controller-manager", {"f:status": {"f:replicas": {}}}),
                _managed("kubectl-set", env),
            ]
        }
    }
    managed = api_objects(V1ManagedFieldsEntry, obj["metadata"]["managedFields"])
    assert foreign_managers(managed, "spec", "template") == ["kubectl-set"]
    assert foreign_managers(managed, "spec", "ports") == []


def test_the_replacement_patch_removes_every_key_desired_lacks() -> None:
    live = {
        "metadata": {"labels": {"a": "1", "added": "x"}},
        "spec": {
            "containers": [{"name": "server", "env": [{"name": "DRIFT_ADDED", "value": "1"}]}],
            "dnsPolicy": "ClusterFirst",
            "nodeSelector": {"hacked": "yes"},
        },
    }
    desired = {"metadata": {"labels": {"a": "1"}}, "spec": {"containers": [{"name": "server", "env": []}]}}
    assert drift.replacement_patch(live, desired) == {
        "metadata": {"labels": {"added": None, "a": "1"}},
        "spec": {"dnsPolicy": None, "nodeSelector": None, "containers": [{"name": "server", "env": []}]},
    }


# --- through plan() ---------------------------------------------------------------------------------


def _spec(**overrides: Any):
    body: dict[str, Any] = {"image": "img:1", "checkpoint": {"source": "hf://org/p"}, "replicas": 1}
    body.update(overrides)
    return parse_spec(body, name="ps", namespace="ns")


def _sts_writes(result: pl.Plan) -> list[pl.Write]:
    return [w for w in result.writes if w.kind in ("StatefulSet", "Pod")]


def test_plan_surges_a_one_replica_rollout_through_the_statefulset_it_applies() -> None:
    """Through plan(): a steps change at replicas 1 on a serving StatefulSet, pass after pass."""
    before, after = _spec(), _spec(runtime={"steps": 4})
    [create] = _sts_writes(pl.plan(before, OWNER, pl.Observed(), READY))
    assert create.body["spec"]["updateStrategy"] == {"type": "OnDelete"} and create.body["spec"]["ordinals"] == {
        "start": 0
    }
    running = create.body
    running["status"] = {"replicas": 1, "updateRevision": "rev-1", "observedGeneration": 1}
    running["metadata"]["generation"] = 1
    # pass 1: the change is seen, one extra pod with the new template (OnDelete: ps-0 is left alone)
    [start] = _sts_writes(
        pl.plan(
            after,
            OWNER,
            pl.Observed(statefulset=api_object(V1StatefulSet, running), pods=[pod(0, revision="rev-1")]),
            READY,
        )
    )
    assert start.verb is pl.Verb.APPLY and start.body["spec"]["replicas"] == 2
    assert start.body["spec"]["updateStrategy"] == {"type": "OnDelete"}
    new_hash = start.body["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH]
    assert start.body["metadata"]["annotations"][C.ANNOTATION_SURGE] == f"{new_hash}/{ro.SURGE}"
    assert start.event is not None and "rolling pods to template" in start.event.message
    assert "ps-1 starts with the new template" in start.event.message  # one Event says both
    assert "scaling" not in start.event.message
    # pass 2: the extra pod is Ready on the new revision -> ordinals.start 1, one pod: ps-0 goes, ps-1 stays
    start.body["status"] = {"replicas": 2, "updateRevision": "rev-2", "observedGeneration": 2}
    start.body["metadata"]["generation"] = 2
    rolled = pl.Observed(statefulset=api_object(V1StatefulSet, start.body), pods=[pod(0, revision="rev-1"), pod(1)])
    done = pl.plan(after, OWNER, rolled, READY)
    [back] = _sts_writes(done)
    assert back.body["spec"]["replicas"] == 1 and back.body["spec"]["ordinals"] == {"start": 1}
    assert C.ANNOTATION_SURGE not in back.body["metadata"]["annotations"] and back.event is None
    assert [e.reason for e in done.events] == ["SurgeComplete"]


def test_plan_repairs_a_drifted_template_with_a_patch_before_the_apply_and_replaces_no_pod() -> None:
    spec = _spec(replicas=2)
    [create] = _sts_writes(pl.plan(spec, OWNER, pl.Observed(), READY))
    live = create.body
    live["spec"]["template"]["spec"]["containers"][0]["env"].append({"name": "DRIFT_ADDED", "value": "1"})
    live["metadata"].update(
        generation=2,
        managedFields=[_managed("kubectl-set", {"f:spec": {"f:template": {"f:spec": {"f:containers": {}}}}})],
    )
    live["status"] = {"replicas": 2, "updateRevision": "rev-drift", "observedGeneration": 2}
    result = pl.plan(
        spec,
        OWNER,
        pl.Observed(
            statefulset=api_object(V1StatefulSet, live), pods=[pod(0, revision="rev-1"), pod(1, revision="rev-1")]
        ),
        READY,
    )
    repair, apply = _sts_writes(result)
    assert (repair.verb, apply.verb) == (pl.Verb.PATCH, pl.Verb.APPLY)
    env = repair.body["spec"]["template"]["spec"]["containers"][0]["env"]
    assert "DRIFT_ADDED" not in {e["name"] for e in env}
    assert repair.event is not None and repair.event.reason == "Repaired" and "kubectl-set" in repair.event.message


def _service(plan_result: pl.Plan, name: str) -> pl.Write:
    return next(w for w in plan_result.writes if w.kind == "Service" and w.name == name and w.verb is pl.Verb.APPLY)


def test_plan_puts_back_a_service_port_edited_into_another_key() -> None:
    """``kubectl patch svc ... /spec/ports/0/port 9999``: the port is a new list-map key owned by kubectl, which
    apply would keep beside the operator's (422 Duplicate value "ws" on every pass): replaced whole first."""
    spec = _spec()
    first = pl.plan(spec, OWNER, pl.Observed(), READY)
    svc = _service(first, "ps").body
    svc["spec"]["ports"][0]["port"] = 9999
    svc["metadata"]["managedFields"] = [
        _managed(
            "kubectl-patch", {"f:spec": {"f:ports": {'k:{"port":9999,"protocol":"TCP"}': {".": {}, "f:port": {}}}}}
        )
    ]
    result = pl.plan(spec, OWNER, pl.Observed(service=api_object(V1Service, svc)), READY)
    [repair] = [w for w in result.writes if w.kind == "Service" and w.verb is pl.Verb.PATCH]
    assert repair.body == {
        "spec": {"ports": [{"name": C.PORT_NAME, "port": C.DEFAULT_PORT, "targetPort": C.PORT_NAME, "protocol": "TCP"}]}
    }
    assert repair.event is not None and repair.event.reason == "Repaired" and "9999/TCP" in repair.event.message
    # a port the operator itself moved (a spec change) is server-side apply's, not a repair
    svc["metadata"]["managedFields"] = [_managed(C.FIELD_MANAGER, {"f:spec": {"f:ports": {}}}, "Apply")]
    assert not [
        w
        for w in pl.plan(spec, OWNER, pl.Observed(service=api_object(V1Service, svc)), READY).writes
        if w.kind == "Service" and w.verb is pl.Verb.PATCH
    ]
