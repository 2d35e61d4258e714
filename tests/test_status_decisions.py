"""Status that never lies: every decision of the status step on hand-built observations (pure, no cluster).

Rollout-awareness (no Ready while old pods serve), the Ready condition, the
progress deadline, pod-creation refusals (FailedCreate Events), unschedulable
pods and the kubelet fallback when /readyz is unreachable.  The same decisions
on the real control plane are in tests/test_status_cluster.py.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import re
from typing import Any

import pytest
from kubernetes.client import CoreV1Event, V1Job, V1PersistentVolumeClaim, V1Pod, V1StatefulSet

from policy_operator import constants as C
from policy_operator.operator import download_state, manifests, pod_problems, rank_probe, workload_state
from policy_operator.operator import status as st
from policy_operator.operator.conditions import REASON_PATTERN, Reason
from policy_operator.operator.download_state import CheckpointPhase, CheckpointState
from policy_operator.operator.resource import PolicyServerStatus
from policy_operator.operator.spec import parse_spec
from policy_operator.operator.workload_state import WorkloadState
from tests.support.api_objects import api_object, api_objects
from tests.support.net import free_port

T0 = "2026-01-01T00:00:00Z"


def at(seconds: int) -> str:
    return f"2026-01-01T{seconds // 3600:02d}:{seconds // 60 % 60:02d}:{seconds % 60:02d}Z"


def spec(**overrides: Any):
    body: dict[str, Any] = {
        "image": "img:1",
        "checkpoint": {"source": "hf://org/p"},
        "runtime": {"device": "cpu"},
        "storage": {"accessModes": ["ReadWriteMany"]},
    }  # valid for any replicas
    body.update(overrides)
    return parse_spec(body, name="ps", namespace="ns")


CK_READY = CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, "done", "ps-fetch-k")


def workload(
    *,
    desired: int = 2,
    rolling: bool = False,
    revision: str | None = "r2",
    failed_create: str = "",
    template: str = "h2",
) -> WorkloadState:
    return WorkloadState(
        exists=True,
        desired=desired,
        current=desired,
        rolling=rolling,
        serving_key="k",
        template_hash=template,
        update_revision=revision,
        updated=0,
        failed_create=failed_create,
    )


def pod(name: str, *, ready: bool, revision: str | None = "r2", world: int = 1, **extra: Any) -> rank_probe.PodHealth:
    return rank_probe.PodHealth(
        name, "10.0.0.1", extra.pop("phase", "Running"), world, world if ready else 0, ready, revision=revision, **extra
    )


def build(
    s,
    wl: WorkloadState,
    pods: list[rank_probe.PodHealth],
    *,
    previous: dict[str, Any] | None = None,
    now: str = T0,
    checkpoint: CheckpointState = CK_READY,
    generation: int = 1,
) -> st.StatusUpdate:
    update = st.build_status(
        s,
        checkpoint=checkpoint,
        workload=wl,
        pods=pods,
        service_exists=True,
        previous=previous,
        generation=generation,
        now=now,
    )
    PolicyServerStatus.model_validate(update.document)  # what the CRD's schema would admit
    return update


def cond(update: st.StatusUpdate, kind: str) -> dict[str, Any]:
    return next(c for c in update.document["conditions"] if c["type"] == kind)


def reasons(update: st.StatusUpdate) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in update.document["conditions"]}


# --- rollouts ------------------------------------------------------------------------------------


def sts(
    *,
    generation: int = 3,
    observed: int = 3,
    replicas: int = 2,
    updated: int = 2,
    current: str = "r2",
    update: str = "r2",
    uid: str = "sts-uid",
) -> V1StatefulSet:
    return api_object(
        V1StatefulSet,
        {
            "metadata": {
                "generation": generation,
                "uid": uid,
                "labels": {C.LABEL_CHECKPOINT_KEY: "k"},
                "annotations": {C.ANNOTATION_TEMPLATE_HASH: "h2"},
            },
            "spec": {"replicas": replicas},
            "status": {
                "observedGeneration": observed,
                "replicas": replicas,
                "updatedReplicas": updated,
                "currentRevision": current,
                "updateRevision": update,
            },
        },
    )


@pytest.mark.parametrize(
    "statefulset",
    [
        sts(observed=2),  # the controller has not even seen the new template
        sts(updated=0, current="r1"),  # it has, and replaces pods
        sts(updated=1, current="r1"),  # half way
    ],
)
def test_old_pods_ready_mid_rollout_are_available_never_ready(statefulset: V1StatefulSet) -> None:
    wl = workload_state.workload_state(statefulset, 2)
    assert wl.rolling and wl.update_revision == "r2"
    old = [pod("ps-0", ready=True, revision="r1"), pod("ps-1", ready=True, revision="r1")]
    update = build(spec(replicas=2), wl, old, previous={"phase": C.PHASE_READY})
    assert update.document["phase"] == C.PHASE_STARTING
    assert reasons(update)[C.COND_AVAILABLE] == ("True", "ReplicasReady")
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "RollingOut")
    assert reasons(update)[C.COND_READY] == ("False", "RollingOut")
    assert reasons(update)[C.COND_RECONCILING] == ("True", "RollingOut")  # kstatus: InProgress
    assert reasons(update)[C.COND_STALLED][0] == "False"
    assert (update.document["readyReplicas"], update.document["updatedReadyReplicas"]) == (2, 0)
    assert "0 of them on the current spec" in cond(update, C.COND_AVAILABLE)["message"]


def test_status_counts_that_lag_the_pods_still_need_every_pod_on_the_new_revision() -> None:
    # the StatefulSet's status claims the rollout is done, but one ready pod still carries the old revision
    wl = workload_state.workload_state(sts(), 2)
    assert not wl.rolling
    update = build(spec(replicas=2), wl, [pod("ps-0", ready=True), pod("ps-1", ready=True, revision="r1")])
    assert update.document["phase"] == C.PHASE_STARTING and reasons(update)[C.COND_READY][0] == "False"


def test_rolled_and_ready_is_ready_stable() -> None:
    update = build(
        spec(replicas=2), workload_state.workload_state(sts(), 2), [pod("ps-0", ready=True), pod("ps-1", ready=True)]
    )
    assert update.document["phase"] == C.PHASE_READY
    assert reasons(update)[C.COND_PROGRESSING] == ("False", "Stable")
    assert reasons(update)[C.COND_READY] == ("True", "ReplicasReady")
    assert reasons(update)[C.COND_RECONCILING][0] == reasons(update)[C.COND_STALLED][0] == "False"  # kstatus: Current
    assert "lastProgressTime" not in update.document
    # Ready is a summary: it gets no Event of its own (the phase and the other conditions already tell)
    assert all(not e.message.startswith(f"{C.COND_READY}=") for e in update.events)


def test_ready_is_first_and_every_condition_meets_metav1_condition() -> None:
    update = build(spec(replicas=2), workload(rolling=True), [pod("ps-0", ready=False)])
    conditions = update.document["conditions"]
    assert [c["type"] for c in conditions][:3] == [C.COND_READY, C.COND_RECONCILING, C.COND_STALLED]
    for c in conditions:
        assert set(c) >= {"type", "status", "reason", "message", "lastTransitionTime"}
        assert re.match(REASON_PATTERN, c["reason"]), c
    assert all(re.match(REASON_PATTERN, r.value) for r in Reason)


def test_the_schema_refuses_what_metav1_condition_refuses() -> None:
    good = {"type": "Ready", "status": "True", "reason": "ReplicasReady", "message": "", "lastTransitionTime": T0}
    PolicyServerStatus.model_validate({"conditions": [good]})
    for bad in (
        {**good, "reason": "has space"},
        {**good, "reason": ""},
        {**good, "status": "Maybe"},
        {k: v for k, v in good.items() if k != "lastTransitionTime"},
        {k: v for k, v in good.items() if k != "message"},
    ):
        with pytest.raises(ValueError):
            PolicyServerStatus.model_validate({"conditions": [bad]})


def test_invalid_spec_says_ready_false() -> None:
    update = st.invalid_status(ValueError("spec.x: bad"), previous=None, generation=2, now=T0)
    by_type = {c["type"]: (c["status"], c["reason"]) for c in update.document["conditions"]}
    assert by_type[C.COND_READY] == ("False", "InvalidSpec") and by_type[C.COND_STALLED] == ("True", "InvalidSpec")
    assert by_type[C.COND_RECONCILING][0] == "False"


@pytest.mark.parametrize(
    ("phase", "available", "progressing", "expected"),
    [
        (C.PHASE_READY, ("True", Reason.REPLICAS_READY), ("False", Reason.STABLE), ("True", "ReplicasReady")),
        (C.PHASE_STARTING, ("True", Reason.PARTIALLY_READY), ("True", Reason.ROLLING_OUT), ("False", "RollingOut")),
        (
            C.PHASE_FAILED,
            ("False", Reason.NO_REPLICAS_READY),
            ("False", Reason.PROGRESS_DEADLINE_EXCEEDED),
            ("False", "ProgressDeadlineExceeded"),
        ),
        (C.PHASE_PENDING, ("False", Reason.SCALED_TO_ZERO), ("False", Reason.STABLE), ("False", "ScaledToZero")),
        (
            C.PHASE_DEGRADED,
            ("True", Reason.PARTIALLY_READY),
            ("False", Reason.REPLICAS_UNAVAILABLE),
            ("False", "ReplicasUnavailable"),
        ),
        # an apply the API server refused while the pods are fine: not Ready, and says why
        (C.PHASE_READY, ("True", Reason.REPLICAS_READY), ("False", Reason.APPLY_FAILED), ("False", "ApplyFailed")),
    ],
)
def test_ready_condition_table(
    phase: str, available: tuple[str, Reason], progressing: tuple[str, Reason], expected: tuple[str, str]
) -> None:
    a = st.Condition(C.COND_AVAILABLE, available[0], available[1], "a")
    p = st.Condition(C.COND_PROGRESSING, progressing[0], progressing[1], "p")
    ready = st.ready_condition(phase, available=a, progressing=p, desired=2)
    assert (ready.status, str(ready.reason)) == expected


@pytest.mark.parametrize(
    ("ready", "scaled_to_zero", "reconciling", "stalled"),
    [
        (("True", Reason.REPLICAS_READY), False, "False", "False"),
        (("False", Reason.DOWNLOADING), False, "True", "False"),
        (("False", Reason.FAILED_CREATE), False, "True", "False"),  # a quota may be lifted: still in progress
        (("False", Reason.REPLICAS_UNAVAILABLE), False, "True", "False"),  # the kubelet restarts the pod
        (("False", Reason.PROGRESS_DEADLINE_EXCEEDED), False, "False", "True"),
        (("False", Reason.FAILED), False, "False", "True"),
        (("False", Reason.NAME_CONFLICT), False, "False", "True"),
        (("False", Reason.SCALED_TO_ZERO), True, "False", "False"),  # nothing to do: kstatus Current
    ],
)
def test_kstatus_conditions(ready: tuple[str, Reason], scaled_to_zero: bool, reconciling: str, stalled: str) -> None:
    got = st.kstatus_conditions(st.Condition(C.COND_READY, ready[0], ready[1], "m"), scaled_to_zero=scaled_to_zero)
    assert [(c.type, c.status) for c in got] == [(C.COND_RECONCILING, reconciling), (C.COND_STALLED, stalled)]


def test_scaled_to_zero_is_current_for_kstatus() -> None:
    update = build(spec(replicas=0), workload(desired=0), [])
    assert update.document["phase"] == C.PHASE_PENDING
    assert reasons(update)[C.COND_READY] == ("False", "ScaledToZero")
    assert reasons(update)[C.COND_RECONCILING][0] == reasons(update)[C.COND_STALLED][0] == "False"


# --- the progress deadline ------------------------------------------------------------------------

CRASH = (
    "server exited 1 (Error): [rank0]: Traceback (most recent call last):\n"
    '[rank0]:   File "serve.py", line 3\n[rank0]: ValueError: --dtype bogus'
)


def test_a_rollout_without_progress_hits_the_deadline_with_the_termination_message() -> None:
    s = spec(replicas=1, progressDeadlineSeconds=60)
    wl = workload(desired=1, rolling=True)
    crashing = [pod("ps-0", ready=False, termination=CRASH, message="server: CrashLoopBackOff")]
    first = build(s, wl, crashing, previous={"phase": C.PHASE_DOWNLOADING})
    assert first.document["phase"] == C.PHASE_STARTING and first.document["lastProgressTime"] == T0
    before = build(s, wl, crashing, previous=first.document, now=at(60))
    assert before.document["phase"] == C.PHASE_STARTING and before.document["lastProgressTime"] == T0
    after = build(s, wl, crashing, previous=before.document, now=at(61))
    assert after.document["phase"] == C.PHASE_FAILED
    progressing = cond(after, C.COND_PROGRESSING)
    assert (progressing["status"], progressing["reason"]) == ("False", "ProgressDeadlineExceeded")
    assert "ValueError: --dtype bogus" in progressing["message"] and "pod ps-0" in progressing["message"]
    assert reasons(after)[C.COND_READY] == ("False", "ProgressDeadlineExceeded")
    assert reasons(after)[C.COND_STALLED] == ("True", "ProgressDeadlineExceeded")  # kstatus: Failed
    assert reasons(after)[C.COND_RECONCILING][0] == "False"
    kinds = {(e.type, e.reason) for e in after.events}
    assert ("Warning", "ProgressDeadlineExceeded") in kinds and ("Warning", C.PHASE_FAILED) in kinds
    # it stays failed (the clock is not restarted by being failed) ...
    again = build(s, wl, crashing, previous=after.document, now=at(120))
    assert again.document["phase"] == C.PHASE_FAILED and again.document["lastProgressTime"] == T0
    # ... until the rollout moves: a new spec restarts the clock
    fixed = build(
        s,
        workload(desired=1, rolling=True, template="h3"),
        crashing,
        previous=again.document,
        now=at(130),
        generation=2,
    )
    assert fixed.document["phase"] == C.PHASE_STARTING and fixed.document["lastProgressTime"] == at(130)


def test_each_pod_that_becomes_ready_restarts_the_clock() -> None:
    s = spec(replicas=2, progressDeadlineSeconds=60)
    wl = workload(rolling=True)
    one = build(s, wl, [pod("ps-0", ready=False)], previous={"phase": C.PHASE_DOWNLOADING})
    two = build(s, wl, [pod("ps-0", ready=True), pod("ps-1", ready=False)], previous=one.document, now=at(50))
    assert two.document["lastProgressTime"] == at(50)
    late = build(s, wl, [pod("ps-0", ready=True), pod("ps-1", ready=False)], previous=two.document, now=at(100))
    assert late.document["phase"] == C.PHASE_STARTING


def test_deadline_while_old_pods_serve_is_degraded_not_failed() -> None:
    s = spec(replicas=1, progressDeadlineSeconds=10)
    wl = workload(desired=1, rolling=True)
    pods = [pod("ps-0", ready=True, revision="r1"), pod("ps-1", ready=False, termination=CRASH)]
    first = build(s, wl, pods, previous={"phase": C.PHASE_READY})
    late = build(s, wl, pods, previous=first.document, now=at(11))
    assert late.document["phase"] == C.PHASE_DEGRADED
    assert reasons(late)[C.COND_AVAILABLE][0] == "True"
    assert reasons(late)[C.COND_PROGRESSING] == ("False", "ProgressDeadlineExceeded")


# the end of a real server container's log (torchrun -m policy_operator.runtime.worker --dtype bogus), trimmed
TORCHRUN_LOG = """\
2026-12-02 23:02:49,880 rank0 INFO policy_operator.runtime.parallel.heartbeat: rank 0: loading -> failed unknown dtype 'bogus'
2026-12-02 23:02:49,880 rank0 ERROR policy_operator.runtime.worker: loading the policy failed: ValueError: unknown dtype 'bogus'
policyserver: error: ValueError: unknown dtype 'bogus'; choose one of ['bf16', 'float32']
2026-12-02 23:02:49,894 rank0 INFO websockets.server: server closing
2026-12-02 23:02:49,894 rank0 INFO websockets.server: server closed
E1202 23:02:49.960000 4787 torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: 3) local_rank: 0
Traceback (most recent call last):
  File "/venv/bin/torchrun", line 8, in <module>
    sys.exit(main())
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
policy_operator.runtime.worker FAILED
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_23:02:49
  rank      : 0 (local_rank: 0)
  exitcode  : 3 (pid: 4868)
  error_file: <N/A>
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""


