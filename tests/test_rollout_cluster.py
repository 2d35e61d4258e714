"""A rollout at ``replicas: 1`` keeps a robot served, on the real control plane.

The real StatefulSet controller, the local node's kubelet and Service proxy,
the real operator: a client holds a session through the Service URL and
sends requests back to back while the spec changes (``runtime.steps``).  As
openpi-client would, a request that fails is retried once after a reconnect
(the reconnect itself waits for a ready endpoint, as openpi-client's
``_wait_for_server`` does).  The operator must surge (the new pod Ready
before the old one stops) and the old pod must drain (its session closed
with 1001 after its answer), so no request is lost.  The surge decisions are
unit-tested in tests/test_surge.py, the drain in tests/test_drain.py.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import pytest
import yaml
from websockets.exceptions import ConnectionClosed, InvalidHandshake
from websockets.sync.client import ClientConnection, connect

from policy_operator import constants as C
from policy_operator.runtime.client import robolab_observation
from policy_operator.runtime.serving import wire
from tests.support.http_checkpoint_server import CheckpointServer
from tests.support.local_node_cluster import LocalCluster, for_local_node, free_port_on
from tests.support.net import wait_for
from tests.support.servers import VENV_BIN

if TYPE_CHECKING:
    from tests.support.control_plane import ControlPlane

pytestmark = [
    pytest.mark.slow,
    pytest.mark.cluster,
    pytest.mark.timeout(600),
    # a session outlives any one with-block here: it is dropped and reopened across pods
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

REPO = Path(__file__).resolve().parents[1]
NS = "rollout-it"
WAIT_S = 180.0
RECONNECT_S = 60.0  # how long a client waits for a ready endpoint before it calls the request lost


class Client:
    """One robot: one session at a time, requests back to back, a failed one retried once after a reconnect."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.ok = self.retried = self.reconnects = 0
        self.lost: list[str] = []
        self.steps_seen: list[int] = []  # the server's advertised steps, per session
        self.stop = threading.Event()
        self._ws: ClientConnection | None = None
        self._meta: dict[str, Any] = {}
        self.thread = threading.Thread(target=self._run, name="robot", daemon=True)

    def _connect(self) -> None:
        deadline = time.monotonic() + RECONNECT_S
        while True:
            try:
                self._ws = connect(self.url, compression=None, open_timeout=10, max_size=None)
                self._meta = wire.unpackb(self._ws.recv(timeout=30))
                self.steps_seen.append(int(self._meta["steps"]))
                return
            except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError) as exc:
                self.drop()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no ready endpoint for {RECONNECT_S:g}s: {exc!r}") from exc
                time.sleep(0.2)

    def drop(self) -> None:
        """Close the session, if one is open."""
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001 - already closed by the server
                pass
        self._ws = None

    def request(self, seed: int) -> None:
        """One request (connecting first when no session is open); raises when it fails."""
        if self._ws is None:
            self.reconnects += 1 if self.steps_seen else 0
            self._connect()
        assert self._ws is not None
        obs = robolab_observation(self._meta, seed, fixed_seed=seed)
        self._ws.send(wire.packb(obs))
        reply = self._ws.recv(timeout=60)
        if isinstance(reply, str):
            raise RuntimeError(f"error frame: {reply}")
        actions = np.asarray(wire.unpackb(reply)["actions"])
        if actions.ndim != 2 or not np.isfinite(actions).all():
            raise RuntimeError(f"bad actions of shape {actions.shape}")

    def _run(self) -> None:
        seed = 0
        while not self.stop.is_set():
            seed += 1
            for attempt in (0, 1):
                try:
                    self.request(seed)
                    self.ok += 1
                    break
                except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, RuntimeError) as exc:
                    self.drop()
                    if attempt == 0:
                        self.retried += 1
                    else:
                        self.lost.append(f"request {seed}: {exc!r}")
        self.drop()


