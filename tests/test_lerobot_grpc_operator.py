"""--lerobot-grpc-port / spec.service.lerobotGrpcPort outside the service: the flag's checks, the container port,
the Service port, the status.

The runtime's side (the service itself) is tests/test_lerobot_grpc.py; the CRD's two rules (a LeRobot policy
only, a port of its own) are docs/crd.md's refused examples, which tests/test_crd.py runs.
"""

from __future__ import annotations

import socket
from typing import Any

import pytest

from policy_operator.constants import LEROBOT_GRPC_PORT_NAME, PORT_NAME
from policy_operator.operator import manifests as M
from policy_operator.operator.spec import SpecError, parse_spec
from policy_operator.runtime.worker import check_port
from policy_operator.serve_flags import LEROBOT_GRPC_PORT_FLAG, check_values
from tests.support.serve_options import parse_serve

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


@pytest.mark.parametrize(
    ("flags", "words"),
    [
        (["--lerobot-grpc-port", "8080"], "needs --policy lerobot, got --policy reference"),
        (["--policy", "lerobot", "--port", "8000", "--lerobot-grpc-port", "8000"], "must differ from --port"),
        (["--policy", "lerobot", "--lerobot-grpc-port", "70000"], r"must be in 0\.\.65535"),
    ],
)
def test_serve_refuses_a_grpc_port_it_cannot_serve(flags: list[str], words: str) -> None:
    with pytest.raises(ValueError, match=f"{LEROBOT_GRPC_PORT_FLAG}.*{words}"):
        check_values(parse_serve(["--checkpoint", "/models/k", *flags]))
    check_values(parse_serve(["--checkpoint", "/models/k", "--policy", "lerobot", "--lerobot-grpc-port", "0"]))


def test_a_taken_grpc_port_is_refused_before_any_rank_starts() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ValueError, match=f"{LEROBOT_GRPC_PORT_FLAG} {port}: 127.0.0.1:{port} is already in use"):
            check_port("127.0.0.1", port, LEROBOT_GRPC_PORT_FLAG)
