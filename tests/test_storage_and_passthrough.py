"""Storage modes, claim growth, old-checkpoint cleanup, the PDB and the pod pass-through fields.

Builders are checked against Kubernetes' own schemas (kubernetes-validate),
plan branches as pure functions, and ``policyserver checkpoint prune`` on a
real directory of fetched checkpoints.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest

from policy_operator import constants as C
from policy_operator.operator import download_state
from policy_operator.operator import manifests as M
from policy_operator.operator import plan as pl
from policy_operator.operator import status as st
from policy_operator.operator.apply import apply
from policy_operator.operator.conditions import Condition, Event, Reason
from policy_operator.operator.ownership import adopted
from policy_operator.operator.spec import PolicyServerSpec, SpecError, parse_spec
from policy_operator.runtime.checkpoint.compile_file import checkpoint_identity, encode, path_for
from policy_operator.runtime.checkpoint.marker import make_marker, write_marker
from policy_operator.runtime.checkpoint.prune import prune
from tests.support.api_objects import observed_of

K8S = "1.32.0"
OWNER = {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": "ps", "namespace": "ns", "uid": "uid-1"}}
READY = download_state.CheckpointState(download_state.CheckpointPhase.READY, download_state.Reason.DOWNLOADED, "", "j")


def spec(**overrides: Any) -> PolicyServerSpec:
    body: dict[str, Any] = {"image": "img:1", "checkpoint": {"source": "hf://org/p"}, **overrides}
    return parse_spec(body, name="ps", namespace="ns")


def storage_ready(s: PolicyServerSpec, result: pl.Plan) -> Condition:
    """StorageReady as the status step says it, from what the plan found of the cache claims."""
    assert result.storage is not None
    return st.storage_condition(s, result.storage)


def valid(obj: dict[str, Any]) -> dict[str, Any]:
    kubernetes_validate.validate(obj, K8S, strict=True)
    return obj


# --- perPod -------------------------------------------------------------------------------------


def test_per_pod_mode_gives_each_pod_its_claim_and_its_own_fetch() -> None:
    s = spec(
        replicas=3,
        storage={"mode": "perPod", "size": "7Gi", "keepCheckpoints": 2},
        checkpoint={"source": "hf://org/p", "secretRef": {"name": "hf"}},
    )
    sts = valid(M.build_statefulset(s))
    [template] = sts["spec"]["volumeClaimTemplates"]
    assert template["metadata"]["name"] == M.VOL_CACHE
    assert template["spec"]["accessModes"] == ["ReadWriteOnce"] and template["spec"]["resources"]["requests"] == {
        "storage": "7Gi"
    }
    pod = sts["spec"]["template"]["spec"]
    assert M.VOL_CACHE not in {v["name"] for v in pod["volumes"]}  # the template provides it
    fetch, prune_c, verify = pod["initContainers"]
    assert fetch["command"] == M.fetch_command(s) and prune_c["command"][-4:] == [
        "--keep",
        s.checkpoint.key,
        "--keep-last",
        "2",
    ]
    assert verify["name"] == M.VERIFY_CONTAINER
    assert "podAffinity" not in pod.get("affinity", {})  # a claim per pod needs no co-location
    assert sts["spec"]["persistentVolumeClaimRetentionPolicy"] == {"whenDeleted": "Delete", "whenScaled": "Retain"}
    # no shared claim, no fetch Job; the checkpoint counts as ready (the pods fetch it)
    state = download_state.checkpoint_state(s, None, [], None)
    result = pl.plan(s, OWNER, observed_of(), state)
    # the compile key Secret first (created once, before the first template that mounts it), then the pods
    assert [(w.kind, w.name) for w in result.writes][:2] == [("Secret", "ps-compile-key"), ("StatefulSet", "ps")]
    assert not [w for w in result.writes if w.kind in ("Job", "PersistentVolumeClaim")]


def _server_pod(phase: str, scheduled: bool, *, deleting: bool = False) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "ps-0", "labels": M.labels("ps", C.COMPONENT_SERVER)}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-06T00:00:00Z"
    condition = {"type": "PodScheduled", "status": "True" if scheduled else "False"}
    return {"metadata": meta, "status": {"phase": phase, "conditions": [condition]}}


@pytest.mark.parametrize(
    ("pod", "posts"),
    [
        (None, False),  # at rest: nothing sent
        (_server_pod("Running", True), False),  # warming up or serving: its volumes are mounted
        (_server_pod("Pending", False), False),  # no node yet: nothing mounts anything
        (_server_pod("Pending", True, deleting=True), False),
        (_server_pod("Pending", True), True),  # setting up on its node: a missing key Secret holds it here
    ],
)
def test_the_compile_key_is_created_again_only_while_a_pod_sets_up(pod: dict[str, Any] | None, posts: bool) -> None:
    """A compile key Secret deleted by hand shows only as a pod the kubelet cannot start (the operator cannot read
    Secrets): while a pod sets up, the pass POSTs the Secret, which the API server refuses (409) if it exists."""
    s = spec()
    sts = adopted(M.build_statefulset(s), OWNER)
    result = pl.plan(s, OWNER, observed_of(statefulset=sts, pods=[pod] if pod else []), READY)
    writes = [w for w in result.writes if w.kind == "Secret"]
    assert [(w.verb, w.name) for w in writes] == ([(pl.Verb.CREATE, "ps-compile-key")] if posts else [])
    if posts:
        assert writes[0].event is not None and writes[0].event.type == "Warning", writes[0].event
        assert "ps-0" in writes[0].event.message


def test_a_create_once_that_found_its_object_posts_no_event() -> None:
    """The Event of a create-once write says it created something: not when the API server answered 409."""

    class Kube:
        def __init__(self, existed: bool) -> None:
            self.existed = existed

        def create(self, obj: dict[str, Any]) -> dict[str, Any]:
            return {"metadata": obj["metadata"], **({"existed": True} if self.existed else {})}

    secret = M.build_compile_key_secret(spec(), "ab" * 32)
    event = Event("Warning", "Recreated", "created it again")
    plan = pl.Plan(writes=[pl.Write(pl.Verb.CREATE, "Secret", "ps-compile-key", secret, event)])
    assert apply(Kube(existed=True), plan, "ns").events == []  # type: ignore[arg-type]
    assert apply(Kube(existed=False), plan, "ns").events == [event]  # type: ignore[arg-type]


def test_switching_the_mode_is_reported_and_leaves_the_pods_alone() -> None:
    shared = spec()
    sts = {
        **M.build_statefulset(shared),
        "metadata": {
            **M.build_statefulset(shared)["metadata"],
            "ownerReferences": [{"uid": "uid-1", "controller": True}],
        },
    }
    per_pod = spec(storage={"mode": "perPod"})
    result = pl.plan(
        per_pod, OWNER, observed_of(statefulset=sts), download_state.checkpoint_state(per_pod, None, [], None)
    )
    ready = storage_ready(per_pod, result)
    assert (ready.status, ready.reason) == ("False", "ImmutableChange")
    assert not [w for w in result.writes if w.kind == "StatefulSet"]


# --- the shared claim ---------------------------------------------------------------------------


def _claim(size: str, modes: list[str], klass: str = "fast") -> dict[str, Any]:
    return {
        "metadata": {
            "name": "ps-cache",
            "labels": M.labels("ps", C.COMPONENT_CACHE),
            "ownerReferences": [{"uid": "uid-1", "controller": True}],
        },
        "spec": {"accessModes": modes, "storageClassName": klass, "resources": {"requests": {"storage": size}}},
    }


@pytest.mark.parametrize(
    ("allow", "verb", "reason"),
    [(True, pl.Verb.PATCH, "Expanding"), (None, pl.Verb.PATCH, "Expanding"), (False, None, "ExpansionNotAllowed")],
)
def test_size_increase_grows_the_claim_when_the_class_allows(
    allow: bool | None, verb: pl.Verb | None, reason: str
) -> None:
    s = spec(storage={"size": "30Gi"})
    klass = None if allow is None else {"metadata": {"name": "fast"}, "allowVolumeExpansion": allow}
    result = pl.plan(s, OWNER, observed_of(pvc=_claim("20Gi", ["ReadWriteOnce"]), storage_class=klass), READY)
    grows = [w for w in result.writes if w.kind == "PersistentVolumeClaim" and w.verb is pl.Verb.PATCH]
    assert [w.verb for w in grows] == ([verb] if verb else [])
    if verb:
        assert grows[0].body == {"spec": {"resources": {"requests": {"storage": "30Gi"}}}}
        assert result.writes[-1] is grows[0]  # last: a refused growth stops nothing else
    assert storage_ready(s, result).reason == reason


@pytest.mark.parametrize(
    ("storage", "what"),
    [
        ({"size": "10Gi"}, "never shrinks"),
        ({"accessModes": ["ReadWriteMany"]}, "access modes"),
        ({"storageClassName": "slow"}, "StorageClass"),
    ],
)
def test_immutable_changes_get_a_false_condition(storage: dict[str, Any], what: str) -> None:
    s = spec(storage=storage)
    ready = storage_ready(s, pl.plan(s, OWNER, observed_of(pvc=_claim("20Gi", ["ReadWriteOnce"])), READY))
    assert (ready.status, ready.reason) == ("False", "ImmutableChange")
    assert what in ready.message


def test_rwo_cache_pods_are_kept_on_one_node() -> None:
    s = spec()
    job, sts = valid(M.build_fetch_job(s)), valid(M.build_statefulset(s))
    for pod in (job["spec"]["template"], sts["spec"]["template"]):
        assert pod["metadata"]["labels"][C.LABEL_CACHE_CLAIM] == "ps-cache"
        [term] = pod["spec"]["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert term == {
            "labelSelector": {"matchLabels": {C.LABEL_CACHE_CLAIM: "ps-cache"}},
            "topologyKey": M.HOSTNAME_TOPOLOGY,
        }
    rwx = valid(M.build_statefulset(s, cache_modes=("ReadWriteMany",)))
    assert "affinity" not in rwx["spec"]["template"]["spec"]


def test_admission_refuses_rwo_sharing_and_rwop_in_shared_mode() -> None:
    with pytest.raises(SpecError, match="ReadWriteMany"):
        spec(replicas=2, storage={"accessModes": ["ReadWriteOnce"]})
    with pytest.raises(SpecError, match="ReadWriteOncePod"):
        spec(storage={"accessModes": ["ReadWriteOncePod"]})
    spec(replicas=2, storage={"mode": "perPod", "accessModes": ["ReadWriteOnce"]})  # the fix it names


# --- cleanup ------------------------------------------------------------------------------------


def _rolled(s: Any, *, done: bool) -> dict[str, Any]:
    sts = M.build_statefulset(s)
    sts["metadata"].update(generation=2, ownerReferences=[{"uid": "uid-1", "controller": True}])
    sts["status"] = {
        "observedGeneration": 2,
        "replicas": 1,
        "readyReplicas": 1,
        "updatedReplicas": 1,
        "currentRevision": "r1" if done else "r0",
        "updateRevision": "r1",
    }
    return sts


def test_cleanup_job_only_after_every_pod_serves_the_new_checkpoint() -> None:
    s = spec()
    job = {"metadata": {"name": "ps-fetch", "labels": M.labels("ps", C.COMPONENT_FETCH)}}
    pvc = _claim("20Gi", ["ReadWriteOnce"])
    rolling = pl.plan(s, OWNER, observed_of(pvc=pvc, job=job, statefulset=_rolled(s, done=False)), READY)
    assert not [w for w in rolling.writes if w.name == M.Names("ps").gc_job(s.checkpoint.key)]
    rolled = pl.plan(s, OWNER, observed_of(pvc=pvc, job=job, statefulset=_rolled(s, done=True)), READY)
    [gc] = [w for w in rolled.writes if w.name == M.Names("ps").gc_job(s.checkpoint.key)]
    valid(gc.body)
    [container] = gc.body["spec"]["template"]["spec"]["containers"]
    assert container["command"] == M.prune_command(s, s.checkpoint.key)
    # never on a claim the operator does not own
    mine_only = spec(storage={"existingClaim": "models"})
    assert not [
        w
        for w in pl.plan(
            mine_only, OWNER, observed_of(pvc=pvc, job=job, statefulset=_rolled(mine_only, done=True)), READY
        ).writes
        if w.kind == "Job"
    ]


def _job(component: str, key: str, *, finished: str | None, owner_uid: str = "uid-1") -> dict[str, Any]:
    name = M.Names("ps").gc_job(key) if component == C.COMPONENT_CACHE_GC else M.Names("ps").job(key)
    job: dict[str, Any] = {
        "metadata": {
            "name": name,
            "labels": {**M.labels("ps", component), C.LABEL_CHECKPOINT_KEY: key},
            "ownerReferences": [{"uid": owner_uid, "controller": True}],
        },
        "status": {
            "conditions": [{"type": finished, "status": "True"}] if finished else [],
            "active": 0 if finished else 1,
        },
    }
    return job


def test_finished_fetch_jobs_of_other_checkpoints_go_before_the_cleanup_job() -> None:
    # a finished fetch Job vouches for its checkpoint (a switch back skips the download); the cleanup may
    # remove that checkpoint, so the Job goes first and the cleanup Job comes on a later pass
    s = spec()
    key = s.checkpoint.key
    job = _job(C.COMPONENT_FETCH, key, finished="Complete")
    old = _job(C.COMPONENT_FETCH, "old-key", finished="Complete")
    pvc = _claim("20Gi", ["ReadWriteOnce"])
    observed = observed_of(pvc=pvc, job=job, statefulset=_rolled(s, done=True), cache_jobs=[job, old])
    first = pl.plan(s, OWNER, observed, READY)
    assert [(w.verb, w.kind, w.name) for w in first.writes if w.kind == "Job"] == [
        (pl.Verb.DELETE, "Job", M.Names("ps").job("old-key"))
    ]
    # an old download still running: nothing deleted, no cleanup until it ends
    running = _job(C.COMPONENT_FETCH, "old-key", finished=None)
    waiting = pl.plan(
        s, OWNER, observed_of(pvc=pvc, job=job, statefulset=_rolled(s, done=True), cache_jobs=[job, running]), READY
    )
    assert not [w for w in waiting.writes if w.kind == "Job"]
    # once gone: the cleanup Job
    then = pl.plan(s, OWNER, observed_of(pvc=pvc, job=job, statefulset=_rolled(s, done=True), cache_jobs=[job]), READY)
    assert [(w.verb, w.name) for w in then.writes if w.kind == "Job"] == [
        (pl.Verb.APPLY_MISSING, M.Names("ps").gc_job(key))
    ]


def test_nothing_is_fetched_or_rolled_to_while_a_cleanup_of_another_checkpoint_runs() -> None:
    # the spec went back to an old checkpoint while the cleanup that keeps the new one runs: its prune may be
    # removing the old directory, so no fetch Job starts and the pods keep the checkpoint they load
    serving = spec(checkpoint={"source": "hf://org/new"})
    s = spec(checkpoint={"source": "hf://org/old"})
    sts = _rolled(serving, done=True)
    pvc = _claim("20Gi", ["ReadWriteOnce"])
    cleanup = _job(C.COMPONENT_CACHE_GC, serving.checkpoint.key, finished=None)
    pending = download_state.CheckpointState(
        download_state.CheckpointPhase.PENDING, download_state.Reason.JOB_PENDING, "", "j"
    )
    held = pl.plan(s, OWNER, observed_of(pvc=pvc, statefulset=sts, cache_jobs=[cleanup]), pending)
    assert not [w for w in held.writes if w.kind == "Job"]
    assert held.serving is not None and held.serving.key == serving.checkpoint.key
    # a stale Ready of the old checkpoint changes nothing while the cleanup runs
    stale = pl.plan(s, OWNER, observed_of(pvc=pvc, statefulset=sts, cache_jobs=[cleanup]), READY)
    assert stale.serving is not None and stale.serving.key == serving.checkpoint.key
    # the cleanup ended: the fetch Job of the spec's checkpoint, which finds it on the cache or downloads it
    cleanup = _job(C.COMPONENT_CACHE_GC, serving.checkpoint.key, finished="Complete")
    after = pl.plan(s, OWNER, observed_of(pvc=pvc, statefulset=sts, cache_jobs=[cleanup]), pending)
    assert [(w.verb, w.name) for w in after.writes if w.kind == "Job"] == [
        (pl.Verb.APPLY_MISSING, M.Names("ps").job(s.checkpoint.key))
    ]


def _fetched(dest: Path, key: str, age_s: float) -> None:
    directory = dest / key
    directory.mkdir(parents=True)
    (directory / "model.safetensors").write_bytes(b"x")
    write_marker(
        directory,
        make_marker(
            key=key, source="s", revision=None, resolved_revision=None, files={"model.safetensors": {"size": 1}}
        ),
    )
    then = time.time() - age_s
    os.utime(directory / C.COMPLETE_MARKER, (then, then))


@pytest.mark.parametrize(
    ("keep_last", "left"), [(1, {"new", "newer", ".fetch", "stray"}), (2, {"mid", "new", "newer", ".fetch", "stray"})]
)
def test_prune_keeps_the_served_the_newer_and_the_unknown(tmp_path: Path, keep_last: int, left: set[str]) -> None:
    for key, age in (("old", 300), ("mid", 200), ("new", 100), ("newer", 10)):
        _fetched(tmp_path, key, age)
    (tmp_path / "stray").mkdir()  # no marker: not provably a finished download
    (tmp_path / ".fetch").mkdir()
    removed = prune(tmp_path, {"new"}, keep_last, log=lambda _: None)
    assert {p.name for p in tmp_path.iterdir()} - {".fetch"} | {".fetch"} == left
    assert set(removed) == {"old", "mid"} - left
    assert json.loads((tmp_path / "new" / C.COMPLETE_MARKER).read_text())["key"] == "new"


def _artifacts(dest: Path, checkpoint: Path, layout: str) -> Path:
    """A compile-artifacts file as a pod of ``checkpoint`` writes it into the volume's compile directory."""
    key = {"checkpoint": checkpoint_identity(checkpoint), "layout": layout}
    path = path_for(dest / C.COMPILE_CACHE_DIR, key)
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(encode(key, b"payload"))
    return path