def test_the_ranks_error_is_found_under_torchruns_report() -> None:
    p = {
        "status": {
            "containerStatuses": [
                {
                    "name": "server",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": TORCHRUN_LOG}},
                }
            ]
        }
    }
    tail = pod_problems.termination_tail(api_object(V1Pod, p))
    head, _, lines = tail.partition(": ")
    assert head == "server exited 1 (Error), rank 0 exit code 3"
    assert lines.splitlines() == [ln for ln in TORCHRUN_LOG.splitlines()[:3]]  # the rank's error lines, no more
    assert "ChildFailedError" not in tail and "=====" not in tail


def test_a_message_without_the_error_is_reported_as_it_is_no_log_is_read() -> None:
    """The operator holds no pods/log: the termination message is all it says (kubectl logs has the rest)."""
    noise = "\n".join(["2026-12-02 rank0 INFO websockets.server: HTTP response sent (503 Service Unavailable)"] * 20)
    p = {
        "metadata": {"name": "ps-0"},
        "status": {
            "phase": "Running",
            "containerStatuses": [
                {
                    "name": "server",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": noise}},
                }
            ],
        },
    }
    text = pod_problems.termination(api_object(V1Pod, p))
    assert text.startswith("server exited 1 (Error): ") and "503 Service Unavailable" in text
    assert rank_probe.pod_health(api_object(V1Pod, p), 8000, 1).termination == text


