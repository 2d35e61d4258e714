"""A ``policy.type: lerobot`` PolicyServer on the real control plane, its checkpoint and the repositories it names on a hub.

The checkpoint is a tiny SmolVLA (random weights, built offline) whose
config and saved preprocessor name its SmolVLM config/processor/tokenizer as
a hub repository, ``lab/tiny-smolvlm``, as a real SmolVLA checkpoint names
``HuggingFaceTB/SmolVLM2-500M-Video-Instruct``.  The hub is the stub on
127.0.0.1 (``tests/support/hub_stub.py``), reached only by the fetch Job
through ``checkpoint.fetchJob.env`` HF_ENDPOINT; the server pod gets no
endpoint and loads with HF_HUB_OFFLINE=1 from the cache.  The operator, the
Job and StatefulSet controllers and kubectl are real; the pods are local
processes (the local node).  An openpi client then asks for actions in
LeRobot's keys, as a robot would.  A second PolicyServer names a repository
the hub does not have: it must fail before any server pod exists.  A third
serves a tiny LingBot-VA (``policy.family: lingbot_va``) with its two
guidance branches on two gloo ranks (cfgp=2), and answers bitwise as a
one-rank server of the same checkpoint.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.runtime.checkpoint.format import write_manifest
from tests.support.hub_stub import HubStub
from tests.support.local_node_cluster import LocalCluster, for_local_node, free_port_on
from tests.support.net import wait_for

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytest.importorskip("lerobot")
pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[1]
NS = "lerobot-it"
CKPT, BROKEN, VLM = "lab/tiny-smolvla", "lab/smolvla-missing-vlm", "lab/tiny-smolvlm"
LINGBOT = "lab/tiny-lingbot-va"
WAIT_S = 300.0


def name_repository(root: Path, repo_id: str) -> None:
    """Point the checkpoint's VLM and tokenizer references at ``repo_id`` (a real SmolVLA names its SmolVLM)."""
    config = json.loads((root / "config.json").read_text())
    config["vlm_model_name"] = repo_id
    (root / "config.json").write_text(json.dumps(config, indent=2))
    pre = json.loads((root / "policy_preprocessor.json").read_text())
    for step in pre["steps"]:
        if "tokenizer_name" in step.get("config", {}):
            step["config"]["tokenizer_name"] = repo_id
    (root / "policy_preprocessor.json").write_text(json.dumps(pre, indent=2))
    write_manifest(root)


@dataclass
class Hub:
    stub: HubStub
    work: Path


@pytest.fixture(scope="module")
def hub(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Hub]:
    from policy_operator.runtime.policy.lerobot.tiny import VLM_DIR, write_tiny_checkpoint

    work = tmp_path_factory.mktemp("lerobot-hub")
    ckpt = write_tiny_checkpoint("smolvla", work / "ckpt", seed=5)
    shutil.move(ckpt / VLM_DIR, work / "vlm")  # no longer bundled: only the hub has it
    name_repository(ckpt, VLM)
    broken = work / "broken"
    shutil.copytree(ckpt, broken)
    name_repository(broken, "lab/not-on-the-hub")
    with HubStub() as stub:
        stub.add_repo(CKPT, ckpt)
        stub.add_repo(BROKEN, broken)
        stub.add_repo(VLM, work / "vlm")
        yield Hub(stub, work)


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    lc = LocalCluster(
        control_plane, tmp_path_factory.mktemp("lerobot-cluster"), NS, backoff_s=1.0, resync_s=0.5, gpus=0
    )
    try:
        yield lc.start()
    finally:
        lc.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


def lerobot_server(lc: LocalCluster, hub: Hub, name: str, repo: str, **spec_fields: Any) -> dict[str, Any]:
    sample = yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text())
    port = free_port_on(["127.0.0.1", *lc.node.ips(16)])
    doc = for_local_node(sample, source=f"hf://{repo}", port=port)
    doc["metadata"]["name"] = name
    spec = doc["spec"]
    spec["runtime"].pop("steps")  # the checkpoint's own num_steps
    spec["runtime"]["extraArgs"] = ["--threads", "1", "--error-format", "dict"]
    spec["policy"] = {"type": "lerobot"}
    spec["checkpoint"]["fetchJob"] = {
        "backoffLimit": 0,
        "env": [
            {"name": C.ENV_HF_ENDPOINT, "value": hub.stub.endpoint},
            {"name": "HF_HUB_DISABLE_TELEMETRY", "value": "1"},
        ],
    }
    spec.update(spec_fields)
    lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
    return doc


