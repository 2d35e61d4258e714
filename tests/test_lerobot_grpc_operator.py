"""spec.service.lerobotGrpcPort on the operator's side: the flag, the container port, the Service port, the status.

The runtime's side (the service itself) is tests/test_lerobot_grpc.py; the CRD's two rules (a LeRobot policy
only, a port of its own) are docs/crd.md's refused examples, which tests/test_crd.py runs.
"""

from __future__ import annotations

from typing import Any

import pytest

from policy_operator.constants import LEROBOT_GRPC_PORT_NAME, PORT_NAME
from policy_operator.operator import manifests as M
from policy_operator.operator.spec import SpecError, parse_spec
from policy_operator.serve_flags import LEROBOT_GRPC_PORT_FLAG

SMOLVLA = {
    "image": "ghcr.io/policy-operator/policy-server:0.1.0",
    "checkpoint": {"source": "hf://lerobot/smolvla_base"},
    "policy": {"type": "lerobot"},
}


def spec_with(service: dict[str, Any], **more: Any) -> Any:
    return parse_spec({**SMOLVLA, "service": service, **more}, name="arm", namespace="robots")


def test_the_grpc_port_reaches_the_command_the_container_and_the_service() -> None:
    spec = spec_with({"port": 8000, "lerobotGrpcPort": 8080})
    sts = M.build_statefulset(spec)
    (server,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == M.SERVER_CONTAINER]
    command = server["command"]
    assert command[command.index(LEROBOT_GRPC_PORT_FLAG) + 1] == "8080"
    assert {(p["name"], p["containerPort"]) for p in server["ports"]} == {
        (PORT_NAME, 8000),
        (LEROBOT_GRPC_PORT_NAME, 8080),
    }
    for service in (M.build_service(spec), M.build_headless_service(spec)):
        ports = {p["name"]: p for p in service["spec"]["ports"]}
        assert ports[LEROBOT_GRPC_PORT_NAME]["port"] == 8080
        assert ports[LEROBOT_GRPC_PORT_NAME]["targetPort"] == LEROBOT_GRPC_PORT_NAME
        assert ports[LEROBOT_GRPC_PORT_NAME]["appProtocol"] == "grpc"
    assert M.lerobot_grpc_endpoint(spec) == "arm.robots.svc:8080"  # robot_client's --server_address


def test_without_the_field_nothing_changes() -> None:
    spec = spec_with({"port": 8000})
    sts = M.build_statefulset(spec)
    (server,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == M.SERVER_CONTAINER]
    assert LEROBOT_GRPC_PORT_FLAG not in server["command"]
    assert [p["name"] for p in server["ports"]] == [PORT_NAME]
    assert [p["name"] for p in M.build_service(spec)["spec"]["ports"]] == [PORT_NAME]
    assert M.lerobot_grpc_endpoint(spec) is None


@pytest.mark.parametrize(
    ("service", "more", "words"),
    [
        ({"port": 8000, "lerobotGrpcPort": 8000}, {}, "must differ from service.port"),
        ({"lerobotGrpcPort": 8080}, {"policy": {"type": "reference"}}, "needs policy.type lerobot"),
    ],
)
def test_the_model_refuses_what_the_runtime_would(service: dict[str, Any], more: dict[str, Any], words: str) -> None:
    with pytest.raises(SpecError, match=words):
        spec_with(service, **more)


def test_extra_args_may_not_set_the_port() -> None:
    with pytest.raises(SpecError, match="lerobot-grpc-port"):
        spec_with({"port": 8000}, runtime={"extraArgs": ["--lerobot-grpc-port=9000"]})