@pytest.fixture(scope="module")
def cluster(
    control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[LocalCluster, str]]:
    import subprocess

    work = tmp_path_factory.mktemp("rollout-it")
    subprocess.run(
        [str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
        check=True,
        capture_output=True,
        timeout=120,
    )
    source = CheckpointServer(work / "src").start()
    lc = LocalCluster(control_plane, work / "cluster", NS, backoff_s=1.0, resync_s=0.5)
    lc.operator.probe_timeout_s = 0.5
    try:
        lc.start()
        sample = yaml.safe_load((REPO / "examples" / "policyserver-minimal.yaml").read_text())
        doc = for_local_node(sample, source=source.url_for("ckpt/"), port=free_port_on(["127.0.0.1", *lc.node.ips(16)]))
        doc["metadata"]["name"] = "robot"
        doc["spec"]["replicas"] = 1
        lc.kubectl("apply", "-f", "-", input=yaml.safe_dump(doc))
        yield lc, "robot"
    finally:
        lc.stop()
        source.stop()
    lc.node.raise_errors()
    assert "Traceback" not in lc.operator.log.read_text(), f"the operator crashed; see {lc.operator.log}"


class StatusWatch:
    """Samples the PolicyServer's status on its own thread: every READY and RANKS a client of the API could read."""

    def __init__(self, lc: LocalCluster, name: str) -> None:
        self.lc, self.name = lc, name
        self.samples: list[tuple[str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="status-watch", daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            status = self.lc.status(self.name)
            self.samples.append((str(status.get("ready")), str(status.get("ranksReady"))))
            time.sleep(0.1)


def _operator_events(lc: LocalCluster, name: str, uid: str) -> dict[str, tuple[int, dict[str, Any]]]:
    """The Events posted about the PolicyServer, by Event name: (how many times it occurred, the Event)."""
    return {
        e["metadata"]["name"]: (int(e.get("count") or 1), e)
        for e in lc.api.events(NS, involved_name=name)
        if e["involvedObject"].get("uid") == uid
    }


def _posted_since(
    before: dict[str, tuple[int, dict[str, Any]]], now: dict[str, tuple[int, dict[str, Any]]]
) -> list[dict[str, Any]]:
    """One entry per occurrence in ``now`` that ``before`` did not have: what was posted in between, oldest first."""
    return [
        event
        for key, (count, event) in sorted(now.items(), key=lambda kv: kv[1][1].get("lastTimestamp") or "")
        for _ in range(count - before.get(key, (0, {}))[0])
    ]


def test_a_session_held_across_a_rollout_loses_no_request(cluster: tuple[LocalCluster, str]) -> None:
    """One replica, one robot: the robot reconnects once (to the pod that stays), READY and RANKS never read more
    than the desired 1/1 and 2/2, and the rollout posts a handful of Events."""
    lc, name = cluster
    first = lc.wait_status(name, lambda s: s.get("phase") == C.PHASE_READY, "first Ready", WAIT_S)
    old_revision = first["pods"][0]["revision"]
    generation = first["observedGeneration"]
    uid = (lc.get(C.API_VERSION, C.PLURAL, name) or {})["metadata"]["uid"]
    steps = 3 if _steps(lc, name) != 3 else 2  # a change that rolls the pods
    robot = Client(lc.node.service_url(NS, name, C.PORT_NAME, scheme="ws"))
    watch = StatusWatch(lc, name)
    robot.thread.start()
    try:
        wait_for(lambda: robot.ok >= 3 or not robot.thread.is_alive(), 60, what="the robot served")
        # What follows the first Ready is not the rollout's: the cleanup Job comes once the StatefulSet counts the
        # pod ready (the kubelet's probe), seconds after the operator's own /readyz made the phase Ready
        lc.api.wait_event(NS, name, "Normal", "Created", message="cleanup Job", timeout=WAIT_S)
        lc.operator.settle(passes=3)
        before = _operator_events(lc, name, uid)
        watch.thread.start()
        lc.kubectl(
            "patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps({"spec": {"runtime": {"steps": steps}}})
        )
        done = lc.wait_status(
            name,
            lambda s: (
                s.get("observedGeneration") == generation + 1
                and s.get("phase") == C.PHASE_READY
                and len(s.get("pods") or []) == 1
                and all(p.get("revision") != old_revision for p in s.get("pods") or [])
            ),
            "rolled and Ready",
            WAIT_S,
        )
        sts = lc.get("apps/v1", "statefulsets", name) or {}
        assert sts["spec"]["replicas"] == 1 and C.ANNOTATION_SURGE not in sts["metadata"].get("annotations", {})
        served = robot.ok
        wait_for(lambda: robot.ok >= served + 3 or not robot.thread.is_alive(), 60, what="the robot served after")
    finally:
        robot.stop.set()
        watch.stop.set()
        robot.thread.join(90)
        watch.thread.join(10)
    assert robot.lost == [], robot.lost
    assert robot.steps_seen[-1] == steps  # the session moved to a pod of the new spec
    assert robot.reconnects == 1 and robot.ok > 6, (robot.reconnects, robot.steps_seen)
    assert len(done["pods"]) == 1
    world_size = int(done["ranksReady"].split("/")[1])  # one pod's ranks
    above = [
        s
        for s in watch.samples
        if s != ("None", "None")
        and not (_fraction(s[0]) <= (1, 1) and _fraction(s[1])[0] <= _fraction(s[1])[1] == world_size)
    ]
    assert watch.samples and not above, f"READY/RANKS above the desired count: {sorted(set(above))}"
    events = _posted_since(before, _operator_events(lc, name, uid))
    reasons = " ".join(e["reason"] for e in events)
    assert "SurgeComplete" in reasons and "surge:" in next(  # the new pod was Ready first
        e["message"] for e in events if e["reason"] == "Updated"
    ), reasons
    # Updated, SurgeComplete, the phase there and back, Progressing there and back; Available's own transitions
    # (a starting pod is not RanksUnknown) are test_status_cluster's
    rollout = [e for e in events if not (e.get("message") or "").startswith(f"{C.COND_AVAILABLE}=")]
    assert len(rollout) <= 6, [(e.get("lastTimestamp"), e["reason"], e.get("message")) for e in events]


def _fraction(text: str) -> tuple[int, int]:
    done, _, total = text.partition("/")
    return int(done), int(total)


def _steps(lc: LocalCluster, name: str) -> int:
    return int(((lc.get(C.API_VERSION, C.PLURAL, name) or {}).get("spec") or {}).get("runtime", {}).get("steps", 2))


def _server_pods(lc: LocalCluster, name: str) -> dict[str, tuple[str, int]]:
    """name -> (uid, restarts of the server container) of every server pod."""
    pods = lc.list("v1", "pods", f"{C.LABEL_INSTANCE}={name},{C.LABEL_COMPONENT}={C.COMPONENT_SERVER}")
    return {
        p["metadata"]["name"]: (
            p["metadata"]["uid"],
            sum(int(cs.get("restartCount") or 0) for cs in (p.get("status") or {}).get("containerStatuses") or []),
        )
        for p in pods
    }


def test_kubectl_set_env_is_removed_without_restarting_a_pod(cluster: tuple[LocalCluster, str]) -> None:
    """Server-side apply leaves an env entry another manager added: the operator takes the whole template back,
    says so with an Event, and (updateStrategy OnDelete) no pod restarts for either change."""
    lc, name = cluster
    lc.wait_status(name, lambda s: s.get("phase") == C.PHASE_READY, "Ready", WAIT_S)
    pods = _server_pods(lc, name)
    lc.kubectl("set", "env", f"statefulset/{name}", "-c", "server", "DRIFT_ADDED=1")

    def template_env() -> list[str]:
        sts = lc.get("apps/v1", "statefulsets", name) or {}
        return [e["name"] for c in sts["spec"]["template"]["spec"]["containers"] for e in c.get("env") or []]

    wait_for(lambda: "DRIFT_ADDED" not in template_env(), 60, what="the foreign env entry removed")
    lc.api.wait_event(NS, name, "Warning", "Repaired", message="kubectl-set")
    lc.operator.settle(passes=3)
    assert "DRIFT_ADDED" not in template_env()
    status = lc.wait_status(name, lambda s: s.get("phase") == C.PHASE_READY, "still Ready", WAIT_S)
    assert _server_pods(lc, name) == pods, "a pod was replaced or restarted for the edit or its repair"
    sts = lc.get("apps/v1", "statefulsets", name) or {}
    assert sts["status"]["currentRevision"] == sts["status"]["updateRevision"] == status["pods"][0]["revision"]


def test_a_service_port_edited_by_hand_is_put_back(cluster: tuple[LocalCluster, str]) -> None:
    """``kubectl patch svc`` on the port makes it another key of the ports list map: without the repair every
    later apply fails with 422 Duplicate value "ws" and robots cannot connect on the documented port."""
    lc, name = cluster
    lc.wait_status(name, lambda s: s.get("phase") == C.PHASE_READY, "Ready", WAIT_S)
    port = (lc.get("v1", "services", name) or {})["spec"]["ports"][0]["port"]
    lc.kubectl(
        "patch",
        "service",
        name,
        "--type=json",
        "-p",
        json.dumps([{"op": "replace", "path": "/spec/ports/0/port", "value": 9999}]),
    )
    wait_for(
        lambda: [p["port"] for p in (lc.get("v1", "services", name) or {})["spec"]["ports"]] == [port],
        60,
        what=f"Service port {port} put back",
    )
    lc.api.wait_event(NS, name, "Warning", "Repaired", message="9999/TCP")
    lc.operator.settle(passes=3)
    status = lc.status(name)
    progressing = next(c for c in status["conditions"] if c["type"] == C.COND_PROGRESSING)
    assert progressing["reason"] != "ApplyFailed", progressing
    assert [p["port"] for p in (lc.get("v1", "services", name) or {})["spec"]["ports"]] == [port]
    robot = Client(lc.node.service_url(NS, name, C.PORT_NAME, scheme="ws"))
    robot.request(1)  # the documented port serves
    robot.drop()