def observation(meta: dict[str, Any], seed: int) -> dict[str, Any]:
    """What a robot sends, built from the metadata frame alone: uint8 HWC frames, float32 state, the task."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {}
    for key, want in meta["observation_keys"].items():
        if want["dtype"] == "str":
            obs[key] = "pick up the red cube"
        elif want["dtype"] == "uint8":
            obs[key] = rng.integers(0, 256, size=want["shape"], dtype=np.uint8)
        else:
            obs[key] = rng.standard_normal(want["shape"]).astype(np.float32)
    return obs


def condition(status: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((x for x in status.get("conditions") or [] if x["type"] == kind), {})


def test_lerobot_policyserver_fetches_what_the_checkpoint_names_and_serves_openpi_clients(
    cluster: LocalCluster, hub: Hub
) -> None:
    from tests.support.openpi import session_at

    lc = cluster
    doc = lerobot_server(lc, hub, "smolvla", CKPT)
    status = lc.wait_status("smolvla", lambda s: s.get("phase") == C.PHASE_READY, "phase Ready", WAIT_S)
    assert condition(status, C.COND_AVAILABLE)["status"] == "True"
    sts = lc.existing("apps/v1", "statefulsets", "smolvla")
    server = sts["spec"]["template"]["spec"]["containers"][0]
    assert server["command"][server["command"].index("--policy") + 1] == "lerobot"
    assert "--guidance" not in server["command"] and "--steps" not in server["command"]  # the policy's own
    env = {e["name"]: e.get("value") for e in server["env"]}
    assert env[C.ENV_HF_HUB_OFFLINE] == "1" and C.ENV_HF_ENDPOINT not in env
    # the fetch Job asked the hub for the checkpoint and for the repository it names; the pods never did
    paths = [r.path for r in hub.stub.requests]
    assert any(p.startswith(f"/api/models/{CKPT}") for p in paths)
    assert any(p.startswith(f"/api/models/{VLM}") for p in paths)

    (pod,) = lc.list("v1", "pods", f"{C.LABEL_INSTANCE}=smolvla,{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    asked = len(hub.stub.requests)
    with session_at(pod["status"]["podIP"], doc["spec"]["service"]["port"]) as client:
        meta = client.get_server_metadata()
        assert meta["lerobot_type"] == "smolvla" and meta["guidance"] == 1.0
        assert set(meta["observation_keys"]) == {
            "observation.images.top",
            "observation.images.wrist",
            "observation.state",
            "task",
        }
        horizon, dim = meta["chunk_shape"]
        obs = {**observation(meta, seed=1), "seed": 7}
        first = client.infer(obs)["actions"]
        assert first.shape == (horizon, dim) and np.isfinite(first).all()
        np.testing.assert_array_equal(client.infer(obs)["actions"], first)  # same seed, same actions
        assert not np.array_equal(client.infer({**obs, "seed": 8})["actions"], first)
        wrong = {k: v for k, v in obs.items() if k != "task"}
        error = client.infer(wrong)
        assert error["error"]["kind"] == "invalid_observation" and "'task'" in error["error"]["message"], error
    assert len(hub.stub.requests) == asked  # serving reached no hub
    assert doc["spec"]["policy"] == {"type": "lerobot"}


def test_a_repository_the_hub_lacks_fails_before_any_server_pod(cluster: LocalCluster, hub: Hub) -> None:
    lc = cluster
    lerobot_server(lc, hub, "broken", BROKEN)
    status = lc.wait_status("broken", lambda s: s.get("phase") == C.PHASE_FAILED, "phase Failed", WAIT_S)
    ready = condition(status, C.COND_CHECKPOINT_READY)
    # the hub's 404 fails the Job at once (fetch exit 6, podFailurePolicy), not after its retries
    assert ready["status"] == "False" and ready["reason"] == "SourceNotFound", ready
    assert "config.json vlm_model_name names lab/not-on-the-hub, which the server needs offline" in ready["message"]
    job = lc.get("batch/v1", "jobs", status["checkpoint"]["jobName"]) or {}
    conditions = (job.get("status") or {}).get("conditions") or []
    failed: dict[str, Any] = next((c for c in conditions if c.get("type") == "Failed"), {})
    assert failed.get("reason") == "PodFailurePolicy", job.get("status")  # exit 6 is FETCH_FATAL: the Job's own rule
    wait_for(
        lambda: any(
            e.get("type") == "Warning" and "lab/not-on-the-hub" in e.get("message", "")
            for e in lc.api.events(NS, involved_name="broken")
        ),
        60,
        what="a Warning Event",
    )
    assert lc.get("apps/v1", "statefulsets", "broken") is None
    assert not lc.list("v1", "pods", f"{C.LABEL_INSTANCE}=broken,{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")


def test_a_lingbot_va_policyserver_with_cfgp2_answers_as_cfgp1(cluster: LocalCluster, hub: Hub, tmp_path: Path) -> None:
    """Issue 42: policy.family admits cfgp=2 for a LeRobot CFG family; the pod runs the two branches on two ranks
    with the checkpoint's own guidance (5.0) and answers a robot in LeRobot's keys as one rank does, bitwise."""
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from policy_operator.cli import main as policyserver
    from tests.support.openpi import session_at
    from tests.support.servers import serve_policy

    lc = cluster
    ckpt = tmp_path / "lingbot"
    assert (
        policyserver(["checkpoint", "init", "--lerobot", "lingbot_va", "--size", "tiny", "--seed", "4", str(ckpt)]) == 0
    )
    # cfgp=1 on one rank, sequential CFG: what cfgp=2 must equal (both on CPU, one thread each)
    with serve_policy(ckpt, "--policy", "lerobot", "--threads", "1", "--cfg-mode", "sequential") as one_rank:
        client = WebsocketClientPolicy(one_rank.url)
        meta = client.get_server_metadata()
        obs = {**observation(meta, seed=3), "seed": 9}
        expected = np.asarray(client.infer(dict(obs))["actions"])

    hub.stub.add_repo(LINGBOT, ckpt)
    doc = lerobot_server(
        lc, hub, "lingbot", LINGBOT, policy={"type": "lerobot", "family": "lingbot_va"}, parallelism={"cfgp": 2}
    )
    status = lc.wait_status("lingbot", lambda s: s.get("phase") == C.PHASE_READY, "phase Ready", WAIT_S)
    assert condition(status, C.COND_AVAILABLE)["status"] == "True"
    sts = lc.existing("apps/v1", "statefulsets", "lingbot")
    command = sts["spec"]["template"]["spec"]["containers"][0]["command"]
    assert (
        command[command.index("--cfgp") + 1] == "2" and command[command.index("--lerobot-family") + 1] == "lingbot_va"
    )
    assert "--guidance" not in command  # the checkpoint's own, not the reference policy's 3.0
    (pod,) = lc.list("v1", "pods", f"{C.LABEL_INSTANCE}=lingbot,{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    try:
        with session_at(pod["status"]["podIP"], doc["spec"]["service"]["port"]) as robot:
            meta = robot.get_server_metadata()
            assert meta["lerobot_type"] == "lingbot_va" and meta["guidance"] == 5.0
            assert set(meta["observation_keys"]) == {
                "observation.images.top",
                "observation.images.wrist",
                "observation.state",
                "task",
            }
            actions = np.asarray(robot.infer(dict(obs))["actions"])
    finally:
        lc.kubectl("delete", "policyserver", "lingbot", "--wait=false")
    assert actions.shape == tuple(meta["chunk_shape"]) and np.isfinite(actions).all()
    assert np.array_equal(actions, expected), np.abs(actions - expected).max()
