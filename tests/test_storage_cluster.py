"""Storage and disruption on the real control plane: what the apiserver, the PV, expand, disruption and
StatefulSet controllers and the local node's provisioner make of the operator's storage decisions.

One operator and one local node for the module (short resync, tiny checkpoints, 2 CPU steps).  What is
pinned down: ``storage.mode: perPod`` gives every pod its own claim and its own download (counted on the
checkpoint server) and no fetch Job; the PodDisruptionBudget exists at replicas 2 (the real disruption
controller counts its pods) and is gone at 1; a larger ``storage.size`` grows the claim on a class with
``allowVolumeExpansion`` (the node plays the external resizer) and is reported ``ExpansionNotAllowed`` on
one without; the old checkpoint directory leaves the shared cache after the switch to a new one, never
while a pod of the old one exists, and a switch back fetches it again; and the apiserver itself refuses a layout above ``maxGpusPerPod``
(the CEL rule's cost fits its budget).  The decisions are unit-tested in
tests/test_storage_and_passthrough.py.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import kubernetes.client
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.manifests import VOL_CACHE, Names
from policy_operator.source_uri import checkpoint_key
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.local_node_cluster import LocalCluster, for_local_node, free_port_on
from tests.support.local_node_storage import STORAGE_PROVISIONER
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[1]
NS = "storage-it"
WAIT_S = 150.0
PS = (C.API_VERSION, C.PLURAL)
FIXED_CLASS = "storage-it-fixed"  # served by the node's provisioner, allowVolumeExpansion unset
EXPANDABLE_CLASS = "storage-it-expandable"
SOURCES = ("pp", "pdb", "a", "b", "g", "r")  # one checkpoint directory per use, so downloads are counted per test


class Env:
    def __init__(self, lc: LocalCluster, source: CheckpointServer, port: int) -> None:
        self.lc, self.source, self.port = lc, source, port

    def doc(self, name: str, path: str, **spec: Any) -> dict[str, Any]:
        sample = yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text())
        doc = for_local_node(sample, source=self.source.url_for(f"{path}/"), port=self.port)
        doc["metadata"]["name"] = name
        doc["spec"].update(spec)
        return doc

    def apply(
        self, doc: dict[str, Any], *, check: bool = True, dry_run: bool = False
    ) -> subprocess.CompletedProcess[str]:
        return self.lc.kubectl(
            "apply", "-f", "-", *(["--dry-run=server"] if dry_run else []), input=yaml.safe_dump(doc), check=check
        )

    def patch(self, name: str, spec: dict[str, Any]) -> None:
        self.lc.kubectl("patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps({"spec": spec}))

    def wait(
        self, name: str, predicate: Callable[[dict[str, Any]], Any], what: str, timeout: float = WAIT_S
    ) -> dict[str, Any]:
        return self.lc.wait_status(name, predicate, what, timeout)

    def claim(self, name: str) -> dict[str, Any]:
        return self.lc.get("v1", "persistentvolumeclaims", name) or {}

    def pods(self, name: str) -> list[dict[str, Any]]:
        return self.lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")

    def events(self, name: str) -> set[tuple[str | None, str | None]]:
        return {(e.get("type"), e.get("reason")) for e in self.lc.api.events(NS, involved_name=name)}

    def delete(self, name: str) -> None:
        self.lc.kubectl("delete", C.SHORT_NAME, name, "--timeout=120s", timeout=150)


def cond(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in status.get("conditions") or [] if c["type"] == kind), {})


def storage(claim: dict[str, Any], where: str) -> str | None:
    """``spec`` -> the requested size, ``status`` -> the capacity the volume has."""
    if where == "spec":
        return (((claim.get("spec") or {}).get("resources") or {}).get("requests") or {}).get("storage")
    return ((claim.get("status") or {}).get("capacity") or {}).get("storage")


@pytest.fixture(scope="module")
def env(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Env]:
    work = tmp_path_factory.mktemp("storage-it")
    for seed, path in enumerate(SOURCES):
        subprocess.run(
            [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / path), "--seed", str(seed)],
            check=True,
            capture_output=True,
            timeout=120,
        )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(
        control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=0.5, gpus=2, storage_classes=[FIXED_CLASS]
    )
    lc.operator.probe_timeout_s = 0.5
    expandable = {
        "apiVersion": "storage.k8s.io/v1",
        "kind": "StorageClass",
        "metadata": {"name": EXPANDABLE_CLASS},
        "provisioner": STORAGE_PROVISIONER,
        "reclaimPolicy": "Delete",
        "volumeBindingMode": "Immediate",
        "allowVolumeExpansion": True,
    }
    try:
        lc.start()
        control_plane.kubectl("apply", "-f", "-", input=yaml.safe_dump(expandable))
        yield Env(lc, source, free_port_on(["127.0.0.1", *lc.node.ips(16)]))
    finally:
        lc.stop()
        source.stop()
        for name in (EXPANDABLE_CLASS, FIXED_CLASS):
            with contextlib.suppress(kubernetes.client.ApiException, subprocess.CalledProcessError):
                control_plane.kubectl("delete", "storageclass", name, "--ignore-not-found")
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def test_a_layout_above_max_gpus_per_pod_is_refused_by_the_apiserver(env: Env) -> None:
    doc = env.doc("toobig", "a", maxGpusPerPod=4, parallelism={"cfgp": 2, "dp": 4})
    doc["spec"]["runtime"]["device"] = "cuda"
    refused = env.apply(doc, check=False)
    assert refused.returncode != 0
    assert "spec.parallelism" in refused.stderr and "maxGpusPerPod" in refused.stderr, refused.stderr
    assert env.lc.get(*PS, "toobig") is None
    # the same layout where the nodes are large enough, and on CPU (no GPUs asked for): both admitted
    doc["spec"]["maxGpusPerPod"] = 8
    assert env.apply(doc, dry_run=True).returncode == 0
    doc["spec"]["maxGpusPerPod"] = 4
    doc["spec"]["runtime"]["device"] = "cpu"
    assert env.apply(doc, dry_run=True).returncode == 0


def test_per_pod_storage_gives_each_pod_its_own_claim_and_download(env: Env) -> None:
    name = "perpod"
    env.apply(env.doc(name, "pp", replicas=2, storage={"mode": "perPod"}))
    status = env.wait(name, lambda s: s.get("phase") == C.PHASE_READY and s.get("ready") == "2/2", "2/2 Ready")
    claims = {f"{VOL_CACHE}-{name}-{i}" for i in range(2)}
    mounted = {
        v["persistentVolumeClaim"]["claimName"]
        for p in env.pods(name)
        for v in p["spec"]["volumes"]
        if v.get("persistentVolumeClaim")
    }
    assert mounted == claims  # each pod its own claim, made by the StatefulSet controller
    for claim in claims:
        assert env.claim(claim)["status"]["phase"] == "Bound"
    assert env.source.count(f"/pp/{C.WEIGHTS_FILE}") == 2  # one download per pod
    assert env.lc.list("batch/v1", "jobs", f"{C.LABEL_INSTANCE}={name}") == []  # no fetch Job, no shared claim
    assert env.claim(f"{name}-cache") == {}
    ready = cond(status, C.COND_STORAGE_READY)
    assert ready["status"] == "True" and "one claim per pod" in ready["message"], ready
    env.delete(name)


def test_a_pod_disruption_budget_exists_at_two_replicas_and_not_at_one(env: Env) -> None:
    name = "pdb"
    env.apply(env.doc(name, "pdb", replicas=2, storage={"mode": "perPod"}))
    env.wait(name, lambda s: s.get("phase") == C.PHASE_READY and s.get("ready") == "2/2", "2/2 Ready")
    owner = env.lc.existing(*PS, name)
    pdb_name = Names(name).pdb

    def budget() -> dict[str, Any] | None:
        return env.lc.get("policy/v1", "poddisruptionbudgets", pdb_name)

    # the real disruption controller counts the pods the selector picks: both, one of them may go
    pdb = wait_for(
        lambda: (
            (b := budget())
            and (b.get("status") or {}).get("expectedPods") == 2
            and b["status"].get("disruptionsAllowed") == 1
            and b
        ),
        60,
        what="the PDB's status of 2 pods",
    )
    assert pdb["spec"]["maxUnavailable"] == 1
    assert pdb["metadata"]["ownerReferences"][0]["uid"] == owner["metadata"]["uid"]

    env.lc.kubectl("scale", f"{C.PLURAL}/{name}", "--replicas=1")
    wait_for(lambda: budget() is None, WAIT_S, what="the PDB deleted at replicas 1")
    env.wait(name, lambda s: s.get("ready") == "1/1" and s.get("replicas") == 1, "1/1")
    env.lc.api.wait_event(NS, name, "Normal", "Deleted")
    assert env.claim(f"{VOL_CACHE}-{name}-1"), "a scaled-down pod's claim is kept (whenScaled: Retain)"
    env.lc.operator.settle()
    assert budget() is None  # not made again by a later pass
    env.delete(name)


def test_a_larger_size_grows_an_expandable_claim_and_is_refused_on_a_fixed_one(env: Env) -> None:
    # replicas 0: the claims and the download are what matters here, not server pods
    for name, klass in (("grow", EXPANDABLE_CLASS), ("fixed", FIXED_CLASS)):
        env.apply(env.doc(name, "g", replicas=0, storage={"storageClassName": klass, "size": "1Gi"}))
    for name in ("grow", "fixed"):

        def bound(n: str = name) -> bool:
            return env.claim(f"{n}-cache").get("status", {}).get("phase") == "Bound"

        wait_for(bound, WAIT_S, what=f"{name}-cache bound")
        env.patch(name, {"storage": {"size": "2Gi"}})

    def expanded() -> dict[str, Any] | None:
        c = env.claim("grow-cache")
        return c if c and storage(c, "spec") == "2Gi" and storage(c, "status") == "2Gi" else None

    claim = wait_for(expanded, WAIT_S, what="grow-cache expanded to 2Gi")
    pv = env.lc.api.existing("v1", "persistentvolumes", claim["spec"]["volumeName"])
    assert pv["spec"]["capacity"]["storage"] == "2Gi"  # the resizer grew the volume, then the claim's status
    status = env.wait(
        "grow",
        lambda s: cond(s, C.COND_STORAGE_READY).get("reason") == "AsSpecified",
        "StorageReady AsSpecified after the growth",
    )
    assert cond(status, C.COND_STORAGE_READY)["status"] == "True"
    env.lc.api.wait_event(NS, "grow", "Normal", "Expanding")

    status = env.wait(
        "fixed",
        lambda s: cond(s, C.COND_STORAGE_READY).get("reason") == "ExpansionNotAllowed",
        "StorageReady ExpansionNotAllowed",
    )
    message = cond(status, C.COND_STORAGE_READY)["message"]
    assert cond(status, C.COND_STORAGE_READY)["status"] == "False" and FIXED_CLASS in message, message
    env.lc.operator.settle()
    fixed = env.claim("fixed-cache")
    assert storage(fixed, "spec") == "1Gi" and storage(fixed, "status") == "1Gi"  # never patched
    assert ("Normal", "Expanding") not in env.events("fixed")
    for name in ("grow", "fixed"):
        env.delete(name)


def test_the_old_checkpoint_leaves_the_cache_after_the_switch_and_not_before(env: Env) -> None:
    name = "gc"
    key_a, key_b = checkpoint_key(env.source.url_for("a/")), checkpoint_key(env.source.url_for("b/"))
    env.apply(env.doc(name, "a"))
    env.wait(
        name,
        lambda s: s.get("phase") == C.PHASE_READY and s.get("checkpoint", {}).get("servingKey") == key_a,
        "Ready on checkpoint a",
    )
    cache = env.lc.node.storage.path(NS, f"{name}-cache")
    assert (cache / key_a / C.COMPLETE_MARKER).is_file()

    samples: list[tuple[bool, set[str | None], bool]] = []  # (a on the cache, keys of the pods in the API, cleanup Job)
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            keys = {(p["metadata"].get("labels") or {}).get(C.LABEL_CHECKPOINT_KEY) for p in env.pods(name)}
            gc_job = env.lc.get("batch/v1", "jobs", Names(name).gc_job(key_b)) is not None
            samples.append(((cache / key_a).exists(), keys, gc_job))  # the directory read last: the pods are older
            stop.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        env.patch(name, {"checkpoint": {"source": env.source.url_for("b/")}})
        env.wait(
            name,
            lambda s: (
                s.get("phase") == C.PHASE_READY
                and s.get("observedGeneration") == 2
                and s.get("checkpoint", {}).get("servingKey") == key_b
            ),
            "Ready on checkpoint b",
        )
        wait_for(lambda: not (cache / key_a).exists(), WAIT_S, what=f"{key_a} removed from the cache")
    finally:
        stop.set()
        watcher.join(10)
    assert (cache / key_b / C.COMPLETE_MARKER).is_file()
    assert any(key_a in keys for _, keys, _ in samples), "the watcher never saw a pod of checkpoint a"
    for a_present, keys, gc_job in samples:
        if not a_present:  # removed only by the cleanup Job, once no pod of checkpoint a existed any more
            assert key_a not in keys and gc_job, (keys, gc_job)
    job = wait_for(
        lambda: (
            (j := env.lc.get("batch/v1", "jobs", Names(name).gc_job(key_b)))
            and (j.get("status") or {}).get("succeeded")
            and j
        ),
        WAIT_S,
        what="the cleanup Job succeeded",
    )
    assert job["metadata"]["labels"][C.LABEL_CHECKPOINT_KEY] == key_b
    # the fetch Job of a no longer vouches for a directory the cleanup removed (its TTL is an hour): a switch
    # back to a fetches again instead of rolling onto a checkpoint that is gone
    assert env.lc.get("batch/v1", "jobs", Names(name).job(key_a)) is None
    assert env.lc.get("batch/v1", "jobs", Names(name).job(key_b)) is not None
    env.lc.api.wait_event(NS, name, "Normal", "Deleted")

    # back to a: nothing vouches for it any more, so it is fetched again (a second download) before the roll
    assert env.source.count(f"/a/{C.WEIGHTS_FILE}") == 1
    env.patch(name, {"checkpoint": {"source": env.source.url_for("a/")}})
    env.wait(
        name,
        lambda s: (
            s.get("phase") == C.PHASE_READY
            and s.get("observedGeneration") == 3
            and s.get("checkpoint", {}).get("servingKey") == key_a
        ),
        "Ready on checkpoint a again",
    )
    assert env.source.count(f"/a/{C.WEIGHTS_FILE}") == 2
    assert (cache / key_a / C.COMPLETE_MARKER).is_file()
    env.delete(name)


def test_a_deleted_cache_claim_is_reported_and_the_checkpoint_fetched_again_into_the_new_one(env: Env) -> None:
    """The claim a user deletes stays Terminating while pods use it (StorageReady says so), then the operator makes
    a new, empty one: a fetch Job that ran against the old claim no longer vouches for the checkpoint, so it is
    fetched again instead of the pods crash-looping on "checkpoint not fetched"."""
    name = "reclaim"
    claim = f"{name}-cache"
    env.apply(env.doc(name, "r"))
    status = env.wait(name, lambda s: s.get("phase") == C.PHASE_READY, "Ready")
    old_uid = env.claim(claim)["metadata"]["uid"]
    assert status["checkpoint"]["claimUid"] == old_uid
    # the completed fetch pod goes at once (not after the Job's hour of TTL): it would keep a deleted claim alive
    fetch_pods = f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_FETCH}"
    wait_for(lambda: not env.lc.list("v1", "pods", fetch_pods), 60, what="the completed fetch pod deleted")
    assert env.lc.get("batch/v1", "jobs", Names(name).job(status["checkpoint"]["key"])) is not None

    env.lc.kubectl("delete", "pvc", claim, "--wait=false")
    status = env.wait(
        name,
        lambda s: cond(s, C.COND_STORAGE_READY).get("reason") == "ClaimTerminating",
        "StorageReady=False ClaimTerminating",
    )
    assert (
        cond(status, C.COND_STORAGE_READY)["status"] == "False"
        and claim in cond(status, C.COND_STORAGE_READY)["message"]
    )
    env.lc.api.wait_event(NS, name, "Warning", "ClaimTerminating")
    env.lc.kubectl("delete", "pod", f"{name}-0", "--wait=false")  # the claim's last user: now it goes

    status = env.wait(
        name,
        lambda s: s.get("phase") == C.PHASE_READY and s.get("checkpoint", {}).get("claimUid") not in (None, old_uid),
        "Ready on a new claim",
        timeout=WAIT_S + 60,
    )
    new_claim = env.claim(claim)
    assert new_claim["metadata"]["uid"] == status["checkpoint"]["claimUid"] != old_uid
    assert env.source.count(f"/r/{C.WEIGHTS_FILE}") == 2  # fetched again, into the new claim
    assert (env.lc.node.storage.path(NS, claim) / status["checkpoint"]["key"] / C.COMPLETE_MARKER).is_file()
    assert cond(status, C.COND_STORAGE_READY)["status"] == "True"
    env.delete(name)