def test_termination_tail_keeps_the_last_lines() -> None:
    log = "\n".join(f"line {i}" for i in range(20)) + "\n"
    p = {
        "status": {
            "containerStatuses": [
                {
                    "name": "server",
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": log}},
                }
            ]
        }
    }
    tail = pod_problems.termination_tail(
        api_object(V1Pod, p)
    )  # no error-looking line and no torchrun report: the last lines
    assert tail.startswith("server exited 1 (Error): line 15\n") and tail.endswith("line 19")
    assert (
        pod_problems.termination_tail(
            api_object(
                V1Pod,
                {
                    "status": {
                        "containerStatuses": [
                            {"name": "server", "lastState": {"terminated": {"exitCode": 0, "message": "bye"}}}
                        ]
                    }
                },
            )
        )
        == ""
    )


def test_the_server_container_falls_back_to_its_log_for_the_termination_message() -> None:
    pod_spec = manifests.build_statefulset(spec())["spec"]["template"]["spec"]
    server = next(c for c in pod_spec["containers"] if c["name"] == manifests.SERVER_CONTAINER)
    assert server["terminationMessagePolicy"] == "FallbackToLogsOnError"


# --- refused and unschedulable pods ---------------------------------------------------------------

QUOTA = (
    'create Pod ps-0 in StatefulSet ps failed error: pods "ps-0" is forbidden: exceeded quota: gpus, '
    "requested: requests.nvidia.com/gpu=1, used: requests.nvidia.com/gpu=0, limited: requests.nvidia.com/gpu=0"
)


def event(message: str, when: str, uid: str = "sts-uid", reason: str = "FailedCreate") -> CoreV1Event:
    return api_object(
        CoreV1Event, {"reason": reason, "message": message, "lastTimestamp": when, "involvedObject": {"uid": uid}}
    )


def k8s_pod(name: str, created: str) -> V1Pod:
    return api_object(V1Pod, {"metadata": {"name": name, "creationTimestamp": created}})


