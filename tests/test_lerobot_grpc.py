"""LeRobot's own robot_client code against a served tiny SmolVLA (``--lerobot-grpc-port``), next to LeRobot's own
``policy_server`` (slow: a real server process, real grpcio, LeRobot's stubs and message classes).

The robot side is LeRobot's ``RobotClient`` itself -- its ``start`` (Ready, pickled ``RemotePolicyConfig``),
``send_observation`` (pickled ``TimedObservation`` in LeRobot's chunks) -- on a channel to the server, with the
robot replaced by the features a robot with six motors and two cameras reports (``RobotClient.__init__`` only
connects a robot and builds these).  ``GetActions`` is called as its ``receive_actions`` loop calls it.
"""

from __future__ import annotations

import os
import pickle
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

grpc = pytest.importorskip("grpc")
pytest.importorskip("lerobot")

from lerobot.async_inference.helpers import RemotePolicyConfig, TimedAction, TimedObservation  # noqa: E402
from lerobot.transport import services_pb2, services_pb2_grpc  # noqa: E402
from lerobot.transport.utils import grpc_channel_options  # noqa: E402
from lerobot.utils.feature_utils import hw_to_dataset_features  # noqa: E402
from openpi_client.websocket_client_policy import WebsocketClientPolicy  # noqa: E402

from policy_operator.runtime.policy.lerobot.loading import go_offline  # noqa: E402
from policy_operator.runtime.policy.lerobot.tiny import write_tiny_checkpoint  # noqa: E402
from policy_operator.runtime.serving.lerobot_grpc import METADATA_KEY  # noqa: E402
from tests.support.servers import PolicyServerProcess, serve_policy  # noqa: E402

pytestmark = pytest.mark.slow

ATOL = 1e-5
GRPC_LINE = r"LeRobot AsyncInference gRPC on [0-9.]+:(\d+)"
MOTORS = [f"joint{i}.pos" for i in range(6)]
# the tiny SmolVLA reads observation.state (6), observation.images.top and .wrist (3 x 48 x 64); the robot's
# wrist camera is larger: it is resized as LeRobot's server resizes it
ROBOT_FEATURES = {**dict.fromkeys(MOTORS, float), "top": (48, 64, 3), "wrist": (96, 128, 3)}
CHUNK = 5


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint("smolvla", tmp_path_factory.mktemp("smolvla") / "ckpt", seed=1)


@pytest.fixture(scope="module")
def server(checkpoint: Path) -> Iterator[tuple[PolicyServerProcess, str]]:
    args = ("--policy", "lerobot", "--lerobot-grpc-port", "0", "--threads", "1", "--max-batch", "8")
    with serve_policy(checkpoint, *args, "--drain-grace-s", "0") as srv:
        port = int(srv.wait_for_log(GRPC_LINE).group(1))
        yield srv, f"127.0.0.1:{port}"


@pytest.fixture(scope="module")
def robot_client_class(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """LeRobot's RobotClient (its module opens a log file under ./logs when imported: a directory of this test's)."""
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("robot-client-logs"))
    try:
        from lerobot.async_inference.robot_client import RobotClient
    finally:
        os.chdir(cwd)
    return RobotClient


def robot_client(
    cls: Any,
    address: str,
    *,
    policy_type: str = "smolvla",
    actions: int = CHUNK,
    pretrained: str = "lerobot/smolvla_base",
) -> Any:
    """A ``RobotClient`` as its ``__init__`` builds one, minus the hardware: the same channel options, stub,
    policy instructions (from the robot's features) and events."""
    client = cls.__new__(cls)
    client.server_address = address
    client.policy_config = RemotePolicyConfig(
        policy_type, pretrained, hw_to_dataset_features(ROBOT_FEATURES, "observation"), actions, "cpu"
    )
    # One connection per client, as robots in processes of their own have: in one process grpc would share one
    # connection between channels to the same address, and a session is a connection (docs/protocol.md).
    options = [*grpc_channel_options(initial_backoff="0.0333s"), ("grpc.use_local_subchannel_pool", 1)]
    client.channel = grpc.insecure_channel(address, options)
    client.stub = services_pb2_grpc.AsyncInferenceStub(client.channel)
    client.shutdown_event = threading.Event()
    client.must_go = threading.Event()
    assert client.start(), "RobotClient.start() failed"
    return client


def raw_observation(seed: int) -> dict[str, Any]:
    """What ``robot.get_observation()`` returns, with the task and the seed this request's noise comes from."""
    rng = np.random.default_rng(seed)
    obs: dict[str, Any] = {m: float(v) for m, v in zip(MOTORS, rng.standard_normal(6), strict=True)}
    obs["top"] = rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)
    obs["wrist"] = rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)
    obs["task"] = "stack the blocks"
    obs["seed"] = seed
    return obs