def test_prune_takes_the_compile_artifacts_of_what_it_removes_and_keeps_the_rest(tmp_path: Path) -> None:
    for key, age in (("old", 300), ("new", 100)):
        _fetched(tmp_path, key, age)
    old = [_artifacts(tmp_path, tmp_path / "old", layout) for layout in ("cfgp1-dp1", "cfgp2-dp1")]
    new = [_artifacts(tmp_path, tmp_path / "new", layout) for layout in ("cfgp1-dp1", "cfgp2-dp1")]
    gone = tmp_path / "gone"  # a checkpoint removed before: its artifacts were left behind
    gone.mkdir()
    (gone / "model.safetensors").write_bytes(b"y")
    stale = _artifacts(tmp_path, gone, "cfgp1-dp1")
    gone.joinpath("model.safetensors").unlink()
    gone.rmdir()
    unreadable = tmp_path / C.COMPILE_CACHE_DIR / "torn.artifacts"
    unreadable.write_bytes(b"policy-operator compile art")  # not provably anyone's: stays
    lines: list[str] = []

    # the served checkpoint not on the volume yet: nothing is known to be old, not even the artifacts
    assert prune(tmp_path, {"next"}, 1, log=lines.append) == [] and all(p.exists() for p in (*old, *new, stale))

    assert prune(tmp_path, {"new"}, 1, log=lines.append) == ["old"]
    assert not any(p.exists() for p in (*old, stale)), lines
    assert all(p.exists() for p in (*new, unreadable))
    assert sum("compile artifacts" in line for line in lines) == 3