def test_failed_create_reads_the_newest_event_of_this_object_still_in_force() -> None:
    owner = sts()
    assert pod_problems.failed_create(owner, [event("old", at(1)), event(QUOTA, at(5))], []) == QUOTA
    assert pod_problems.failed_create(owner, [event(QUOTA, at(5), uid="a-previous-sts")], []) == ""
    assert pod_problems.failed_create(owner, [event(QUOTA, at(5), reason="SuccessfulCreate")], []) == ""
    # a pod created after the refusal: the quota was lifted
    assert pod_problems.failed_create(owner, [event(QUOTA, at(5))], [k8s_pod("ps-0", at(6))]) == ""
    # a pod of before the refusal does not lift it (quota for one pod, two asked for)
    assert pod_problems.failed_create(owner, [event(QUOTA, at(5))], [k8s_pod("ps-0", at(2))]) == QUOTA
    # events.k8s.io series and eventTime (MicroTime) count as well
    series = api_object(
        CoreV1Event,
        {
            "reason": "FailedCreate",
            "message": "s",
            "eventTime": "2026-01-01T00:00:01.500000Z",
            "series": {"lastObservedTime": "2026-01-01T00:00:09.250000Z"},
            "involvedObject": {"uid": "sts-uid"},
        },
    )
    assert pod_problems.failed_create(owner, [event(QUOTA, at(5)), series], [k8s_pod("ps-0", at(8))]) == "s"


def test_a_statefulset_short_of_pods_reports_the_refusal() -> None:
    refused = workload_state.workload_state(sts(replicas=1), 1, [event(QUOTA, at(5))], [])
    assert refused.failed_create == QUOTA
    complete = workload_state.workload_state(sts(replicas=1), 1, [event(QUOTA, at(5))], [k8s_pod("ps-0", at(1))])
    assert complete.failed_create == ""  # no pod is missing: an old Event says nothing

    update = build(spec(replicas=1), refused, [], previous={"phase": C.PHASE_DOWNLOADING})
    assert update.document["phase"] == C.PHASE_PENDING
    assert reasons(update)[C.COND_AVAILABLE] == ("False", "FailedCreate")
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "FailedCreate")
    assert reasons(update)[C.COND_READY] == ("False", "FailedCreate")
    assert "exceeded quota" in cond(update, C.COND_AVAILABLE)["message"]
    assert ("Warning", "FailedCreate") in {(e.type, e.reason) for e in update.events}
    # refused for longer than the deadline: failed, and the refusal is the reason given
    late = build(spec(replicas=1, progressDeadlineSeconds=30), refused, [], previous=update.document, now=at(31))
    assert late.document["phase"] == C.PHASE_FAILED and "exceeded quota" in cond(late, C.COND_PROGRESSING)["message"]


def test_a_fetch_job_without_pods_reports_the_refusal() -> None:
    s = spec()
    job = api_object(V1Job, {"metadata": {"name": "ps-fetch-k", "uid": "job-uid"}, "status": {}})
    denied = (
        'Error creating: pods "ps-fetch-k-x" is forbidden: violates PodSecurity "restricted:latest": '
        "runAsNonRoot != true"
    )
    state = download_state.checkpoint_state(s, job, [], None, None, [event(denied, at(3), uid="job-uid")])
    assert (state.phase, state.reason) == (CheckpointPhase.PENDING, Reason.FAILED_CREATE)
    assert "PodSecurity" in state.message
    waiting = download_state.checkpoint_state(s, job, [], None, None, [])
    assert waiting.reason == Reason.JOB_PENDING
    update = st.build_status(
        s,
        checkpoint=state,
        workload=WorkloadState(exists=False, desired=1, rolling=True),
        pods=[],
        service_exists=False,
        previous=None,
        generation=1,
        now=T0,
    )
    assert update.document["phase"] == C.PHASE_PENDING
    assert reasons(update)[C.COND_CHECKPOINT_READY] == ("False", "FailedCreate")
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "FailedCreate")
    assert reasons(update)[C.COND_READY] == ("False", "FailedCreate")
    assert "PodSecurity" in cond(update, C.COND_READY)["message"]


def test_an_unschedulable_pod_is_pending_and_says_why() -> None:
    why = "0/1 nodes are available: 1 Insufficient nvidia.com/gpu."
    k8s = {
        "metadata": {"name": "ps-0", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: "r2"}},
        "status": {
            "phase": "Pending",
            "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}],
        },
    }
    health = rank_probe.pod_health(api_object(V1Pod, k8s), 8000, 1)
    assert health.unschedulable == why and health.revision == "r2"
    update = build(spec(replicas=1), workload(desired=1, rolling=True), [health], previous={"phase": "Downloading"})
    assert update.document["phase"] == C.PHASE_PENDING
    assert reasons(update)[C.COND_AVAILABLE] == ("False", "Unschedulable")
    assert why in cond(update, C.COND_AVAILABLE)["message"]
    assert ("Warning", "Unschedulable") in {(e.type, e.reason) for e in update.events}


# --- /readyz unreachable: the kubelet's view -------------------------------------------------------


def kubelet_pod(ready: bool, port: int) -> V1Pod:
    return api_object(
        V1Pod,
        {
            "metadata": {"name": "ps-0", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: "r2"}},
            "spec": {"containers": [{"ports": [{"name": C.PORT_NAME, "containerPort": port}]}]},
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
            },
        },
    )


def test_unreachable_readyz_falls_back_to_the_kubelet_and_says_ranks_unknown() -> None:
    port = free_port()  # nothing listens: the operator cannot reach the pod
    ready = rank_probe.pod_health(kubelet_pod(True, port), port, 2, timeout=1)
    assert ready.ready and not ready.ranks_known and ready.ranks_text == "2/2"  # Ready means every rank ready
    assert "unreachable" in ready.message and "kubelet reports the pod ready" in ready.message
    down = rank_probe.pod_health(kubelet_pod(False, port), port, 2, timeout=1)
    assert not down.ready and down.ranks_text == "0/2"  # both views agree it does not serve

    up = build(
        spec(replicas=1, parallelism={"cfgp": 2}, runtime={"device": "cpu", "guidance": 3.0}),
        workload(desired=1),
        [ready],
    )
    assert up.document["phase"] == C.PHASE_READY and up.document["ranksReady"] == "2/2"
    assert reasons(up)[C.COND_AVAILABLE] == ("True", "RanksUnknown")
    starting = build(
        spec(replicas=1, parallelism={"cfgp": 2}, runtime={"device": "cpu", "guidance": 3.0}),
        workload(desired=1, rolling=True),
        [down],
    )
    assert starting.document["ranksReady"] == "0/2"
    assert reasons(starting)[C.COND_AVAILABLE] == ("False", "NoReplicasReady")


