"""examples/: every file is a PolicyServer the CRD admits, and every hub repository it names exists.

A new user's first ``kubectl apply`` of an example must neither be refused nor
download something that is not there: each ``hf://`` source is a row of
``policy_operator.public_checkpoints`` (the one documented list, rendered
into docs/examples.md), gated ones carry ``checkpoint.secretRef``, and each
served LeRobot family has an example with the gRPC port for LeRobot's
robot_client and the robot-side commands in its comments.  The ``cluster``
test hands all of them to the real apiserver in one server-side dry run.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from policy_operator import constants as C
from policy_operator.builtin_policies import LEROBOT
from policy_operator.operator.spec import parse_spec
from policy_operator.public_checkpoints import PUBLIC_CHECKPOINTS, render_table
from policy_operator.source_uri import HF_SCHEME
from tests.support.net import wait_for

REPO = Path(__file__).resolve().parents[1]
EXAMPLE_FILES = sorted((REPO / "examples").glob("*.yaml"))
DOC = REPO / "docs" / "examples.md"
SERVED_FAMILIES = ("smolvla", "pi05", "pi0", "diffusion")  # issue 41: an example for each family served


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def policyservers() -> list[tuple[Path, dict[str, Any]]]:
    return [(p, d) for p in EXAMPLE_FILES for d in documents(p) if d.get("kind") == C.KIND]


def test_every_example_file_holds_policyservers_only() -> None:
    assert len(EXAMPLE_FILES) >= 8
    for path in EXAMPLE_FILES:
        docs = documents(path)
        assert docs and all(d.get("apiVersion") == C.API_VERSION and d.get("kind") == C.KIND for d in docs), path


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_passes_the_crds_model(path: Path) -> None:
    """The typed model the CRD is generated from, its CEL rules included (a refused field names itself)."""
    for doc in documents(path):
        spec = parse_spec(doc["spec"], name=doc["metadata"]["name"], namespace="default")
        assert spec.image.startswith("ghcr.io/policy-operator/")


@pytest.mark.parametrize("path", EXAMPLE_FILES, ids=lambda p: p.name)
def test_example_server_command_passes_serves_own_checks(path: Path) -> None:
    """The command the operator writes into the pods (managed flags, the GPU defaults, extraArgs) parses and
    passes ``serve``'s value checks: an extraArg the CRD admits but serve refuses (e.g. batch buckets that do
    not end at the spec's maxBatch) would crash-loop every pod."""
    from policy_operator import cli, serve_flags
    from policy_operator.operator import manifests

    for doc in documents(path):
        spec = parse_spec(doc["spec"], name=doc["metadata"]["name"], namespace="default")
        command = manifests.worker_command(spec, manifests.ServingCheckpoint.of(spec))
        args = cli.build_parser().parse_args(command[1:])  # `serve ...`, as the pod's policyserver parses it
        serve_flags.check_values(serve_flags.ServeOptions.from_args(args))


def test_every_hub_source_is_a_documented_public_repository() -> None:
    hub = [(p, d) for p, d in policyservers() if d["spec"]["checkpoint"]["source"].startswith(HF_SCHEME)]
    assert hub
    for path, doc in hub:
        repo = doc["spec"]["checkpoint"]["source"].removeprefix(HF_SCHEME).split("@")[0]
        assert repo in PUBLIC_CHECKPOINTS, f"{path.name}: {repo} is not in policy_operator/public_checkpoints.py"
        row = PUBLIC_CHECKPOINTS[repo]
        spec = doc["spec"]
        assert spec["policy"]["type"] == LEROBOT, path.name
        if row.gated:  # the fetch Job needs a token of an account that accepted the gated repository's licence
            assert spec["checkpoint"]["secretRef"]["name"], path.name
            assert "kubectl create secret generic" in path.read_text(), path.name
        else:
            assert "secretRef" not in spec["checkpoint"], path.name


def test_each_served_family_has_a_fast_gpu_example_with_both_robot_sides() -> None:
    by_type = {}
    for path, doc in policyservers():
        source = doc["spec"]["checkpoint"]["source"]
        if source.startswith(HF_SCHEME):
            by_type[PUBLIC_CHECKPOINTS[source.removeprefix(HF_SCHEME)].lerobot_type] = (path, doc)
    assert set(SERVED_FAMILIES) <= set(by_type)
    for family in SERVED_FAMILIES:
        path, doc = by_type[family]
        spec, text = doc["spec"], path.read_text()
        parsed = parse_spec(spec, name=doc["metadata"]["name"], namespace="default")
        assert parsed.runtime.device == "cuda" and parsed.gpus_per_pod >= 1, path.name
        assert any(t.get("key") == "nvidia.com/gpu" for t in spec["tolerations"]), path.name
        assert any(a.startswith("--compile") for a in parsed.runtime.extra_args), path.name
        assert parsed.runtime.batching.max_batch > 1 and parsed.runtime.batching.latency_budget_ms, path.name
        if family != "diffusion":
            assert "--dtype=bfloat16" in parsed.runtime.extra_args, path.name
        assert parsed.service.lerobot_grpc_port is not None, path.name
        name = doc["metadata"]["name"]
        assert f"policyserver client --url ws://{name}.default.svc:{parsed.service.port}" in text, path.name
        assert f"lerobot.async_inference.robot_client --server_address={name}.default.svc:" in text, path.name
        assert f"--policy_type={family} " in text, path.name
        assert f"kubectl apply -f examples/{path.name}" in text, path.name