def timed(step: int, seed: int) -> TimedObservation:
    return TimedObservation(timestamp=time.time(), timestep=step, observation=raw_observation(seed), must_go=True)


def get_actions(stub: Any) -> list[TimedAction]:
    reply = stub.GetActions(services_pb2.Empty(), timeout=60)
    assert reply.data, "GetActions answered empty"
    return pickle.loads(reply.data)


def chunk_of(actions: list[TimedAction]) -> np.ndarray:
    return torch.stack([a.get_action() for a in actions]).numpy()


@pytest.fixture(scope="module")
def lerobots_own(checkpoint: Path, robot_client_class: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """LeRobot's own ``policy_server`` in this process (its tokenizer reference is relative to the checkpoint)."""
    go_offline()
    cwd = os.getcwd()
    os.chdir(checkpoint)
    try:
        from lerobot.async_inference.configs import PolicyServerConfig
        from lerobot.async_inference.policy_server import PolicyServer

        # its port field is only read by LeRobot's own serve(): this test binds a free port itself
        own = PolicyServer(PolicyServerConfig(host="127.0.0.1", port=1, inference_latency=0.0))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        services_pb2_grpc.add_AsyncInferenceServicer_to_server(own, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            # LeRobot's server loads what its client names; ours serves its own and only logs the name
            yield robot_client(robot_client_class, f"127.0.0.1:{port}", pretrained=str(checkpoint))
        finally:
            server.stop(0)
    finally:
        os.chdir(cwd)


def test_robot_client_gets_the_actions_lerobots_own_server_gives(
    server: tuple[PolicyServerProcess, str], robot_client_class: Any, lerobots_own: Any
) -> None:
    srv, address = server
    ours = robot_client(robot_client_class, address)
    for step, seed in ((0, 11), (CHUNK, 12)):
        obs = timed(step, seed)
        assert ours.send_observation(obs) and lerobots_own.send_observation(obs)
        mine = get_actions(ours.stub)
        torch.manual_seed(seed)  # LeRobot's server draws its noise from torch's global generator
        theirs = get_actions(lerobots_own.stub)
        assert [a.get_timestep() for a in mine] == [a.get_timestep() for a in theirs] == list(range(step, step + CHUNK))
        assert [a.get_timestamp() for a in mine] == pytest.approx([a.get_timestamp() for a in theirs])
        np.testing.assert_allclose(chunk_of(mine), chunk_of(theirs), rtol=0, atol=ATOL)
        # what robot_client does with them: torch tensors on a device it can move them from
        assert all(type(a.get_action()) is torch.Tensor and a.get_action().device.type == "cpu" for a in mine)
        assert {a.get_action().dtype for a in mine} == {a.get_action().dtype for a in theirs} == {torch.float32}
    # the WebSocket side of the same pod names the gRPC port in its metadata
    meta = WebsocketClientPolicy(srv.url).get_server_metadata()
    assert meta[METADATA_KEY] == int(address.rsplit(":", 1)[1])


def test_instructions_for_another_policy_are_a_clear_error(
    server: tuple[PolicyServerProcess, str], robot_client_class: Any
) -> None:
    _, address = server
    for change, words in (({"policy_type": "pi0"}, "serves a 'smolvla' policy"), ({"actions": 9}, "1..8")):
        with pytest.raises(AssertionError, match="start"):
            robot_client(robot_client_class, address, **change)  # RobotClient.start() logs the error, returns False
        stub = services_pb2_grpc.AsyncInferenceStub(grpc.insecure_channel(address))
        stub.Ready(services_pb2.Empty())
        config = RemotePolicyConfig(
            change.get("policy_type", "smolvla"),
            "x",
            hw_to_dataset_features(ROBOT_FEATURES, "observation"),
            change.get("actions", CHUNK),
        )
        with pytest.raises(grpc.RpcError) as raised:
            stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(config)))
        assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION and words in raised.value.details()


class Runs:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def test_a_pickle_that_would_run_code_is_refused_and_every_client_carries_on(
    server: tuple[PolicyServerProcess, str], robot_client_class: Any, tmp_path: Path
) -> None:
    srv, address = server
    marker = tmp_path / "pwned"
    attacker, other = robot_client(robot_client_class, address), robot_client(robot_client_class, address)
    assert other.send_observation(timed(0, 3))
    evil = TimedObservation(time.time(), 1, {"joint0.pos": Runs(marker)}, must_go=True)
    with pytest.raises(grpc.RpcError) as raised:
        attacker.stub.SendObservations(
            iter(
                [
                    services_pb2.Observation(
                        transfer_state=services_pb2.TransferState.TRANSFER_END, data=pickle.dumps(evil)
                    )
                ]
            )
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "refused: its pickle names posix.system" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        attacker.stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(Runs(marker))))
    assert "policy instructions refused" in raised.value.details()
    assert not marker.exists()
    assert len(get_actions(other.stub)) == CHUNK  # the other client's session is untouched
    assert attacker.send_observation(timed(2, 4))  # and the attacker's own session still serves
    assert [a.get_timestep() for a in get_actions(attacker.stub)] == list(range(2, 2 + CHUNK))
    assert srv.alive and srv.readyz().status == 200