def test_a_starting_pod_that_refuses_connections_is_starting_not_ranks_unknown() -> None:
    """Every new pod refuses connections until rank 0 listens: mid-rollout that is a pod starting, not a
    NetworkPolicy in the way.  Only a pod the kubelet calls Ready and the operator cannot reach is RanksUnknown."""
    port = free_port()
    starting = rank_probe.pod_health(kubelet_pod(False, port), port, 2, timeout=1)
    assert starting.ranks_known and "ranksKnown" not in starting.as_status()
    assert starting.message.startswith("starting: ") and "unreachable" in starting.message
    serving = pod("ps-0", ready=True, revision="r1")
    s = spec(replicas=1, parallelism={"cfgp": 2}, runtime={"device": "cpu", "guidance": 3.0})
    before = build(s, workload(desired=1), [dataclasses.replace(serving, world_size=2, ranks_ready=2)])
    rolling = build(
        s,
        workload(desired=1, rolling=True),
        [dataclasses.replace(serving, world_size=2, ranks_ready=2), dataclasses.replace(starting, name="ps-1")],
        previous=before.document,
        now=at(5),
    )
    assert reasons(rolling)[C.COND_AVAILABLE] == ("True", "ReplicasReady")
    assert "ranks unknown" not in cond(rolling, C.COND_AVAILABLE)["message"]
    assert not [e for e in rolling.events if e.reason == "RanksUnknown"]


def test_a_server_that_lost_its_pods_stays_replicas_unavailable_until_one_is_back() -> None:
    """Available says ReplicasUnavailable (it served, and no longer does) for every reconcile of the outage, not
    just the first: the second status update once read its previous Available as False and turned it into
    NoReplicasReady, the reason of a server that never served (seen in an end-to-end run)."""
    s = spec(replicas=1)
    serving = build(s, workload(desired=1), [pod("ps-0", ready=True)])
    assert reasons(serving)[C.COND_AVAILABLE] == ("True", "ReplicasReady")
    down = [pod("ps-0", ready=False)]
    first = build(s, workload(desired=1), down, previous=serving.document, now=at(5))
    second = build(s, workload(desired=1), down, previous=first.document, now=at(10))
    for update in (first, second):
        assert update.document["phase"] == C.PHASE_DEGRADED
        assert reasons(update)[C.COND_AVAILABLE] == ("False", "ReplicasUnavailable")
    back = build(s, workload(desired=1), [pod("ps-0", ready=True)], previous=second.document, now=at(15))
    assert reasons(back)[C.COND_AVAILABLE] == ("True", "ReplicasReady")
    never = build(s, workload(desired=1, rolling=True), down, previous=None)
    assert reasons(never)[C.COND_AVAILABLE] == ("False", "NoReplicasReady")


# --- a pod that crash-loops, a pod that hangs (issue 40 items 12 and 13) ----------------------------

CRASH_LOG = """\
loading checkpoint /models/k
Traceback (most recent call last):
  File "/app/runtime/worker.py", line 90, in main
ValueError: --dtype bogus: expected one of float32, bfloat16, float16
INFO websockets.server: server closing
INFO websockets.server: server closed
"""


def server_pod(container: dict[str, Any], *, port: int, ready_condition: dict[str, Any] | None = None) -> V1Pod:
    conditions = [ready_condition] if ready_condition else [{"type": "Ready", "status": "False"}]
    return api_object(
        V1Pod,
        {
            "metadata": {"name": "ps-0", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: "r2"}},
            "spec": {"containers": [{"name": "server", "ports": [{"name": C.PORT_NAME, "containerPort": port}]}]},
            "status": {
                "phase": "Running",
                "podIP": "127.0.0.1",
                "conditions": conditions,
                "containerStatuses": [{"name": "server", "ready": False, **container}],
            },
        },
    )


def crashed(state: dict[str, Any], *, restarts: int = 2, ran_s: int = 8) -> dict[str, Any]:
    run = {"startedAt": at(100), "finishedAt": at(100 + ran_s)}
    return {
        "restartCount": restarts,
        "state": state,
        "lastState": {"terminated": {"exitCode": 1, "reason": "Error", "message": CRASH_LOG, **run}},
    }


def test_a_crash_looping_pod_says_the_error_that_killed_it_and_the_phase_says_failing() -> None:
    """It read "starting: /readyz unreachable (server: CrashLoopBackOff: server closed)", phase Starting and
    Progressing RollingOut until progressDeadlineSeconds (900 s by default)."""
    port = free_port()  # nothing listens: the server is down between restarts
    backing_off = rank_probe.pod_health(
        server_pod(crashed({"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 20s"}}), port=port), port, 1
    )
    again = rank_probe.pod_health(server_pod(crashed({"running": {}}), port=port), port, 1)  # restarted, loading
    for health in (backing_off, again):
        assert health.message == (
            "crash-looping: server exited 1 (Error), 2 restarts: "
            "ValueError: --dtype bogus: expected one of float32, bfloat16, float16"
        ), health.message
        assert not health.ready and "server closed" not in health.message
    s = spec(replicas=1)
    first = build(s, workload(desired=1, rolling=True), [backing_off], previous={"phase": C.PHASE_STARTING})
    assert first.document["phase"] == C.PHASE_FAILED
    assert reasons(first)[C.COND_PROGRESSING] == ("True", "CrashLoopBackOff")  # the kubelet retries; the clock runs
    assert reasons(first)[C.COND_READY] == ("False", "CrashLoopBackOff")
    assert (reasons(first)[C.COND_RECONCILING][0], reasons(first)[C.COND_STALLED][0]) == ("True", "False")
    assert "--dtype bogus" in cond(first, C.COND_PROGRESSING)["message"]
    assert "ps-0" in cond(first, C.COND_PROGRESSING)["message"]
    warnings = {(e.reason, e.message) for e in first.events if e.type == "Warning"}
    assert {r for r, _ in warnings} == {"CrashLoopBackOff", C.PHASE_FAILED}, warnings
    assert all("--dtype bogus" in m for _, m in warnings), warnings
    assert first.document["lastProgressTime"] == T0
    # the deadline still turns it into ProgressDeadlineExceeded (Stalled), with the same error
    late = build(s, workload(desired=1, rolling=True), [again], previous=first.document, now=at(901))
    assert reasons(late)[C.COND_PROGRESSING] == ("False", "ProgressDeadlineExceeded")
    assert late.document["phase"] == C.PHASE_FAILED and reasons(late)[C.COND_STALLED][0] == "True"
    assert "--dtype bogus" in cond(late, C.COND_PROGRESSING)["message"]
    # an old pod still serving: Degraded, not Failed
    serving = pod("ps-0", ready=True, revision="r1")
    mid = build(
        s, workload(desired=1, rolling=True), [serving, dataclasses.replace(backing_off, name="ps-1")], previous=None
    )
    assert mid.document["phase"] == C.PHASE_DEGRADED
    assert reasons(mid)[C.COND_PROGRESSING] == ("True", "CrashLoopBackOff")
    assert reasons(mid)[C.COND_AVAILABLE][0] == "True"
    # once the pod is ready it is serving, whatever its restarts were
    fine = dataclasses.replace(again, ready=True, ranks_ready=1)
    assert build(s, workload(desired=1), [fine], previous=first.document).document["phase"] == C.PHASE_READY


