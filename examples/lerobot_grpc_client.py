"""A robot's side of LeRobot's AsyncInference protocol, without the robot: what ``robot_client`` sends, on its wire.

``python -m lerobot.async_inference.robot_client`` needs a connected robot.
This script speaks the same calls with LeRobot's own stubs and message classes
-- ``Ready``, a pickled ``RemotePolicyConfig`` built from the robot's features,
then ``SendObservations`` of must-go ``TimedObservation``s (LeRobot's chunked
transfer) and ``GetActions`` -- for a robot whose motors and cameras are the
checkpoint's own observation features (read from its ``config.json``), with
random frames.  It prints each answered chunk::

    python examples/lerobot_grpc_client.py 127.0.0.1:8080 --checkpoint /tmp/smolvla
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np


def robot_of(config: dict[str, Any]) -> tuple[dict[str, Any], list[str], dict[str, tuple[int, int, int]]]:
    """The hardware features (LeRobot's robot.observation_features) a robot matching ``config`` reports."""
    inputs = config["input_features"]
    motors = [f"joint{i}.pos" for i in range(inputs["observation.state"]["shape"][0])]
    cameras = {
        key.removeprefix("observation.images."): (f["shape"][1], f["shape"][2], f["shape"][0])
        for key, f in inputs.items()
        if key.startswith("observation.images.")
    }
    return {**dict.fromkeys(motors, float), **cameras}, motors, cameras


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("address", help="HOST:PORT of the server's --lerobot-grpc-port")
    p.add_argument("--checkpoint", required=True, help="the served LeRobot checkpoint (its config.json)")
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--actions-per-chunk", type=int, default=None, help="default: the checkpoint's chunk")
    p.add_argument("--task", default="pick up the cube")
    args = p.parse_args()

    os.chdir(tempfile.mkdtemp(prefix="lerobot-client-"))  # LeRobot's async_inference opens logs under ./logs
    from lerobot.async_inference.helpers import RemotePolicyConfig, TimedObservation
    from lerobot.transport import services_pb2, services_pb2_grpc
    from lerobot.transport.utils import grpc_channel_options, send_bytes_in_chunks
    from lerobot.utils.feature_utils import hw_to_dataset_features

    config = json.loads((Path(args.checkpoint) / "config.json").read_text())
    hardware, motors, cameras = robot_of(config)
    chunk = args.actions_per_chunk or int(config.get("n_action_steps") or config["chunk_size"])
    stub = services_pb2_grpc.AsyncInferenceStub(grpc.insecure_channel(args.address, grpc_channel_options()))
    stub.Ready(services_pb2.Empty())
    instructions = RemotePolicyConfig(
        config["type"], args.checkpoint, hw_to_dataset_features(hardware, "observation"), chunk
    )
    stub.SendPolicyInstructions(services_pb2.PolicySetup(data=pickle.dumps(instructions)))
    rng = np.random.default_rng(0)
    for step in range(0, args.requests * chunk, chunk):
        raw: dict[str, Any] = {m: float(v) for m, v in zip(motors, rng.standard_normal(len(motors)), strict=True)}
        raw.update({name: rng.integers(0, 256, shape, dtype=np.uint8) for name, shape in cameras.items()})
        raw["task"] = args.task
        obs = TimedObservation(timestamp=time.time(), timestep=step, observation=raw, must_go=True)
        stub.SendObservations(send_bytes_in_chunks(pickle.dumps(obs), services_pb2.Observation))
        actions = pickle.loads(stub.GetActions(services_pb2.Empty(), timeout=60).data)
        first = actions[0].get_action().numpy()
        print(
            f"timesteps {actions[0].get_timestep()}..{actions[-1].get_timestep()}: {len(actions)} actions of "
            f"{first.shape[0]}, first {np.array2string(first, precision=3)}",
            flush=True,
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
