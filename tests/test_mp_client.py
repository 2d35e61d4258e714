"""The front-end process's engine client (``serving/mp_client.py``) against a channel and ring of its own: what
its ``/readyz`` says of the pod's requests in flight."""

from __future__ import annotations

import asyncio
import socket

import numpy as np
import torch

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import Readiness
from policy_operator.runtime import ipc
from policy_operator.runtime.engine_api import AdmissionSpec, PreparedRequest
from policy_operator.runtime.policy.interface import Sample
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcSupport
from policy_operator.runtime.serving.metrics import ServerMetrics
from policy_operator.runtime.serving.mp_client import MPClient
from policy_operator.runtime.serving.server import ServerConfig


def test_in_flight_is_this_front_ends_requests_and_the_pods_others() -> None:
    """Its own requests it counts itself (fresher than a snapshot); the pod's others -- the LeRobot gRPC port's,
    other front-ends' -- come with the snapshot (a gRPC request in flight was missing under --frontend process)."""
    layout = ParallelLayout()
    config = ipc.FrontendConfig(
        ServerConfig("127.0.0.1", 0, 1 << 16, "dict", None), layout, 0.5, 30.0, "asyncio", 5.0, "info"
    )

    async def scenario() -> list[int]:
        ours, theirs = socket.socketpair()
        ring = ipc.SlotRing(ipc.create_ring_fd(config.slots, config.slot_bytes), config.slots, config.slot_bytes)
        client = MPClient(ipc.Channel(ours), ring, config, ServerMetrics(layout), lambda: 0)
        client.on_message(ipc.Attached(AdmissionSpec({}, None, RtcSupport("off", 1), (2, 2))))
        readiness = Readiness(ready=True, world_size=1, ranks_ready=1, ranks=[], in_flight=3)
        client.on_message(ipc.Snapshot(readiness, True, elsewhere=2))  # 3 in the engine, 1 of them this link's
        seen = [client.readiness().in_flight]
        answer = client.submit(PreparedRequest(Sample({"x": torch.zeros(1, 2)}), None, 1, None))
        seen.append(client.readiness().in_flight)
        assert not answer.done(), "sent to the model process, not answered"
        client.on_message(ipc.Answer(0, Result(np.zeros((2, 2), np.float32))))  # the model process's answer
        await asyncio.sleep(0)  # the answered future's callbacks
        assert answer.done()
        seen.append(client.readiness().in_flight)
        theirs.close()
        ours.close()
        return seen

    assert asyncio.run(scenario()) == [2, 3, 2]