def test_one_crash_or_a_failure_after_a_long_run_is_a_restart_not_a_loop() -> None:
    """A rank killed once (tests/test_e2e.py) restarts and recovers: Degraded, not Failed; nor is a container that
    ran longer than the kubelet's back-off reset (10 minutes) before it failed, whatever its restart count."""
    port = free_port()
    once = rank_probe.pod_health(
        server_pod(crashed({"waiting": {"reason": "CrashLoopBackOff"}}, restarts=1), port=port), port, 1
    )
    long_run = rank_probe.pod_health(server_pod(crashed({"running": {}}, restarts=5, ran_s=3600), port=port), port, 1)
    s = spec(replicas=1)
    was_ready = build(s, workload(desired=1), [pod("ps-0", ready=True)])
    for health in (once, long_run):
        assert health.crash_loop == "" and not health.message.startswith("crash-looping"), health.message
        update = build(s, workload(desired=1), [health], previous=was_ready.document, now=at(5))
        assert update.document["phase"] == C.PHASE_DEGRADED
        assert reasons(update)[C.COND_AVAILABLE] == ("False", "ReplicasUnavailable")
        assert "CrashLoopBackOff" not in {e.reason for e in update.events}
    assert "--dtype bogus" in once.message  # the error line the kubelet kept, not "server closed"