# --- PDB and pass-through -----------------------------------------------------------------------


def test_pdb_exists_while_replicas_exceed_one() -> None:
    two = pl.plan(spec(replicas=2, storage={"accessModes": ["ReadWriteMany"]}), OWNER, observed_of(), READY)
    [pdb] = [w for w in two.writes if w.kind == "PodDisruptionBudget"]
    assert pdb.verb is pl.Verb.APPLY and valid(pdb.body)["spec"]["maxUnavailable"] == 1
    existing = {
        **pdb.body,
        "metadata": {**pdb.body["metadata"], "ownerReferences": [{"uid": "uid-1", "controller": True}]},
    }
    one = pl.plan(spec(replicas=1), OWNER, observed_of(pdb=existing), READY)
    assert [(w.verb, w.kind) for w in one.writes if w.kind == "PodDisruptionBudget"] == [
        (pl.Verb.DELETE, "PodDisruptionBudget")
    ]


def test_pass_through_reaches_the_pods() -> None:
    s = spec(
        podLabels={"kueue.x-k8s.io/queue-name": "robots"},
        podAnnotations={"a": "b"},
        runtimeClassName="nvidia",
        schedulerName="volcano",
        topologySpreadConstraints=[{"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule"}],
        volumes=[{"name": "extra", "emptyDir": {}}],
        volumeMounts=[{"name": "extra", "mountPath": "/extra"}],
    )
    pod = valid(M.build_statefulset(s))["spec"]["template"]
    assert (
        pod["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "robots"
        and pod["metadata"]["annotations"]["a"] == "b"
    )
    assert (pod["spec"]["runtimeClassName"], pod["spec"]["schedulerName"]) == ("nvidia", "volcano")
    assert pod["spec"]["topologySpreadConstraints"][0]["topologyKey"] == "zone"
    assert {"name": "extra", "emptyDir": {}} in pod["spec"]["volumes"]
    assert {"name": "extra", "mountPath": "/extra"} in pod["spec"]["containers"][0]["volumeMounts"]
    job = valid(M.build_fetch_job(s))["spec"]["template"]
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "robots"
    assert job["spec"]["schedulerName"] == "volcano" and "runtimeClassName" not in job["spec"]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"podLabels": {C.LABEL_INSTANCE: "x"}}, "podLabels"),
        ({"volumes": [{"name": "tmp", "emptyDir": {}}]}, "the operator adds"),
        (
            {"volumes": [{"name": "v", "emptyDir": {}}], "volumeMounts": [{"name": "v", "mountPath": "/models/x"}]},
            "overlaps",
        ),
        ({"parallelism": {"dp": 9}}, "maxGpusPerPod"),
    ],
)
def test_pass_through_that_would_break_the_pod_is_refused(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(SpecError, match=match):
        spec(**extra)


def test_default_requests_count_shm_and_leave_limits_to_kubernetes() -> None:
    s = spec(parallelism={"dp": 2}, resources={"shmSize": "1Gi"})
    requests = valid(M.build_statefulset(s))["spec"]["template"]["spec"]["containers"][0]["resources"]["requests"]
    assert (requests["cpu"], requests["memory"]) == ("2", "5Gi")  # 2 ranks x 2Gi + 1Gi of /dev/shm
    limited = spec(resources={"limits": {"memory": "8Gi"}, "requests": {"cpu": "3"}})
    assert M.default_requests(limited) == {}
    # each front-end process a CPU and 512Mi beside the ranks; inline (rank 0 itself) none
    fronts = spec(
        parallelism={"dp": 2}, resources={"shmSize": "1Gi"}, runtime={"frontend": {"mode": "process", "processes": 4}}
    )
    assert M.default_requests(fronts) == {"cpu": "6", "memory": "7Gi"}  # 2 + 4 CPUs; 2 x 2Gi + 4 x 512Mi + 1Gi
    one = spec(parallelism={"dp": 2}, resources={"shmSize": "1Gi"}, runtime={"frontend": {"mode": "process"}})
    assert M.default_requests(one) == {"cpu": "3", "memory": "5632Mi"}
    assert spec(runtime={"device": "cpu"}, parallelism={"dp": 12}).gpus_per_pod == 0  # maxGpusPerPod counts GPUs


def test_a_terminating_claim_is_a_storage_problem_and_completed_job_pods_are_deleted() -> None:
    s = spec(replicas=1)
    owner = {"apiVersion": C.API_VERSION, "kind": C.KIND, "metadata": {"name": "ps", "namespace": "ns", "uid": "u1"}}
    claim = {
        "metadata": {
            "name": "ps-cache",
            "labels": M.labels("ps", C.COMPONENT_CACHE),
            "deletionTimestamp": "2026-01-01T00:00:00Z",
        },
        "spec": {"accessModes": ["ReadWriteMany"], "resources": {"requests": {"storage": "20Gi"}}},
    }
    ours = M.labels("ps", C.COMPONENT_FETCH)
    job = {
        "metadata": {"name": "ps-fetch-k", "labels": ours},
        "status": {"conditions": [{"type": "Complete", "status": "True"}]},
    }
    failed = {
        "metadata": {"name": "ps-fetch-x", "labels": ours},
        "status": {"conditions": [{"type": "Failed", "status": "True"}]},
    }

    def job_pod(name: str, job_name: str) -> dict[str, Any]:
        return {"metadata": {"name": name, "labels": ours, "ownerReferences": [{"kind": "Job", "name": job_name}]}}

    observed = observed_of(
        pvc=claim,
        job=job,
        cache_jobs=[job, failed],
        job_pods_all=[job_pod("ps-fetch-k-1", "ps-fetch-k"), job_pod("ps-fetch-x-1", "ps-fetch-x")],
    )
    result = pl.plan(
        s,
        owner,
        observed,
        download_state.CheckpointState(download_state.CheckpointPhase.READY, Reason.DOWNLOADED, "", "ps-fetch-k"),
    )
    ready = storage_ready(s, result)
    assert (ready.status, ready.reason) == ("False", "ClaimTerminating")
    assert "ps-cache is being deleted" in ready.message
    deletes = [(w.kind, w.name) for w in result.writes if w.verb is pl.Verb.DELETE]
    assert ("Pod", "ps-fetch-k-1") in deletes and ("Pod", "ps-fetch-x-1") not in deletes  # a failure's message stays
