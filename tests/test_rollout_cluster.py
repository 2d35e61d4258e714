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

pytestmark = [pytest.mark.slow, pytest.mark.cluster, pytest.mark.timeout(600),
              # a session outlives any one with-block here: it is dropped and reopened across pods
              pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning")]

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
                self._drop()
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no ready endpoint for {RECONNECT_S:g}s: {exc!r}") from exc
                time.sleep(0.2)

    def _drop(self) -> None:
        if self._ws is not None:
            try:
                self._ws.close()
            except Exception:  # noqa: BLE001 - already closed by the server
                pass
        self._ws = None

    def _request(self, seed: int) -> None:
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
                    self._request(seed)
                    self.ok += 1
                    break
                except (OSError, InvalidHandshake, ConnectionClosed, TimeoutError, RuntimeError) as exc:
                    self._drop()
                    if attempt == 0:
                        self.retried += 1
                    else:
                        self.lost.append(f"request {seed}: {exc!r}")
        self._drop()


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, str]]:
    import subprocess

    work = tmp_path_factory.mktemp("rollout-it")
    subprocess.run([str(VENV_BIN / "policyserver"), "checkpoint", "init", str(work / "src" / "ckpt")],
                   check=True, capture_output=True, timeout=120)
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


def test_a_session_held_across_a_rollout_loses_no_request(cluster: tuple[LocalCluster, str]) -> None:
    lc, name = cluster
    first = lc.wait_status(name, lambda s: s.get("phase") == C.PHASE_READY, "first Ready", WAIT_S)
    old_revision = first["pods"][0]["revision"]
    robot = Client(lc.node.service_url(NS, name, C.PORT_NAME, scheme="ws"))
    robot.thread.start()
    try:
        wait_for(lambda: robot.ok >= 3 or not robot.thread.is_alive(), 60, what="the robot served")
        lc.kubectl("patch", C.SHORT_NAME, name, "--type=merge", "-p", json.dumps({"spec": {"runtime": {"steps": 3}}}))
        done = lc.wait_status(name, lambda s: s.get("observedGeneration") == 2 and s.get("phase") == C.PHASE_READY
                              and all(p.get("revision") != old_revision for p in s.get("pods") or []),
                              "rolled and Ready", WAIT_S)
        sts = lc.get("apps/v1", "statefulsets", name) or {}
        assert sts["spec"]["replicas"] == 1 and C.ANNOTATION_SURGE not in sts["metadata"].get("annotations", {})
        before = robot.ok
        wait_for(lambda: robot.ok >= before + 3 or not robot.thread.is_alive(), 60, what="the robot served after")
    finally:
        robot.stop.set()
        robot.thread.join(90)
    assert robot.lost == [], robot.lost
    assert robot.steps_seen[0] == 2 and robot.steps_seen[-1] == 3  # the session moved to a pod of the new spec
    assert robot.reconnects >= 1 and robot.ok > 6
    assert len(done["pods"]) == 1
    seen = {e["reason"] for e in lc.list("v1", "events") if e["involvedObject"].get("name") == name
            and e["involvedObject"].get("kind") == C.KIND}
    assert {"SurgeStarted", "SurgeReady", "SurgeComplete"} <= seen, seen  # the new pod was Ready first