def test_a_hung_pod_is_not_answering_rather_than_starting() -> None:
    """A SIGSTOPped server: the kernel still completes the handshake on its listening socket and nothing answers.
    It read "starting: /readyz unreachable" (and, before the kubelet noticed, RanksUnknown)."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    port = listener.getsockname()[1]
    try:
        running = {"restartCount": 0, "state": {"running": {}}}
        unnoticed = rank_probe.pod_health(
            server_pod(running, port=port, ready_condition={"type": "Ready", "status": "True"}), port, 1, timeout=0.3
        )
        noticed = rank_probe.pod_health(
            server_pod(
                running,
                port=port,
                ready_condition={"type": "Ready", "status": "False", "lastTransitionTime": at(12)},
            ),
            port,
            1,
            timeout=0.3,
        )
    finally:
        listener.close()
    for health in (unnoticed, noticed):
        assert health.message.startswith("not answering /readyz: connected, no answer in 0.3s"), health.message
        assert not health.ready and health.ranks_known and health.ranks_text == "0/1"
    assert noticed.message.endswith(f"the kubelet's readiness probe fails since {at(12)}"), noticed.message
    s = spec(replicas=1)
    was_ready = build(s, workload(desired=1), [pod("ps-0", ready=True)])
    hung = build(s, workload(desired=1), [unnoticed], previous=was_ready.document, now=at(15))
    assert hung.document["phase"] == C.PHASE_DEGRADED
    assert reasons(hung)[C.COND_AVAILABLE] == ("False", "ReplicasUnavailable")
    assert "not answering /readyz" in hung.document["pods"][0]["message"]
    assert "RanksUnknown" not in {e.reason for e in hung.events}


# --- a claim that binds, a claim that cannot (issue 40 item 11) ---------------------------------------

UNBOUND = (
    "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims. preemption: 0/1 nodes are "
    "available: 1 Preemption is not helpful for scheduling."
)
PROVISIONER = "example.com/provisioner"


def cache_claim(*, provisioner: str | None, phase: str = "Pending") -> V1PersistentVolumeClaim:
    annotations = (
        {"volume.kubernetes.io/storage-provisioner": provisioner} if provisioner else {}
    )  # the PV controller's
    return api_object(
        V1PersistentVolumeClaim,
        {
            "metadata": {"name": "ps-cache", "uid": "c1", "creationTimestamp": T0, "annotations": annotations},
            "status": {"phase": phase},
        },
    )


def on_claim(pod_: dict[str, Any]) -> dict[str, Any]:
    pod_["spec"]["volumes"] = [{"name": "cache", "persistentVolumeClaim": {"claimName": "ps-cache"}}]
    return pod_


def test_a_pod_waiting_for_its_new_claim_to_bind_is_no_warning_but_a_claim_nothing_provisions_is() -> None:
    """Every new PolicyServer posted a Warning "Unschedulable: pod has unbound immediate PersistentVolumeClaims"
    while its cache claim bound: the scheduler looks at the fetch pod before the provisioner has made the volume."""
    s = spec()
    scheduled_false = [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": UNBOUND}]
    fetch = on_claim(fetch_pod(conditions=scheduled_false))
    binding = cache_claim(provisioner=PROVISIONER)
    scheduler_said = {
        "type": "Warning",
        "reason": "FailedScheduling",
        "lastTimestamp": at(1),
        "involvedObject": {"uid": "pod-uid"},
        "message": UNBOUND,
    }

    def state(claim: V1PersistentVolumeClaim, now: int = 5) -> CheckpointState:
        return download_state.checkpoint_state(
            s,
            ACTIVE_JOB,
            [api_object(V1Pod, fetch)],
            None,
            None,
            api_objects(CoreV1Event, [scheduler_said]),
            now=datetime.datetime.fromisoformat(at(now).replace("Z", "+00:00")),
            claim=claim,
        )

    waiting = state(binding)
    assert (waiting.phase, waiting.reason) == (CheckpointPhase.PENDING, Reason.JOB_PENDING), waiting
    assert f"waiting for claim ps-cache (provisioner {PROVISIONER}) to be bound" in waiting.message
    update = fetch_status(s, waiting)
    assert not [e for e in update.events if e.type == "Warning"], update.events
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "Downloading")  # as any fetch pod on its way
    bound = state(cache_claim(provisioner=PROVISIONER, phase="Bound"))  # the scheduler's next try is due
    assert bound.reason == Reason.JOB_PENDING and "now that its claims are bound" in bound.message
    # a claim the provisioner never makes a volume for still stalls at the deadline, saying so
    stuck = state(binding, now=s.progress_deadline_seconds + 1)
    assert stuck.reason == Reason.PROGRESS_DEADLINE_EXCEEDED and "waiting for claim ps-cache" in stuck.message

    # a claim of a StorageClass that does not exist: the PV controller names no provisioner, nothing will bind it
    orphan = state(cache_claim(provisioner=None))
    assert (orphan.phase, orphan.reason) == (CheckpointPhase.PENDING, Reason.UNSCHEDULABLE)
    assert "unbound immediate PersistentVolumeClaims" in orphan.message
    assert ("Warning", "Unschedulable") in {(e.type, e.reason) for e in fetch_status(s, orphan).events}

    # the same for a server pod on its perPod claim
    server = api_object(
        V1Pod,
        on_claim(
            {
                "metadata": {"name": "ps-0", "labels": {C.LABEL_CONTROLLER_REVISION_HASH: "r2"}},
                "spec": {},
                "status": {"phase": "Pending", "conditions": scheduled_false},
            }
        ),
    )
    starting = rank_probe.pod_health(server, 8000, 1, claims=[binding])
    assert starting.unschedulable == "" and "waiting for claim ps-cache" in starting.message
    first = build(spec(replicas=1), workload(desired=1, rolling=True), [starting], previous={"phase": "Pending"})
    assert first.document["phase"] == C.PHASE_STARTING
    assert not [e for e in first.events if e.type == "Warning"], first.events
    refused = rank_probe.pod_health(server, 8000, 1, claims=[cache_claim(provisioner=None)])
    assert refused.unschedulable == UNBOUND
    blocked = build(spec(replicas=1), workload(desired=1, rolling=True), [refused], previous={"phase": "Pending"})
    assert reasons(blocked)[C.COND_AVAILABLE] == ("False", "Unschedulable")


# --- a fetch pod that does not start ---------------------------------------------------------------


def fetch_pod(
    *,
    created: str = T0,
    conditions: list[dict[str, Any]] | None = None,
    waiting: dict[str, Any] | None = None,
    scheduler: str | None = None,
) -> dict[str, Any]:
    spec_: dict[str, Any] = {"schedulerName": scheduler} if scheduler else {}
    status: dict[str, Any] = {"phase": "Pending", "conditions": conditions or []}
    if waiting is not None:
        status["containerStatuses"] = [{"name": manifests.FETCH_CONTAINER, "state": {"waiting": waiting}}]
    return {
        "metadata": {"name": "ps-fetch-k-abc", "uid": "pod-uid", "creationTimestamp": created},
        "spec": spec_,
        "status": status,
    }


ACTIVE_JOB = api_object(V1Job, {"metadata": {"name": "ps-fetch-k", "uid": "job-uid"}, "status": {"active": 1}})


def fetch_state(s, pod_: dict[str, Any], *, now: int = 5, events: list[dict[str, Any]] | None = None):
    return download_state.checkpoint_state(
        s,
        ACTIVE_JOB,
        [api_object(V1Pod, pod_)],
        None,
        None,
        api_objects(CoreV1Event, events or []),
        now=datetime.datetime.fromisoformat(at(now).replace("Z", "+00:00")),
    )


def fetch_status(s, state: CheckpointState, previous: dict[str, Any] | None = None) -> st.StatusUpdate:
    update = st.build_status(
        s,
        checkpoint=state,
        workload=WorkloadState(exists=False, desired=1, rolling=True),
        pods=[],
        service_exists=False,
        previous=previous,
        generation=1,
        now=at(5),
    )
    PolicyServerStatus.model_validate(update.document)
    return update


def test_an_unschedulable_fetch_pod_is_pending_with_the_schedulers_message_not_downloading() -> None:
    """The Job counts a Pending pod as active: that is not a download (it read "Downloading (attempt 1/4)")."""
    why = "0/1 nodes are available: 1 node(s) didn't match Pod's node affinity/selector."
    s = spec()
    state = fetch_state(
        s,
        fetch_pod(conditions=[{"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": why}]),
    )
    assert (state.phase, state.reason) == (CheckpointPhase.PENDING, Reason.UNSCHEDULABLE)
    assert why in state.message
    update = fetch_status(s, state)
    assert update.document["phase"] == C.PHASE_PENDING and update.document["checkpoint"]["phase"] == "Pending"
    assert reasons(update)[C.COND_CHECKPOINT_READY] == ("False", "Unschedulable")
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "Unschedulable")
    assert reasons(update)[C.COND_READY] == ("False", "Unschedulable") and why in cond(update, C.COND_READY)["message"]
    assert [(e.type, e.reason) for e in update.events if e.type == "Warning"] == [("Warning", "Unschedulable")]
    again = fetch_status(s, state, previous=update.document)
    assert not [e for e in again.events if e.type == "Warning"]  # once, not every pass


def test_a_fetch_pod_the_kubelet_cannot_start_says_the_kubelets_message() -> None:
    s = spec()
    config = fetch_pod(
        conditions=[{"type": "PodScheduled", "status": "True"}],
        waiting={"reason": "CreateContainerConfigError", "message": 'secret "hf" not found'},
    )
    state = fetch_state(s, config)
    assert (state.phase, state.reason) == (CheckpointPhase.PENDING, Reason.FETCH_POD_NOT_STARTING)
    assert 'secret "hf" not found' in state.message
    # a volume that cannot be mounted: the real kubelet says ContainerCreating, and why only in a pod Event
    creating = fetch_pod(
        conditions=[{"type": "PodScheduled", "status": "True"}], waiting={"reason": "ContainerCreating"}
    )
    assert fetch_state(s, creating).reason == Reason.JOB_PENDING
    mount = {
        "type": "Warning",
        "reason": "FailedMount",
        "lastTimestamp": at(3),
        "involvedObject": {"uid": "pod-uid"},
        "message": 'MountVolume.SetUp failed for volume "checkpoint-token" : secret "hf" not found',
    }
    state = fetch_state(s, creating, events=[mount])
    assert state.reason == Reason.FETCH_POD_NOT_STARTING and "FailedMount" in state.message
    update = fetch_status(s, state)
    assert update.document["phase"] == C.PHASE_PENDING
    assert reasons(update)[C.COND_PROGRESSING] == ("True", "FetchPodNotStarting")
    assert ("Warning", "FetchPodNotStarting") in {(e.type, e.reason) for e in update.events}


def test_a_fetch_pod_no_scheduler_takes_is_stalled_past_the_progress_deadline() -> None:
    s = spec(progressDeadlineSeconds=30)
    orphan = fetch_pod(scheduler="gang-scheduler")
    early = fetch_state(s, orphan, now=10)
    assert early.reason == Reason.JOB_PENDING and "gang-scheduler" in early.message
    late = fetch_state(s, orphan, now=31)
    assert (late.phase, late.reason) == (CheckpointPhase.FAILED, Reason.PROGRESS_DEADLINE_EXCEEDED)
    assert "no scheduler has taken it (schedulerName gang-scheduler)" in late.message
    update = fetch_status(s, late)
    assert update.document["phase"] == C.PHASE_FAILED
    assert reasons(update)[C.COND_PROGRESSING] == ("False", "ProgressDeadlineExceeded")
    assert reasons(update)[C.COND_STALLED] == ("True", "ProgressDeadlineExceeded")


def test_a_fetch_pod_that_runs_is_downloading() -> None:
    s = spec()
    running = fetch_pod(conditions=[{"type": "PodScheduled", "status": "True"}])
    running["status"]["containerStatuses"] = [{"name": manifests.FETCH_CONTAINER, "state": {"running": {}}}]
    state = fetch_state(s, running, now=10_000)
    assert (state.phase, state.reason) == (CheckpointPhase.DOWNLOADING, Reason.DOWNLOADING)
    assert "attempt 1/4" in state.message


# --- the checkpoint is on the claim it was fetched into ----------------------------------------------


def claim_obj(uid: str, created: str) -> V1PersistentVolumeClaim:
    return api_object(
        V1PersistentVolumeClaim, {"metadata": {"name": "ps-cache", "uid": uid, "creationTimestamp": created}}
    )


def test_a_fetch_job_older_than_the_claim_does_not_vouch_for_the_checkpoint() -> None:
    """A claim deleted and made again is empty: the Job that filled the old one must not keep CheckpointReady True
    (the pods crash-looped on "checkpoint not fetched")."""
    s = spec()
    done = api_object(
        V1Job,
        {
            "metadata": {"name": "ps-fetch-k", "creationTimestamp": at(10)},
            "status": {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]},
        },
    )
    same = download_state.checkpoint_state(s, done, [], None, claim=claim_obj("c1", at(10)))
    assert (same.phase, same.claim_uid, same.stale_job) == (CheckpointPhase.READY, "c1", False)
    recreated = download_state.checkpoint_state(s, done, [], None, claim=claim_obj("c2", at(60)))
    assert recreated.phase == CheckpointPhase.PENDING and recreated.stale_job and "gone" in recreated.message
    # the Job gone (its TTL): the record says which claim the checkpoint is on
    recorded = {"key": s.checkpoint.key, "phase": "Ready", "claimUid": "c1"}
    kept = download_state.checkpoint_state(s, None, [], recorded, claim=claim_obj("c1", at(10)))
    assert kept.phase == CheckpointPhase.READY and kept.claim_uid == "c1"
    again = download_state.checkpoint_state(s, None, [], recorded, claim=claim_obj("c2", at(60)))
    assert again.phase == CheckpointPhase.PENDING and not again.stale_job and "ps-cache is new" in again.message
    update = st.build_status(
        s,
        checkpoint=kept,
        workload=WorkloadState(exists=False, desired=1, rolling=True),
        pods=[],
        service_exists=False,
        previous=None,
        generation=1,
        now=T0,
    )
    assert update.document["checkpoint"]["claimUid"] == "c1"
    PolicyServerStatus.model_validate(update.document)


def test_the_schedulers_old_warning_does_not_explain_a_pod_it_has_placed() -> None:
    placed = fetch_pod(conditions=[{"type": "PodScheduled", "status": "True"}], waiting={"reason": "ContainerCreating"})
    old = {
        "type": "Warning",
        "reason": "FailedScheduling",
        "lastTimestamp": at(1),
        "involvedObject": {"uid": "pod-uid"},
        "message": "0/1 nodes are available: pod has unbound immediate PersistentVolumeClaims.",
    }
    events = [api_object(CoreV1Event, old)]
    assert download_state.start_problem(api_object(V1Pod, placed), events) is None
    waiting = fetch_pod(waiting={"reason": "ContainerCreating"})
    assert (
        download_state.start_problem(api_object(V1Pod, waiting), events) is not None
    )  # not placed yet: the scheduler's word stands


# --- batching under a latency budget --------------------------------------------------------------


def measured(max_batch: int, **buckets_ms: float) -> rank_probe.Batching:
    """What a pod's /readyz says under --latency-budget-ms, read the way the probe reads it."""
    body = {
        "ready": True,
        "world_size": 1,
        "ranks_ready": 1,
        "ranks": [{"rank": 0, "dp_index": 0, "cfg_index": 0, "state": "serving", "age_s": 0.1, "ready": True}],
        "max_batch": max_batch,
        "batch_buckets_ms": {size.removeprefix("b"): ms for size, ms in buckets_ms.items()},
    }
    batching = rank_probe.read_readyz(200, json.dumps(body).encode(), 1).batching
    assert batching is not None
    return batching