def test_many_clients_each_their_own_session_and_ready_resets_only_its_own(
    server: tuple[PolicyServerProcess, str], robot_client_class: Any
) -> None:
    """Eight robot_clients at once, each answered for its own observation (LeRobot's server serves one: each
    Ready resets it); a ninth client's Ready in the middle resets nobody else."""
    _, address = server
    clients = [robot_client(robot_client_class, address) for _ in range(8)]
    for k, client in enumerate(clients):
        assert client.send_observation(timed(100 * k, 20 + k))
    robot_client(robot_client_class, address)  # Ready + instructions of another robot
    with futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda c: get_actions(c.stub), clients))
    for k, actions in enumerate(answers):
        assert [a.get_timestep() for a in actions] == list(range(100 * k, 100 * k + CHUNK))
    chunks = [chunk_of(a) for a in answers]
    assert all(not np.allclose(chunks[0], c) for c in chunks[1:])  # each its own observation and seed
    alone = robot_client(robot_client_class, address)
    assert alone.send_observation(timed(700, 27))
    np.testing.assert_allclose(chunk_of(get_actions(alone.stub)), chunks[7], rtol=0, atol=ATOL)  # batched = alone


def test_get_actions_without_an_observation_answers_empty_as_lerobot_does(
    server: tuple[PolicyServerProcess, str], robot_client_class: Any
) -> None:
    _, address = server
    client = robot_client(robot_client_class, address)
    started = time.monotonic()
    assert client.stub.GetActions(services_pb2.Empty(), timeout=30).data == b""
    assert 1.5 <= time.monotonic() - started < 15  # LeRobot's obs_queue_timeout (2 s)
    raw = raw_observation(1)
    del raw["wrist"]
    assert not client.send_observation(TimedObservation(time.time(), 0, raw, must_go=True))  # logged, False
    with pytest.raises(grpc.RpcError) as raised:
        client.stub.SendObservations(
            iter(
                [
                    services_pb2.Observation(
                        transfer_state=services_pb2.TransferState.TRANSFER_END,
                        data=pickle.dumps(TimedObservation(time.time(), 0, raw, must_go=True)),
                    )
                ]
            )
        )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "wrist" in raised.value.details()


def test_grpc_and_websocket_robots_share_a_batch(checkpoint: Path, robot_client_class: Any) -> None:
    """A LeRobot client's request and an openpi client's, queued while the replica computes a third, run as one
    batch of two (each protocol's requests go to the same engine and lanes)."""
    from tests.support.net import wait_for

    args = ("--policy", "lerobot", "--lerobot-grpc-port", "0", "--threads", "1", "--steps", "1000")
    with serve_policy(checkpoint, *args, "--drain-grace-s", "0") as srv:
        address = f"127.0.0.1:{srv.wait_for_log(GRPC_LINE).group(1)}"
        lerobot, busy, openpi = (
            robot_client(robot_client_class, address),
            WebsocketClientPolicy(srv.url),
            WebsocketClientPolicy(srv.url),
        )
        frame = raw_ws_observation({**busy.get_server_metadata(), "seed": 1})

        def in_flight(n: int) -> bool:
            return srv.readyz().json()["in_flight"] >= n

        with futures.ThreadPoolExecutor(3) as pool:
            first = pool.submit(busy.infer, frame)  # 1000 steps: seconds of work
            wait_for(lambda: in_flight(1), 60, what="the first request computing")
            queued = timed(0, 5)
            queued.observation["task"] = frame["task"]  # the same prompt: the same token count, one batch shape
            assert lerobot.send_observation(queued)
            grpc_answer = pool.submit(get_actions, lerobot.stub)
            wait_for(lambda: in_flight(2), 60, what="the LeRobot request queued")
            ws_answer = pool.submit(openpi.infer, frame)
            wait_for(lambda: in_flight(3), 60, what="the openpi request queued")
            assert not first.done(), "the first request finished before both others queued: nothing to batch"
            assert first.result()["server_timing"]["batch_size"] == 1
            assert ws_answer.result()["server_timing"]["batch_size"] == 2  # with the LeRobot client's request
            assert len(grpc_answer.result()) == CHUNK


def raw_ws_observation(meta: dict[str, Any]) -> dict[str, Any]:
    """An openpi frame of the keys the metadata lists (uint8 cameras, float vectors, the task)."""
    from policy_operator.runtime.robolab import robolab_observation

    return robolab_observation(meta, 0, fixed_seed=meta.get("seed"))
