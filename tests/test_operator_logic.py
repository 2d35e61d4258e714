"""The operator's decisions, one pure function at a time: phases, conditions, Job/rollout states, plans, /readyz."""

from __future__ import annotations

import argparse
import contextlib
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from kubernetes.client import V1Job, V1PersistentVolumeClaim, V1Pod, V1Service, V1StatefulSet

from policy_operator import constants as C
from policy_operator.operator import conditions as cond
from policy_operator.operator import download_state, manifests, rank_probe, rbac, workload_state
from policy_operator.operator import plan as pl
from policy_operator.operator import status as status_step
from policy_operator.operator.conditions import Reason
from policy_operator.operator.download_state import CheckpointPhase
from policy_operator.operator.kube import KINDS
from policy_operator.operator.kube_objects import api_json
from policy_operator.operator.resource import PolicyServerStatus
from policy_operator.operator.spec import parse_spec
from tests.support.api_objects import api_object, observed_field, observed_of
from tests.support.net import free_port

NOW, LATER = "2025-01-01T00:00:00Z", "2025-01-01T00:05:00Z"
OWNER = {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": "ps", "namespace": "ns", "uid": "uid-1"}}


def spec(**overrides: Any):
    body: dict[str, Any] = {"image": "img:1", "checkpoint": {"source": "hf://org/p"}}
    body.update(overrides)
    return parse_spec(body, name="ps", namespace="ns")


# --- conditions -------------------------------------------------------------------------------


def test_transition_time_moves_only_when_the_status_flips() -> None:
    first = cond.merge_conditions(
        None, [cond.Condition("Available", "False", Reason.NO_REPLICAS_READY, "0/1")], generation=1, now=NOW
    )
    same = cond.merge_conditions(
        first, [cond.Condition("Available", "False", Reason.REPLICAS_UNAVAILABLE, "0/2")], generation=2, now=LATER
    )
    assert same[0]["lastTransitionTime"] == NOW and same[0]["observedGeneration"] == 2
    assert same[0]["reason"] == "ReplicasUnavailable"
    flipped = cond.merge_conditions(
        same, [cond.Condition("Available", "True", Reason.REPLICAS_READY, "1/1")], generation=2, now=LATER
    )
    assert flipped[0]["lastTransitionTime"] == LATER


def test_foreign_conditions_are_kept_and_ours_are_ordered() -> None:
    previous = [{"type": "Custom", "status": "True", "reason": "X", "lastTransitionTime": NOW}]
    merged = cond.merge_conditions(
        previous,
        [cond.Condition(t, "True", Reason.STABLE) for t in reversed(cond.CONDITION_TYPES)],
        generation=1,
        now=NOW,
    )
    assert [c["type"] for c in merged] == [*cond.CONDITION_TYPES, "Custom"]


def test_events_only_for_changes_warning_for_bad_reasons() -> None:
    previous = [{"type": "Valid", "status": "True", "reason": "SpecValid"}]
    assert cond.condition_events(previous, [cond.Condition("Valid", "True", Reason.SPEC_VALID, "other text")]) == []
    [event] = cond.condition_events(previous, [cond.Condition("Valid", "False", Reason.INVALID_SPEC, "bad")])
    assert (event.type, event.reason, event.message) == ("Warning", "InvalidSpec", "Valid=False: bad")
    [event] = cond.condition_events([], [cond.Condition("CheckpointReady", "False", Reason.DOWNLOADING, "x")])
    assert event.type == "Normal"
    assert cond.phase_event("Ready", "Ready", "m") == []
    assert cond.phase_event("Ready", "Degraded", "m")[0].type == "Warning"


CK = {
    phase.value: download_state.CheckpointState(phase, reason, "m", "j")
    for phase, reason in (
        (CheckpointPhase.PENDING, Reason.JOB_PENDING),
        (CheckpointPhase.DOWNLOADING, Reason.DOWNLOADING),
        (CheckpointPhase.READY, Reason.DOWNLOADED),
        (CheckpointPhase.FAILED, Reason.FETCH_FAILED),
    )
}


def workload(exists: bool = True, desired: int = 2, rolling: bool = False, serving: str | None = "k"):
    return workload_state.WorkloadState(
        exists=exists,
        desired=desired,
        current=desired if exists else 0,
        rolling=rolling,
        serving_key=serving if exists else None,
    )


@pytest.mark.parametrize(
    ("ck", "wl", "ready", "previous", "expected"),
    [
        ("Pending", workload(exists=False), 0, None, C.PHASE_PENDING),
        ("Downloading", workload(exists=False), 0, C.PHASE_PENDING, C.PHASE_DOWNLOADING),
        ("Failed", workload(exists=False), 0, C.PHASE_DOWNLOADING, C.PHASE_FAILED),
        ("Failed", workload(), 2, C.PHASE_READY, C.PHASE_DEGRADED),  # new checkpoint failed, old one still serves
        ("Downloading", workload(), 2, C.PHASE_READY, C.PHASE_DOWNLOADING),  # new checkpoint on its way
        ("Ready", workload(rolling=True), 0, C.PHASE_DOWNLOADING, C.PHASE_STARTING),
        ("Ready", workload(), 1, C.PHASE_STARTING, C.PHASE_STARTING),  # never was Ready: still starting
        ("Ready", workload(), 2, C.PHASE_STARTING, C.PHASE_READY),
        ("Ready", workload(), 3, C.PHASE_READY, C.PHASE_READY),  # scaling down: extra ready pods
        ("Ready", workload(), 1, C.PHASE_READY, C.PHASE_DEGRADED),
        ("Ready", workload(), 0, C.PHASE_DEGRADED, C.PHASE_DEGRADED),
        ("Ready", workload(rolling=True), 1, C.PHASE_READY, C.PHASE_STARTING),  # a rollout replaces pods
        ("Ready", workload(desired=0), 0, C.PHASE_READY, C.PHASE_PENDING),
    ],
)
def test_phase_table(
    ck: str, wl: workload_state.WorkloadState, ready: int, previous: str | None, expected: str
) -> None:
    assert (
        status_step.decide_phase(checkpoint=CK[ck], workload=wl, ready_pods=ready, previous_phase=previous) == expected
    )


def _pod(name: str, ready: bool, ranks: int, world: int = 2) -> rank_probe.PodHealth:
    return rank_probe.PodHealth(name, "10.0.0.1", "Running", world, ranks, ready)


def test_build_status_counts_pods_and_ranks() -> None:
    s = spec(parallelism={"cfgp": 2, "dp": 1}, replicas=2)
    update = status_step.build_status(
        s,
        checkpoint=CK["Ready"],
        workload=workload(),
        pods=[_pod("a", True, 2), _pod("b", False, 1)],
        service_exists=True,
        previous=None,
        generation=4,
        now=NOW,
    )
    st = update.document
    assert (st["ready"], st["readyReplicas"], st["ranksReady"], st["replicas"]) == ("1/2", 1, "3/4", 2)
    assert st["endpoint"] == "ws://ps.ns.svc:8000" and st["observedGeneration"] == 4
    assert st["selector"] == manifests.selector_string("ps") and st["layout"] == "cfgp=2,dp=1"
    available = next(c for c in st["conditions"] if c["type"] == C.COND_AVAILABLE)
    assert (available["status"], available["reason"]) == ("True", "PartiallyReady")
    assert {e.reason for e in update.events} >= {"SpecValid", "PartiallyReady", C.PHASE_STARTING}
    assert "lerobotGrpcEndpoint" not in st  # no gRPC port in the spec


def test_build_status_reports_the_lerobot_grpc_address() -> None:
    """robot_client's --server_address, once the Service exists (spec.service.lerobotGrpcPort)."""
    s = spec(policy={"type": "lerobot"}, service={"port": 8000, "lerobotGrpcPort": 8080})
    common: dict[str, Any] = {"checkpoint": CK["Ready"], "workload": workload(), "pods": [], "previous": None}
    built = status_step.build_status(s, service_exists=True, generation=1, now=NOW, **common).document
    assert built["lerobotGrpcEndpoint"] == "ps.ns.svc:8080" and built["endpoint"] == "ws://ps.ns.svc:8000"
    before = status_step.build_status(s, service_exists=False, generation=1, now=NOW, **common).document
    assert "lerobotGrpcEndpoint" not in before


def test_losing_every_ready_pod_is_a_warning() -> None:
    s = spec(replicas=1)
    ready = status_step.build_status(
        s,
        checkpoint=CK["Ready"],
        workload=workload(desired=1),
        pods=[_pod("a", True, 1, 1)],
        service_exists=True,
        previous=None,
        generation=1,
        now=NOW,
    )
    lost = status_step.build_status(
        s,
        checkpoint=CK["Ready"],
        workload=workload(desired=1),
        pods=[_pod("a", False, 0, 1)],
        service_exists=True,
        previous=ready.document,
        generation=1,
        now=LATER,
    )
    assert lost.document["phase"] == C.PHASE_DEGRADED
    kinds = {(e.type, e.reason) for e in lost.events}
    assert ("Warning", "ReplicasUnavailable") in kinds and ("Warning", C.PHASE_DEGRADED) in kinds


def test_invalid_status_keeps_what_runs() -> None:
    available = {
        "type": "Available",
        "status": "True",
        "reason": "ReplicasReady",
        "message": "1/1",
        "lastTransitionTime": NOW,
    }
    previous = {"phase": "Ready", "conditions": [available]}  # as stored: the CRD requires message and the time
    update = status_step.invalid_status(ValueError("spec.x: bad"), previous=previous, generation=5, now=NOW)
    assert update.document["phase"] == C.PHASE_FAILED
    types = {c["type"]: c for c in update.document["conditions"]}
    assert types["Valid"]["status"] == "False" and types["Available"]["status"] == "True"
    assert set(update.document) == {"observedGeneration", "phase", "conditions"}


# --- download_state: the fetch Job -------------------------------------------------------------------------


def job(**status: Any) -> V1Job:
    return api_object(V1Job, {"metadata": {"name": "j"}, "status": status})


def fetch_pod(exit_code: int, message: str, created: str = NOW) -> V1Pod:
    return api_object(
        V1Pod,
        {
            "metadata": {"name": f"p{exit_code}", "creationTimestamp": created},
            "status": {
                "containerStatuses": [
                    {
                        "name": manifests.FETCH_CONTAINER,
                        "state": {"terminated": {"exitCode": exit_code, "message": message}},
                    }
                ]
            },
        },
    )


def test_checkpoint_states_of_a_job() -> None:
    s = spec()
    state = download_state.checkpoint_state
    assert state(s, None, [], None).phase == "Pending"
    assert state(s, None, [], {"key": s.checkpoint.key, "phase": "Ready"}).phase == "Ready"  # Job gone by TTL
    assert state(s, None, [], {"key": "other", "phase": "Ready"}).phase == "Pending"
    waiting = api_object(
        V1Pod,
        {
            "metadata": {"name": "p"},
            "status": {
                "containerStatuses": [
                    {"name": "fetch", "state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}
                ]
            },
        },
    )
    pending = state(s, job(), [waiting], None)
    assert pending.phase == "Pending" and "ImagePullBackOff" in pending.message
    active = state(s, job(active=1), [], None)
    assert (active.phase, active.reason) == ("Downloading", "Downloading") and "attempt 1/4" in active.message
    retry = state(s, job(active=1, failed=1), [fetch_pod(3, "policyserver fetch: error: 503 from host")], None)
    assert "attempt 2/4" in retry.message and "503 from host" in retry.message
    between = state(s, job(failed=2), [fetch_pod(3, "policyserver fetch: error: timeout")], None)
    assert (between.phase, between.reason) == ("Downloading", "Retrying")
    assert state(s, job(succeeded=1), [], None).phase == "Ready"
    assert state(s, job(conditions=[{"type": "Complete", "status": "True"}]), [], None).phase == "Ready"


def test_a_fetch_job_created_by_the_pass_reads_as_waiting_for_its_pod() -> None:
    """reconcile does not read a Job it has just created: its state is the one a Job with no pod yet has."""
    s = spec()
    name = manifests.Names("ps").job(s.checkpoint.key)
    just_created = api_object(V1Job, {"metadata": {"name": name, "creationTimestamp": NOW}, "status": {}})
    claim = api_object(
        V1PersistentVolumeClaim,
        {"metadata": {"name": "ps-cache", "uid": "c1", "creationTimestamp": "2020-01-01T00:00:00Z"}},
    )
    expected = download_state.waiting_for_fetch_pod(name)
    assert download_state.checkpoint_state(s, just_created, [], None, claim=claim) == expected
    assert download_state.checkpoint_state(s, just_created, [], {"key": "old", "phase": "Ready"}) == expected
    assert (expected.phase, expected.reason) == ("Pending", "JobPending")


@pytest.mark.parametrize(
    ("code", "reason"),
    [
        (2, "InvalidSource"),
        (3, "SourceUnreachable"),
        (4, "VerificationFailed"),
        (5, "DiskFull"),
        (6, "SourceNotFound"),
        (1, "FetchFailed"),
    ],
)
def test_failed_job_reason_comes_from_the_fetch_exit_code(code: int, reason: str) -> None:
    failed = job(
        failed=1,
        conditions=[
            {
                "type": "Failed",
                "status": "True",
                "reason": "BackoffLimitExceeded",
                "message": "Job has reached the specified backoff limit",
            }
        ],
    )
    pods = [
        fetch_pod(1, "old", "2024-01-01T00:00:00Z"),
        fetch_pod(code, "progress 10%\npolicyserver fetch: error: the real reason\n", NOW),
    ]
    state = download_state.checkpoint_state(spec(), failed, pods, None)
    assert (state.phase, state.reason) == ("Failed", reason)
    assert "the real reason" in state.message


def test_failed_job_without_pods_uses_the_job_message() -> None:
    failed = job(
        conditions=[
            {
                "type": "Failed",
                "status": "True",
                "reason": "DeadlineExceeded",
                "message": "Job was active longer than specified deadline",
            }
        ]
    )
    state = download_state.checkpoint_state(spec(), failed, [], None)
    assert state.reason == "DeadlineExceeded" and "longer than specified deadline" in state.message


def sts(generation: int = 2, spec_replicas: int = 2, **status: Any) -> V1StatefulSet:
    return api_object(
        V1StatefulSet,
        {
            "metadata": {
                "generation": generation,
                "labels": {C.LABEL_CHECKPOINT_KEY: "k"},
                "annotations": {C.ANNOTATION_TEMPLATE_HASH: "h"},
            },
            "spec": {"replicas": spec_replicas},
            "status": status,
        },
    )


def test_rollout_state_of_a_statefulset() -> None:
    done: dict[str, Any] = dict(
        observedGeneration=2, replicas=2, updatedReplicas=2, currentRevision="r1", updateRevision="r1"
    )
    settled = workload_state.workload_state(sts(**done), 2)
    assert not settled.rolling and settled.serving_key == "k" and settled.template_hash == "h"
    assert workload_state.workload_state(sts(**{**done, "observedGeneration": 1}), 2).rolling
    assert workload_state.workload_state(sts(**{**done, "updateRevision": "r2"}), 2).rolling
    assert workload_state.workload_state(sts(**{**done, "updatedReplicas": 1}), 2).rolling
    assert workload_state.workload_state(sts(**done), 3).rolling  # the spec asks for more than the StatefulSet has
    assert not workload_state.workload_state(None, 2).exists


# --- rank_probe: /readyz ---------------------------------------------------------------------------------


def readyz_body(ranks: list[bool], cfgp: int = 2) -> bytes:
    return json.dumps(
        {
            "ready": all(ranks),
            "world_size": len(ranks),
            "ranks_ready": sum(ranks),
            "layout": {"cfgp": cfgp, "dp": len(ranks) // cfgp, "world_size": len(ranks)},
            "ranks": [
                {
                    "rank": i,
                    "dp_index": i // cfgp,
                    "cfg_index": i % cfgp,
                    "state": "serving" if ok else "loading",
                    "age_s": 0.2,
                    "ready": ok,
                }
                for i, ok in enumerate(ranks)
            ],
        }
    ).encode()


def test_parse_readyz() -> None:
    ready, n, world, ranks, message = rank_probe.parse_readyz(200, readyz_body([True] * 4), 4)
    assert (ready, n, world, message) == (True, 4, 4, "") and ranks[3].dp_index == 1 and ranks[3].cfg_index == 1
    ready, n, world, ranks, message = rank_probe.parse_readyz(503, readyz_body([True, False, True, False]), 4)
    assert (ready, n) == (False, 2) and message == "2/4 ranks ready (rank 1 loading, rank 3 loading)"
    # a 200 that claims ready with missing ranks is not trusted
    claim = json.dumps({"ready": True, "world_size": 4, "ranks_ready": 3, "ranks": []}).encode()
    assert rank_probe.parse_readyz(200, claim, 4)[0] is False
    ready, n, world, _, message = rank_probe.parse_readyz(200, b"<html>", 2)
    assert (ready, n, world) == (False, 0, 2) and "malformed" in message


def test_readyz_batch_times_are_read_and_older_documents_have_none() -> None:
    """A runtime under --latency-budget-ms serves its bucket times (JSON keys are strings); one without a budget,
    or an older runtime, serves none and its pod carries no batching."""
    assert rank_probe.read_readyz(200, readyz_body([True, True]), 2).batching is None
    unbudgeted = {**json.loads(readyz_body([True, True])), "max_batch": 8}
    assert rank_probe.read_readyz(200, json.dumps(unbudgeted).encode(), 2).batching is None
    budget = {**unbudgeted, "max_batch": 2, "batch_buckets_ms": {"4": 30.5, "1": 14.5, "2": 19.0}}
    facts = rank_probe.read_readyz(200, json.dumps(budget).encode(), 2)
    assert facts.ready and facts.batching == rank_probe.Batching(2, ((1, 14.5), (2, 19.0), (4, 30.5)))
    assert facts.batching.as_status() == {"maxBatch": 2, "bucketsMs": {"1": 14.5, "2": 19.0, "4": 30.5}}


@contextlib.contextmanager
def http_server(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_probe_readyz_over_http() -> None:
    answers: dict[str, Any] = {"code": 503, "body": readyz_body([True, False])}

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(answers["code"])
            self.end_headers()
            self.wfile.write(answers["body"])

        def log_message(self, *args: Any) -> None:
            pass

    with http_server(Handler) as port:
        assert rank_probe.probe_readyz("127.0.0.1", port, 2, timeout=2)[:2] == (False, 1)  # 503 body still read
        answers.update(code=200, body=readyz_body([True, True]))
        assert rank_probe.probe_readyz("127.0.0.1", port, 2, timeout=2)[:2] == (True, 2)
    ready, n, _, _, message = rank_probe.probe_readyz("127.0.0.1", free_port(), 2, timeout=1)
    assert (ready, n) == (False, 0) and "unreachable" in message


def test_a_hung_pod_costs_one_timeout() -> None:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepts connections, never answers
    try:
        port = listener.getsockname()[1]
        pods = [
            api_object(V1Pod, {"metadata": {"name": f"ps-{i}"}, "status": {"phase": "Running", "podIP": "127.0.0.1"}})
            for i in (1, 0)
        ]
        result = rank_probe.poll_pods(pods, port, 2, timeout=0.3)
        assert [p.name for p in result] == ["ps-0", "ps-1"]
        # reachable and silent is hung (a SIGSTOPped server), not "starting: /readyz unreachable" (issue 40 item 13)
        assert all(not p.ready and p.ranks_ready == 0 for p in result)
        assert all(p.message.startswith("not answering /readyz: connected, no answer in 0.3s") for p in result), [
            p.message for p in result
        ]
    finally:
        listener.close()


def test_pod_messages_say_why_it_is_not_running() -> None:
    init_failed = {
        "metadata": {"name": "ps-0"},
        "status": {
            "phase": "Pending",
            "initContainerStatuses": [
                {
                    "name": manifests.VERIFY_CONTAINER,
                    "state": {"waiting": {"reason": "CrashLoopBackOff"}},
                    "lastState": {
                        "terminated": {"exitCode": 1, "message": "checkpoint /models/k: .complete.json missing\n"}
                    },
                }
            ],
        },
    }
    h = rank_probe.pod_health(api_object(V1Pod, init_failed), 8000, 2)
    assert h.message == "verify-checkpoint: CrashLoopBackOff: checkpoint /models/k: .complete.json missing"
    unscheduled = {
        "metadata": {"name": "ps-1"},
        "status": {
            "phase": "Pending",
            "conditions": [
                {"type": "PodScheduled", "status": "False", "message": "0/3 nodes have 2 free nvidia.com/gpu"}
            ],
        },
    }
    assert "nvidia.com/gpu" in rank_probe.pod_health(api_object(V1Pod, unscheduled), 8000, 2).message
    going = {"metadata": {"name": "ps-2", "deletionTimestamp": NOW}, "status": {"phase": "Running"}}
    assert rank_probe.pod_health(api_object(V1Pod, going), 8000, 2).phase == "Terminating"


def test_pod_port_follows_the_pods_own_spec() -> None:
    pod = api_object(V1Pod, {"spec": {"containers": [{"ports": [{"name": C.PORT_NAME, "containerPort": 9001}]}]}})
    assert rank_probe.pod_port(pod, 8000) == 9001 and rank_probe.pod_port(V1Pod(), 8000) == 8000


# --- the plan -----------------------------------------------------------------------------------------


def changes(plan: pl.Plan) -> list[pl.Write]:
    """The writes that change something (those with an Event); the rest re-assert what exists."""
    return [w for w in plan.writes if w.event is not None]


def created(plan: pl.Plan) -> list[str]:
    return [f"{w.kind}/{w.name}" for w in plan.writes if w.event is not None and w.event.reason == "Created"]


def as_observed(plan: pl.Plan, observed: pl.Observed | None = None) -> pl.Observed:
    """Feed the plan's created objects back as if the API server had stored them."""
    observed = observed or pl.Observed()
    for action in changes(plan):
        assert action.event is not None  # changes() keeps the writes with an Event
        if action.event.reason != "Created":
            continue
        attr = {"PersistentVolumeClaim": "pvc", "Job": "job", "StatefulSet": "statefulset"}.get(action.kind)
        if action.kind == "Service":
            attr = "headless_service" if action.name.endswith("-pods") else "service"
        assert attr is not None, f"no Observed field for a created {action.kind}"
        setattr(observed, attr, observed_field(attr, action.body))
    return observed


def test_plan_order_and_idempotence() -> None:
    s = spec()
    pending = download_state.checkpoint_state(s, None, [], None)
    first = pl.plan(s, OWNER, pl.Observed(), pending)
    assert created(first) == ["PersistentVolumeClaim/ps-cache", f"Job/ps-fetch-{s.checkpoint.key}"]
    assert first.serving is None
    observed = as_observed(first)
    assert changes(pl.plan(s, OWNER, observed, pending)) == []  # nothing twice
    ready = download_state.CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, "", "j")
    second = pl.plan(s, OWNER, observed, ready)
    assert created(second) == ["StatefulSet/ps", "Service/ps-pods", "Service/ps"]
    for action in second.writes:
        assert action.body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"
    again = pl.plan(s, OWNER, as_observed(second, observed), ready)
    assert changes(again) == []
    # every pass still server-side applies what it owns, so a hand edit is put back
    assert [(w.verb, w.kind) for w in again.writes] == [
        (pl.Verb.APPLY, "StatefulSet"),
        (pl.Verb.APPLY, "Service"),
        (pl.Verb.APPLY, "Service"),
    ]


def test_plan_keeps_the_old_checkpoint_serving_while_the_new_one_downloads() -> None:
    old, new = spec(), spec(checkpoint={"source": "hf://org/p", "revision": "v2"})
    ready = download_state.CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, "", "j")
    observed = as_observed(pl.plan(old, OWNER, pl.Observed(), ready))
    downloading = download_state.CheckpointState(CheckpointPhase.DOWNLOADING, Reason.DOWNLOADING, "", "j2")
    observed.job = None  # the new key's Job does not exist yet
    plan = pl.plan(new, OWNER, observed, downloading)
    assert created(plan) == [f"Job/ps-fetch-{new.checkpoint.key}"]
    assert plan.serving is not None
    assert plan.serving.key == old.checkpoint.key and changes(plan)[1:] == []
    [kept] = [w for w in plan.writes if w.kind == "StatefulSet"]
    assert observed.statefulset is not None and observed.statefulset.spec is not None
    assert kept.body["spec"]["template"] == api_json(observed.statefulset.spec.template)
    rolled = pl.plan(new, OWNER, observed, ready)
    [patch] = [a for a in changes(rolled) if a.kind == "StatefulSet"]
    assert patch.body["spec"]["template"] != api_json(observed.statefulset.spec.template)
    assert patch.event is not None
    assert f"{old.checkpoint.key} -> {new.checkpoint.key}" in patch.event.message


def test_scaling_patches_replicas_not_the_template() -> None:
    ready = download_state.CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, "", "j")
    observed = as_observed(pl.plan(spec(replicas=1), OWNER, pl.Observed(), ready))
    plan = pl.plan(spec(replicas=3), OWNER, observed, ready)
    patch, pdb = changes(plan)
    assert patch.event is not None
    assert patch.body["spec"]["replicas"] == 3 and "scaling 1 -> 3 pods" in patch.event.message
    assert observed.statefulset is not None and observed.statefulset.spec is not None
    assert patch.body["spec"]["template"] == api_json(observed.statefulset.spec.template)
    assert pdb.kind == "PodDisruptionBudget"
    # the RWO cache of a 1-replica PolicyServer cannot be shared by 3 pods on different nodes
    assert plan.storage is not None
    assert status_step.storage_condition(spec(replicas=3), plan.storage).reason == "CacheNotShared"


def test_plan_refuses_objects_it_does_not_own() -> None:
    ready = download_state.CheckpointState(CheckpointPhase.READY, Reason.DOWNLOADED, "", "j")
    observed = as_observed(pl.plan(spec(), OWNER, pl.Observed(), ready))
    assert observed.statefulset is not None and observed.statefulset.metadata is not None
    observed.statefulset.metadata.owner_references = []
    plan = pl.plan(spec(image="img:2"), OWNER, observed, ready)
    assert plan.problem is not None
    assert plan.problem.reason == Reason.NAME_CONFLICT and plan.writes == []
    foreign_pvc = observed_of(pvc={"metadata": {"name": "ps-cache", "labels": {}}})
    plan = pl.plan(spec(), OWNER, foreign_pvc, download_state.checkpoint_state(spec(), None, [], None))
    assert plan.problem is not None
    assert plan.problem.reason == Reason.NAME_CONFLICT and plan.writes == []


def test_retain_on_delete_releases_and_adopts_the_cache() -> None:
    pending = download_state.CheckpointState(CheckpointPhase.PENDING, Reason.JOB_PENDING, "", "j")
    owned = as_observed(pl.plan(spec(), OWNER, pl.Observed(), pending))
    [release] = [
        a
        for a in pl.plan(spec(storage={"retainOnDelete": True}), OWNER, owned, pending).writes
        if a.kind == "PersistentVolumeClaim"
    ]
    assert release.body == {"metadata": {"ownerReferences": None}}
    retained = as_observed(pl.plan(spec(storage={"retainOnDelete": True}), OWNER, pl.Observed(), pending))
    assert retained.pvc is not None and retained.pvc.metadata is not None
    assert retained.pvc.metadata.owner_references is None
    [adopt] = [a for a in pl.plan(spec(), OWNER, retained, pending).writes if a.kind == "PersistentVolumeClaim"]
    assert adopt.body["metadata"]["ownerReferences"][0]["uid"] == "uid-1"


def test_existing_claim_is_never_created() -> None:
    s = spec(storage={"existingClaim": "shared"})
    plan = pl.plan(s, OWNER, pl.Observed(), download_state.checkpoint_state(s, None, [], None))
    assert plan.problem is not None
    assert created(plan) == [f"Job/ps-fetch-{s.checkpoint.key}"] and plan.problem.reason == "ClaimNotFound"
    plan = pl.plan(
        s, OWNER, observed_of(pvc={"metadata": {"name": "shared"}}), download_state.checkpoint_state(s, None, [], None)
    )
    assert plan.problem is None


def test_status_patch_is_minimal_and_drops_stale_keys() -> None:
    previous = {"phase": "Ready", "endpoint": "ws://x", "ready": "1/1", "kopfState": 1}
    assert (
        status_step.status_patch(previous, {"phase": "Ready", "endpoint": "ws://x", "ready": "1/1"}, full=True) is None
    )
    patch = status_step.status_patch(previous, {"phase": "Degraded", "ready": "1/1"}, full=True)
    assert patch == {"phase": "Degraded", "endpoint": None}  # keys it does not own (kopfState) stay
    assert status_step.status_patch(previous, {"phase": "Failed"}, full=False) == {"phase": "Failed"}


def test_the_status_keys_a_full_write_may_drop_are_the_schemas() -> None:
    """build_status returns the CRD's own status model; its fields are the keys a full write owns."""
    assert set(status_step.STATUS_FIELDS) == {
        *("observedGeneration", "phase", "replicas", "readyReplicas", "updatedReplicas", "updatedReadyReplicas"),
        *("ready", "ranksReady", "layout", "selector", "endpoint", "lerobotGrpcEndpoint", "templateHash"),
        "lastProgressTime",
        *("checkpoint", "pods", "batching", "conditions"),
    }
    update = status_step.invalid_status(ValueError("bad"), previous=None, generation=1, now=NOW)
    assert isinstance(update.status, PolicyServerStatus) and update.status.pods == []
    assert "pods" not in update.document  # a partial status leaves what it did not set alone


# --- RBAC and CLI ------------------------------------------------------------------------------------


def test_rbac_covers_every_kind_the_client_touches() -> None:
    by_resource = {(r.api_group, r.resource): r for r in rbac.RULES}
    for kind, api_version in KINDS.items():
        group = api_version.split("/")[0] if "/" in api_version else ""
        assert (group, kind.lower() + ("es" if kind.endswith("s") else "s")) in by_resource, kind
    assert (C.GROUP, f"{C.PLURAL}/status") in by_resource
    # Secrets: create only (a compile key), never read, listed, watched or changed
    assert [r.verbs for r in rbac.RULES if r.resource == "secrets"] == [("create",)]


def test_rbac_namespaced_vs_cluster_and_missing() -> None:
    namespaced = rbac.policy_rules(all_namespaces=False)
    assert not any("namespaces" in r["resources"] for r in namespaced)
    assert rbac.missing(namespaced, all_namespaces=False) == []
    assert "core/namespaces:list" in rbac.missing(namespaced, all_namespaces=True)
    assert rbac.missing([{"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]}], all_namespaces=True) == []
    short = [r for r in namespaced if r["resources"] != ["statefulsets"]]
    assert rbac.missing(short, all_namespaces=False) == [
        f"apps/statefulsets:{v}" for v in ("get", "list", "watch", "create", "patch")
    ]


def test_cli_arguments() -> None:
    from policy_operator.operator import main

    parser = argparse.ArgumentParser()
    main.add_arguments(parser)
    args = parser.parse_args(["-n", "a", "-n", "b", "--peering", "ha", "--resync-seconds", "3"])
    assert (args.namespace, args.peering, args.standalone, args.resync_seconds) == (["a", "b"], "ha", False, 3.0)
    assert args.log_format == "json"
    for bad in ([], ["-n", "a", "-A"], ["-A", "--standalone", "--peering", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)


def test_a_500_about_the_request_body_is_a_rejection_not_a_retry() -> None:
    """Server-side apply answers 500 when it cannot build a typed object from the body (a duplicate env name); the
    same body gets the same answer, so it must reach status as ApplyFailed instead of a 5 s retry loop."""
    from policy_operator.operator.kube import is_transient

    duplicate = (
        "failed to create typed patch object (apps/v1, Kind=StatefulSet): .spec.template.spec.containers"
        '[name="server"].env: duplicate entries for key [name="HOME"]'
    )
    assert not is_transient(500, duplicate)
    assert is_transient(500, "etcdserver: request timed out") and is_transient(503, "")
    assert is_transient(409, "the object has been modified") and is_transient(429, "")
    assert not is_transient(422, 'Duplicate value: "ws"') and not is_transient(403, "forbidden")


def test_an_apply_is_skipped_only_when_the_object_already_is_what_it_would_make() -> None:
    """Writes only on change (issue 26 item 9): the same body on an object nobody else edited is not sent again;
    a changed body, or a hand edit (its author becomes a field manager), is."""
    from policy_operator.operator.kube import applied_hash, foreign_managers, unchanged, with_applied_hash

    body = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "ps", "namespace": "ns"},
        "spec": {"ports": [{"name": "ws", "port": 8000}]},
    }
    stamped = with_applied_hash(body)
    assert applied_hash(stamped) == applied_hash(body)  # the annotation is not part of what it hashes
    ours = [
        {"manager": C.FIELD_MANAGER, "operation": "Apply"},
        {"manager": "kube-controller-manager", "operation": "Update", "subresource": "status"},
    ]
    live = {**stamped, "metadata": {**stamped["metadata"], "managedFields": ours}}
    live_meta = api_object(V1Service, live).metadata
    assert live_meta is not None
    assert foreign_managers(live_meta.managed_fields) == [] and unchanged(live, stamped)
    assert not unchanged(live, with_applied_hash({**body, "spec": {"ports": [{"name": "ws", "port": 9000}]}}))
    edited = {
        **live,
        "metadata": {
            **live["metadata"],
            "managedFields": [
                *ours,
                {"manager": "kubectl-patch", "operation": "Update", "fieldsV1": {"f:spec": {"f:ports": {}}}},
            ],
        },
    }
    edited_meta = api_object(V1Service, edited).metadata
    assert edited_meta is not None
    edited_fields = edited_meta.managed_fields
    assert foreign_managers(edited_fields) == ["kubectl-patch"] and not unchanged(edited, stamped)
    deleting = {**live, "metadata": {**live["metadata"], "deletionTimestamp": "2026-01-01T00:00:00Z"}}
    assert not unchanged(deleting, stamped) and not unchanged(None, stamped)


def test_the_informer_store_keeps_the_newest_version_of_each_object() -> None:
    """The operator's own write (write-through) and the watch race: an older event must not undo a newer state, and
    a deleted object does not come back from an event older than its deletion."""
    from policy_operator.operator.informer import Store

    def obj(name: str, version: int, **labels: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "resourceVersion": str(version), "labels": labels}}

    store = Store()
    store.replace([obj("a", 5, app="x"), obj("b", 6)])
    assert store.synced.is_set() and [o["metadata"]["name"] for o in store.list({"app": "x"})] == ["a"]
    store.put(obj("a", 9, app="y"))
    store.put(obj("a", 7, app="x"))  # a watch event older than the write-through
    newest = store.get("a")
    assert newest is not None and newest["metadata"]["resourceVersion"] == "9" and store.list({"app": "x"}) == []
    store.remove("b", 10)
    store.put(obj("b", 8))  # older than the deletion
    assert store.get("b") is None
    store.put(obj("b", 11))  # made again
    assert store.get("b") is not None