BUDGET = {"device": "cpu", "batching": {"maxBatch": 8, "latencyBudgetMs": 20}}


def test_status_batching_is_what_the_newest_ready_pod_of_the_current_spec_measured() -> None:
    old = measured(8, b1=10.0, b2=11.0, b4=12.0, b8=15.0)  # an old template, measured under another spec
    current = measured(4, b1=14.5, b2=16.0, b4=19.5, b8=24.0)
    newer = measured(2, b1=15.0, b2=17.0, b4=21.0, b8=26.0)
    wl = workload(desired=2, rolling=True)
    pods = [
        pod("ps-0", ready=True, revision="r1", created=at(30), batching=old),
        pod("ps-1", ready=True, created=at(10), batching=current),
        pod("ps-2", ready=False, created=at(20), batching=newer),  # not ready: not serving with these yet
    ]
    doc = build(spec(runtime=BUDGET), wl, pods).document
    assert doc["batching"] == {
        "maxBatch": 4,
        "bucketsMs": {"1": 14.5, "2": 16.0, "4": 19.5, "8": 24.0},
        "pod": "ps-1",
    }
    pods[2] = dataclasses.replace(pods[2], ready=True)
    assert build(spec(runtime=BUDGET), wl, pods).document["batching"]["pod"] == "ps-2"  # the newest one
    only_old = [pods[0], pod("ps-1", ready=True, created=at(10))]  # a runtime that serves no batch times
    assert build(spec(runtime=BUDGET), wl, only_old).document["batching"]["pod"] == "ps-0"


def test_no_status_batching_without_a_budget_or_a_measurement() -> None:
    pods = [pod("ps-0", ready=True, created=at(10), batching=measured(8, b1=1.0, b8=2.0))]
    assert "batching" not in build(spec(), workload(desired=1), pods).document  # the budget was just removed
    unmeasured = [pod("ps-0", ready=True, created=at(10)), pod("ps-1", ready=False)]
    assert "batching" not in build(spec(runtime=BUDGET), workload(desired=2), unmeasured).document


def test_a_bucket_no_longer_measured_is_removed_from_the_status() -> None:
    """A merge patch merges maps at every depth: maxBatch lowered from 8 to 4 must null bucketsMs["8"]."""
    wl = workload(desired=1)
    before = build(spec(runtime=BUDGET), wl, [pod("ps-0", ready=True, batching=measured(8, b1=1.0, b4=2.0, b8=3.0))])
    after = build(spec(runtime=BUDGET), wl, [pod("ps-0", ready=True, batching=measured(4, b1=1.0, b4=2.5))])
    patch = st.status_patch(before.document, after.document, full=True)
    assert patch is not None
    assert patch["batching"] == {"maxBatch": 4, "bucketsMs": {"1": 1.0, "4": 2.5, "8": None}, "pod": "ps-0"}