def _robot_client_commands() -> list[tuple[str, str]]:
    """(file, command) of every ``lerobot.async_inference.robot_client`` command in examples/ and the README, its
    comment lines and backslash continuations joined."""
    found = []
    for path in [*EXAMPLE_FILES, REPO / "README.md"]:
        text = "\n".join(line.lstrip("# ").rstrip() for line in path.read_text().splitlines())
        text = text.replace("\\\n", " ")
        for line in text.splitlines():
            if "lerobot.async_inference.robot_client" in line:
                found.append((path.name, line[line.index("lerobot.async_inference.robot_client") :]))
    return found


def test_every_robot_client_command_names_only_lerobots_own_options() -> None:
    """The robot-side commands are LeRobot's RobotClientConfig: every ``--name`` (or ``--name.field``) a file
    gives is one of its fields, and ``--robot.type`` a robot it knows, so a copied command is not refused by
    LeRobot's parser."""
    # the robot types robot_client registers, imported as it imports them: importing robot_client itself would
    # also start its file log under ./logs for the rest of this process
    from lerobot.async_inference.configs import RobotClientConfig
    from lerobot.robots import bi_so_follower, koch_follower, omx_follower, so_follower  # noqa: F401
    from lerobot.robots.config import RobotConfig

    fields = {f.name for f in dataclasses.fields(RobotClientConfig)}
    robots = set(RobotConfig.get_known_choices())
    commands = _robot_client_commands()
    assert {name for name, _ in commands} >= {p.name for p, d in policyservers() if "lerobot" in json.dumps(d)} - {
        "lerobot-lingbot-va-base.yaml"  # WebSocket only: its comment says why
    }, commands
    for name, command in commands:
        given = {a[2:].split("=", 1)[0].split(".", 1)[0] for a in command.split() if a.startswith("--")}
        assert given and given <= fields, (name, sorted(given - fields), command)
        robot = next((a.split("=", 1)[1] for a in command.split() if a.startswith("--robot.type=")), None)
        assert robot is None or robot.rstrip("`") == "..." or robot in robots, (name, robot, sorted(robots))


def test_the_cfg_family_example_serves_the_layout_measured_on_one_gpu() -> None:
    """LingBot-VA as bench/results/lerobot-cfg-h100.md measured it: bfloat16, eager (the GPU defaults' compile
    never ran on it), both CFG branches in one forward, the checkpoint's guidance, 8 robots, one GPU; its
    sessions (keyframes) over the WebSocket only, and the two-GPU layout its comment names admitted as written."""
    from policy_operator import cli
    from policy_operator.operator import manifests

    path = REPO / "examples" / "lerobot-lingbot-va-base.yaml"
    (doc,) = documents(path)
    name, text = doc["metadata"]["name"], path.read_text()
    spec = parse_spec(doc["spec"], name=name, namespace="default")
    assert PUBLIC_CHECKPOINTS[doc["spec"]["checkpoint"]["source"].removeprefix(HF_SCHEME)].lerobot_type == "lingbot_va"
    assert spec.policy.family == "lingbot_va" and spec.gpus_per_pod == 1 and spec.service.lerobot_grpc_port is None
    command = manifests.worker_command(spec, manifests.ServingCheckpoint.of(spec))
    args = cli.build_parser().parse_args(command[1:])
    served = (args.dtype, args.compile, args.cfg_mode, args.guidance, args.max_batch, args.cfgp, args.dp)
    assert served == ("bfloat16", None, "batched", None, 8, 1, 1)
    assert "reduce-overhead" not in command
    assert f"policyserver client --url ws://{name}.default.svc:{spec.service.port}" in text
    assert all(word in text for word in ("session_id", "keyframes", "no_session_state", "parallelism: {cfgp: 2}"))
    two_gpus = doc["spec"] | {"parallelism": {"cfgp": 2, "dp": 1}}
    assert parse_spec(two_gpus, name=name, namespace="default").gpus_per_pod == 2


def test_docs_show_the_public_repositories_as_the_module_lists_them() -> None:
    assert render_table() in DOC.read_text(), (
        "docs/examples.md is stale: .venv/bin/python -m policy_operator.public_checkpoints docs/examples.md"
    )
    for path in EXAMPLE_FILES:
        assert f"examples/{path.name}" in DOC.read_text(), path.name


@pytest.mark.cluster
def test_every_example_passes_admission_on_the_real_control_plane(control_plane: Any) -> None:
    """All example files in one server-side dry run: the apiserver's schema, defaulting and CEL rules (nothing is
    created, so no Secret or node is needed)."""
    crd = REPO / "crds" / "policyservers.yaml"
    control_plane.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(crd))

    def established() -> bool:
        stored = json.loads(control_plane.kubectl("get", f"crd/{C.PLURAL}.{C.GROUP}", "-o", "json").stdout)
        return any(
            c["type"] == "Established" and c["status"] == "True"
            for c in stored.get("status", {}).get("conditions") or []
        )

    wait_for(established, 60, interval=0.5, what="the CRD Established")
    control_plane.create_namespace("examples-dry-run")
    try:
        args = [arg for path in EXAMPLE_FILES for arg in ("-f", str(path))]
        result = control_plane.kubectl("apply", "-n", "examples-dry-run", "--dry-run=server", "--server-side", *args)
        applied = [line for line in result.stdout.splitlines() if "serverside-applied" in line]
        assert len(applied) == len(policyservers()), result.stdout
    finally:
        control_plane.kubectl(
            "delete", "namespace", "examples-dry-run", "--wait=false", "--ignore-not-found", check=False
        )
