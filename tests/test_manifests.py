"""Manifest builders: every spec variant yields objects the Kubernetes schemas accept, calling the runtime's CLIs right.

Each built object goes through kubernetes-validate in strict mode (unknown
fields are errors) for a current Kubernetes version, and the commands written
into the pods are parsed by the runtime's own argument parsers, so a flag the
runtime does not know fails here rather than in a crash-looping pod.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes.client import V1Service

from policy_operator import constants as C
from policy_operator import serve_flags
from policy_operator.operator import manifests as M
from policy_operator.operator.spec import COMPILE_KEY_DIR, PolicyServerSpec, SpecError, parse_spec
from policy_operator.source_uri import checkpoint_key, request_key
from tests.support.api_objects import api_object
from tests.support.serve_options import parse_serve

REPO = Path(__file__).resolve().parents[1]
K8S_VERSIONS = ("1.32.0", "1.37.0")


def spec_of(obj: dict[str, Any], namespace: str = "robots") -> PolicyServerSpec:
    return parse_spec(obj["spec"], name=obj["metadata"]["name"], namespace=namespace)


def base(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"image": "registry.example/policy:1", "checkpoint": {"source": "hf://org/policy"}}
    spec.update(overrides)
    return {"metadata": {"name": "ps"}, "spec": spec}


EXAMPLES = {p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("policyserver-*.yaml"))}
VARIANTS = {
    **EXAMPLES,
    "auth-and-http-token": base(
        checkpoint={"source": "https://host/ckpt/", "secretRef": {"name": "tok", "key": "t"}},
        auth={"secretRef": {"name": "clients"}},
    ),
    "existing-claim": base(storage={"existingClaim": "shared-models"}, replicas=3),
    "retained-rwop": base(
        storage={"mode": "perPod", "retainOnDelete": True, "accessModes": ["ReadWriteOncePod"], "size": "5Gi"}
    ),
    "cpu-device": base(
        runtime={
            "device": "cpu",
            "guidance": 1.0,
            "steps": 4,
            "extraArgs": ["--threads", "2"],
            "env": [{"name": "OMP_NUM_THREADS", "value": "2"}],
        }
    ),
    "nodeport-revision": base(
        checkpoint={
            "source": "hf://org/policy",
            "revision": "v2",
            "secretRef": {"name": "hf"},
            "fetchJob": {"activeDeadlineSeconds": 900, "resources": {"limits": {"memory": "2Gi"}}},
        },
        service={"type": "NodePort", "port": 9000, "annotations": {"a": "b"}},
        imagePullSecrets=[{"name": "regcred"}],
        priorityClassName="robots",
        serviceAccountName="policy",
        affinity={
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [{"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}]
                }
            }
        },
    ),
    "scaled-to-zero": base(replicas=0, parallelism={"cfgp": 2, "dp": 4}),
    "lerobot-per-pod": base(
        policy={"type": "lerobot"},
        storage={"mode": "perPod"},
        runtime={"env": [{"name": "LEROBOT_LOG_LEVEL", "value": "debug"}]},
    ),
    "import": base(policy={"type": "import", "importPath": "my_robot.policies:Mine"}, runtime={"guidance": 2.0}),
}


def built(spec: PolicyServerSpec) -> list[dict[str, Any]]:
    return [
        M.build_pvc(spec),
        M.build_fetch_job(spec),
        M.build_statefulset(spec),
        M.build_service(spec),
        M.build_headless_service(spec),
    ]


@pytest.mark.parametrize("variant", sorted(VARIANTS))
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_passes_the_kubernetes_schema(variant: str, version: str) -> None:
    for obj in built(spec_of(VARIANTS[variant])):
        kubernetes_validate.validate(obj, version, strict=True)


def test_the_validator_does_reject_unknown_fields() -> None:
    sts = M.build_statefulset(spec_of(base()))
    sts["spec"]["template"]["spec"]["containers"][0]["gpuCount"] = 2
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(sts, K8S_VERSIONS[0], strict=True)


# --- names and labels -------------------------------------------------------------------


def test_names_are_deterministic_and_fit_label_values() -> None:
    longest = base()
    longest["metadata"]["name"] = "p" + "x" * 39
    spec = spec_of(longest)
    for obj in built(spec):
        assert len(obj["metadata"]["name"]) <= 63
        assert obj["metadata"]["namespace"] == "robots"
        assert obj["metadata"]["labels"][C.LABEL_MANAGED_BY] == C.MANAGED_BY
        assert obj["metadata"]["labels"][C.LABEL_INSTANCE] == spec.name
    assert built(spec) == built(spec_of(longest))


def test_selector_is_stable_and_matches_the_template() -> None:
    sts = M.build_statefulset(spec_of(base()))
    selector = sts["spec"]["selector"]["matchLabels"]
    template_labels = sts["spec"]["template"]["metadata"]["labels"]
    assert selector.items() <= template_labels.items()
    assert C.LABEL_CHECKPOINT_KEY not in selector  # the key changes with the checkpoint; selectors are immutable
    other = M.build_statefulset(spec_of(base(checkpoint={"source": "s3://b/p/"}, image="other:2")))
    assert other["spec"]["selector"] == sts["spec"]["selector"]
    assert M.selector_string("ps") == ",".join(f"{k}={v}" for k, v in selector.items())
    svc = M.build_service(spec_of(base()))
    assert svc["spec"]["selector"] == selector


# --- PVC ----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("replicas", "modes", "expected"),
    [
        (1, None, ["ReadWriteOnce"]),
        (2, None, ["ReadWriteMany"]),
        (0, None, ["ReadWriteOnce"]),
        (3, ["ReadOnlyMany"], ["ReadOnlyMany"]),
    ],
)
def test_pvc_access_modes(replicas: int, modes: list[str] | None, expected: list[str]) -> None:
    storage = {"size": "30Gi", **({"accessModes": modes} if modes else {})}
    pvc = M.build_pvc(spec_of(base(replicas=replicas, storage=storage)))
    assert pvc["spec"]["accessModes"] == expected
    assert pvc["spec"]["resources"]["requests"]["storage"] == "30Gi"
    assert "storageClassName" not in pvc["spec"]


def test_existing_claim_is_mounted_instead_of_the_pvc() -> None:
    spec = spec_of(base(storage={"existingClaim": "shared-models"}))
    job, sts = M.build_fetch_job(spec), M.build_statefulset(spec)
    claims = [
        v["persistentVolumeClaim"]["claimName"]
        for obj in (job, sts)
        for v in obj["spec"]["template"]["spec"]["volumes"]
        if "persistentVolumeClaim" in v
    ]
    assert claims == ["shared-models", "shared-models"]


# --- fetch Job -------------------------------------------------------------------------------


def _fetch_parser() -> argparse.ArgumentParser:
    from policy_operator.runtime.checkpoint import fetch

    parser = argparse.ArgumentParser()
    fetch.add_arguments(parser)
    return parser


def test_fetch_job_runs_the_fetch_cli_contract() -> None:
    spec = spec_of(
        base(
            checkpoint={
                "source": "hf://org/policy",
                "revision": "v2",
                "secretRef": {"name": "hf-token"},
                "sha256": {"model.safetensors": "B" * 64, "config.json": "a" * 64},
            }
        )
    )
    job = M.build_fetch_job(spec)
    key = checkpoint_key("hf://org/policy", "v2")
    assert job["metadata"]["name"] == f"ps-fetch-{key}"
    assert job["metadata"]["labels"][C.LABEL_CHECKPOINT_KEY] == key
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["command"] == [
        "policyserver",
        "fetch",
        "hf://org/policy",
        C.CACHE_MOUNT_PATH,
        "--revision",
        "v2",
        "--sha256",
        f"config.json={'a' * 64}",
        "--sha256",
        f"model.safetensors={'b' * 64}",
        "--token-file",
        f"{C.CHECKPOINT_TOKEN_DIR}/token",
        "--progress-port",
        str(C.FETCH_PROGRESS_PORT),
    ]
    args = _fetch_parser().parse_args(container["command"][2:])
    assert (args.source, args.dest, args.revision) == ("hf://org/policy", C.CACHE_MOUNT_PATH, "v2")
    assert args.progress_port == C.FETCH_PROGRESS_PORT
    # the Secrets the template names, declared for the chart's admission policy
    assert job["metadata"]["annotations"][C.ANNOTATION_SECRETS] == "hf-token"
    env = {e["name"]: e for e in container["env"]}
    assert env[C.ENV_HF_TOKEN]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    secret = next(v for v in pod["volumes"] if "secret" in v)["secret"]
    assert secret["secretName"] == "hf-token" and secret["items"] == [{"key": "token", "path": "token"}]
    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == C.CHECKPOINT_TOKEN_DIR)
    assert mount["readOnly"] is True
    assert {m["mountPath"] for m in container["volumeMounts"]} >= {C.CACHE_MOUNT_PATH, "/tmp"}
    assert pod["restartPolicy"] == "Never"
    assert job["spec"]["backoffLimit"] == 3 and job["spec"]["ttlSecondsAfterFinished"] == 3600
    rule = job["spec"]["podFailurePolicy"]["rules"][0]
    assert rule["action"] == "FailJob" and rule["onExitCodes"]["values"] == [2, 4, 5, 6]


def test_fetch_job_key_follows_the_fetch_cli_for_inline_revisions() -> None:
    """hf://repo@rev and hf://repo + revision are one checkpoint: one key, one Job, one directory."""
    inline = spec_of(base(checkpoint={"source": "hf://org/policy@v2"}))
    split = spec_of(base(checkpoint={"source": "hf://org/policy", "revision": "v2"}))
    assert inline.checkpoint.key == split.checkpoint.key == request_key("hf://org/policy@v2")
    assert M.build_fetch_job(inline)["metadata"]["name"] == M.build_fetch_job(split)["metadata"]["name"]


def test_token_for_other_schemes_is_a_file_only() -> None:
    job = M.build_fetch_job(spec_of(base(checkpoint={"source": "https://h/c/", "secretRef": {"name": "t"}})))
    container = job["spec"]["template"]["spec"]["containers"][0]
    assert C.ENV_HF_TOKEN not in {e["name"] for e in container["env"]}
    assert container["command"][-4:-2] == ["--token-file", f"{C.CHECKPOINT_TOKEN_DIR}/token"]
    no_secret = M.build_fetch_job(spec_of(base()))["spec"]["template"]["spec"]["containers"][0]
    assert "--token-file" not in no_secret["command"]


def test_job_name_changes_with_the_checkpoint_only() -> None:
    name = M.build_fetch_job(spec_of(base()))["metadata"]["name"]
    same = [base(image="new:2"), base(runtime={"steps": 50}), base(replicas=4), base(parallelism={"cfgp": 2})]
    assert {M.build_fetch_job(spec_of(o))["metadata"]["name"] for o in same} == {name}
    changed = [
        base(checkpoint={"source": "hf://org/policy", "revision": "v3"}),
        base(checkpoint={"source": "hf://org/other"}),
    ]
    names = {M.build_fetch_job(spec_of(o))["metadata"]["name"] for o in changed}
    assert len(names) == 2 and name not in names


def test_pods_run_as_non_root_with_read_only_root() -> None:
    spec = spec_of(base(auth={"secretRef": {"name": "clients"}}))
    for obj in (M.build_fetch_job(spec), M.build_statefulset(spec)):
        pod = obj["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] != 0
        assert pod["automountServiceAccountToken"] is False
        for container in pod["containers"] + pod.get("initContainers", []):
            sc = container["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
            assert sc["capabilities"] == {"drop": ["ALL"]}
            assert any(m["mountPath"] == "/tmp" for m in container["volumeMounts"])
            assert {"name": C.ENV_HOME, "value": "/tmp"} in container["env"]


# --- StatefulSet ---------------------------------------------------------------------------


def _server(sts: dict[str, Any]) -> dict[str, Any]:
    return sts["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize(("cfgp", "dp"), [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_gpus_and_command_follow_the_layout(cfgp: int, dp: int) -> None:
    spec = spec_of(
        base(
            parallelism={"cfgp": cfgp, "dp": dp},
            runtime={"guidance": 2.5, "steps": 8},
            resources={"requests": {"cpu": "4", "memory": "16Gi"}, "limits": {"memory": "32Gi"}},
        )
    )
    server = _server(M.build_statefulset(spec))
    gpus = str(cfgp * dp)
    assert server["resources"]["limits"] == {"memory": "32Gi", C.GPU_RESOURCE: gpus}
    assert server["resources"]["requests"] == {"cpu": "4", "memory": "16Gi", C.GPU_RESOURCE: gpus}
    path = f"{C.CACHE_MOUNT_PATH}/{spec.checkpoint.key}"
    assert server["command"] == [
        "policyserver",
        "serve",
        "--checkpoint",
        path,
        "--policy",
        "reference",
        "--port",
        "8000",
        "--cfgp",
        str(cfgp),
        "--dp",
        str(dp),
        "--guidance",
        "2.5",
        "--steps",
        "8",
        "--max-batch",
        "8",
        "--batch-window-ms",
        "2.0",  # the defaults, always written: extraArgs may not set them
        "--max-connections",
        "512",
        "--device",
        "cuda",
        "--drain-grace-s",
        "20",
        "--compile-cache-dir",
        C.COMPILE_CACHE_MOUNT_PATH,
        serve_flags.COMPILE_KEY_FLAG,
        f"{COMPILE_KEY_DIR}/{M.TOKEN_FILE}",
    ]


def test_worker_command_is_the_runtimes_own() -> None:
    """``policyserver serve`` (which runs torchrun as its child) with flags its parser accepts."""
    spec = spec_of(
        base(
            parallelism={"cfgp": 2, "dp": 2},
            auth={"secretRef": {"name": "c"}},
            runtime={"guidance": 4.0, "extraArgs": ["--heartbeat-s", "0.5", "--dtype=bfloat16"]},
        )
    )
    command = _server(M.build_statefulset(spec))["command"]
    worker_args = command[2:]
    assert command == serve_flags.serve_argv(worker_args)
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    args = parser.parse_args(worker_args)
    assert (args.cfgp, args.dp, args.guidance, args.steps, args.port) == (2, 2, 4.0, None, 8000)  # steps: the policy's
    assert args.auth_token_file == f"{C.AUTH_TOKEN_DIR}/token"
    assert (args.heartbeat_s, args.dtype, args.drain_grace_s, args.device) == (0.5, "bfloat16", 20.0, "cuda")
    assert (args.max_batch, args.batch_window_ms) == (
        serve_flags.DEFAULT_MAX_BATCH,
        serve_flags.DEFAULT_BATCH_WINDOW_MS,
    )


@pytest.mark.parametrize(
    ("batching", "flags"),
    [
        ({"maxBatch": 1}, ["--max-batch", "1", "--batch-window-ms", "2.0"]),
        ({"maxBatch": 32, "windowMs": 0.5}, ["--max-batch", "32", "--batch-window-ms", "0.5"]),
        ({"windowMs": 2}, ["--max-batch", "8", "--batch-window-ms", "2.0"]),  # the apiserver's integer 2
        ({"windowMs": 0}, ["--max-batch", "8", "--batch-window-ms", "0.0"]),
    ],
)
def test_batching_flows_into_the_command(batching: dict[str, Any], flags: list[str]) -> None:
    spec = spec_of(base(runtime={"batching": batching, "extraArgs": ["--threads", "2"]}))
    command = _server(M.build_statefulset(spec))["command"]
    at = command.index("--max-batch")
    assert command[at : at + 4] == flags and command[-2:] == ["--threads", "2"]
    opts = parse_serve(command[2:])
    serve_flags.check_values(opts)
    assert (opts.max_batch, opts.batch_window_ms) == (int(flags[1]), float(flags[3]))


def test_latency_budget_and_connection_cap_flow_into_the_command() -> None:
    spec = spec_of(base(runtime={"batching": {"latencyBudgetMs": 40}, "maxConnections": 64}))
    command = _server(M.build_statefulset(spec))["command"]
    at = command.index("--latency-budget-ms")
    assert command[at : at + 4] == ["--latency-budget-ms", "40.0", "--max-connections", "64"]
    opts = parse_serve(command[2:])
    serve_flags.check_values(opts)
    assert (opts.latency_budget_ms, opts.max_connections) == (40.0, 64)


def test_session_idle_timeout_flows_into_the_command_and_unset_writes_nothing() -> None:
    assert "--session-idle-timeout-s" not in _server(M.build_statefulset(spec_of(base())))["command"]
    spec = spec_of(base(runtime={"maxConnections": 16, "sessionIdleTimeoutSeconds": 45}))
    command = _server(M.build_statefulset(spec))["command"]
    at = command.index("--max-connections")
    assert command[at : at + 4] == ["--max-connections", "16", "--session-idle-timeout-s", "45"]
    opts = parse_serve(command[2:])
    serve_flags.check_values(opts)
    assert opts.session_idle_timeout_s == 45.0


def test_rtc_flows_into_the_command_and_off_writes_nothing() -> None:
    assert "--rtc" not in _server(M.build_statefulset(spec_of(base())))["command"]
    spec = spec_of(base(runtime={"rtc": {"mode": "guided", "maxInferenceDelay": 6}}))
    command = _server(M.build_statefulset(spec))["command"]
    at = command.index("--rtc")
    assert command[at : at + 4] == ["--rtc", "guided", "--rtc-max-delay", "6"]
    opts = parse_serve(command[2:])
    serve_flags.check_values(opts)
    assert (opts.rtc, opts.rtc_max_delay) == ("guided", 6)


def test_init_container_verifies_the_cache_with_the_checkpoint_cli() -> None:
    from policy_operator.runtime.checkpoint import cli as checkpoint_cli

    spec = spec_of(base())
    init = M.build_statefulset(spec)["spec"]["template"]["spec"]["initContainers"][0]
    assert init["command"] == ["policyserver", "checkpoint", "verify", spec.checkpoint.path, "--require-marker"]
    parser = argparse.ArgumentParser()
    checkpoint_cli.add_arguments(parser)
    args = parser.parse_args(init["command"][2:])
    assert args.directory == spec.checkpoint.path and args.require_marker is True
    assert all(m.get("readOnly") for m in init["volumeMounts"] if m["mountPath"] == C.CACHE_MOUNT_PATH)


def test_policy_type_flows_into_the_fetch_the_init_container_and_the_server() -> None:
    """lerobot: the fetch also fetches the hub repositories the checkpoint names, the init container checks them,
    and the server (as every server) loads offline from the cache's view of them."""
    from policy_operator.runtime.checkpoint import cli as checkpoint_cli

    for doc, policy, references in (
        (base(), "reference", False),
        (base(policy={"type": "lerobot"}), "lerobot", True),
        (base(policy={"type": "import", "importPath": "a.b:C"}), "a.b:C", False),
    ):
        spec = spec_of(doc)
        fetch = M.build_fetch_job(spec)["spec"]["template"]["spec"]["containers"][0]["command"]
        assert _fetch_parser().parse_args(fetch[2:]).references is references
        pod = M.build_statefulset(spec)["spec"]["template"]["spec"]
        parser = argparse.ArgumentParser()
        checkpoint_cli.add_arguments(parser)
        assert parser.parse_args(pod["initContainers"][0]["command"][2:]).references is references
        server = pod["containers"][0]
        assert server["command"][server["command"].index("--policy") + 1] == policy
        env = {e["name"]: e.get("value") for e in server["env"]}
        assert env[C.ENV_HF_HUB_OFFLINE] == "1" and env[C.ENV_HF_HUB_CACHE] == f"{C.CACHE_MOUNT_PATH}/{C.HUB_VIEW_DIR}"
        fetch_env = M.build_fetch_job(spec)["spec"]["template"]["spec"]["containers"][0]["env"]
        assert C.ENV_HF_HUB_OFFLINE not in {e["name"] for e in fetch_env}  # the fetch is the one that goes online
    per_pod = spec_of(base(policy={"type": "lerobot"}, storage={"mode": "perPod"}))
    init = M.build_statefulset(per_pod)["spec"]["template"]["spec"]["initContainers"]
    assert "--references" in init[0]["command"] and "--references" in init[-1]["command"]
    # the user may not set it (issue 39: HF_HUB_OFFLINE=0 sent the pods to the hub): a reserved name
    with pytest.raises(SpecError, match=r"spec\.runtime\.env\[0\]\.name: .*reserved"):
        spec_of(base(runtime={"env": [{"name": C.ENV_HF_HUB_OFFLINE, "value": "0"}]}))


def test_probes_lifecycle_and_volumes() -> None:
    spec = spec_of(base(resources={"shmSize": "8Gi"}, runtime={"startupTimeoutSeconds": 900}))
    sts = M.build_statefulset(spec)
    pod = sts["spec"]["template"]["spec"]
    server = _server(sts)
    assert server["readinessProbe"]["httpGet"] == {"path": C.READYZ_PATH, "port": C.PORT_NAME}
    assert server["livenessProbe"]["httpGet"] == {"path": C.HEALTHZ_PATH, "port": C.PORT_NAME}
    startup = server["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 900
    assert server["ports"] == [{"name": C.PORT_NAME, "containerPort": 8000, "protocol": "TCP"}]
    sleep = server["lifecycle"]["preStop"]["sleep"]["seconds"]
    # preStop, then the runtime drains, then torchrun's own 30 s SIGKILL window: the kubelet must wait longer
    assert pod["terminationGracePeriodSeconds"] > sleep + max(30, spec.runtime.drain_grace_seconds)
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes[M.VOL_SHM]["emptyDir"] == {"medium": "Memory", "sizeLimit": "8Gi"}
    assert "readOnly" not in volumes[M.VOL_CACHE]["persistentVolumeClaim"]  # the compile artifacts are written
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts[C.CACHE_MOUNT_PATH]["readOnly"] is True and "/dev/shm" in mounts  # the checkpoints are not
    assert mounts[C.COMPILE_CACHE_MOUNT_PATH] == {
        "name": M.VOL_CACHE,
        "mountPath": C.COMPILE_CACHE_MOUNT_PATH,
        "subPath": f"{C.COMPILE_CACHE_DIR}/{spec.name}",
    }
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    assert sts["spec"]["serviceName"] == M.Names("ps").headless_service


@pytest.mark.parametrize(
    ("storage", "cache_modes", "writable"),
    [
        ({}, None, True),
        ({"accessModes": ["ReadWriteMany"]}, None, True),
        ({"accessModes": ["ReadOnlyMany"]}, None, False),  # some CSI drivers attach it only as a read-only pod volume
        ({}, ["ReadOnlyMany"], False),  # an existing claim's own modes
        ({"accessModes": ["ReadOnlyMany", "ReadWriteMany"]}, None, True),
        ({"mode": "perPod"}, None, True),
    ],
)
def test_server_pods_write_compile_artifacts_where_the_cache_is_writable(
    storage: dict[str, Any], cache_modes: list[str] | None, writable: bool
) -> None:
    spec = spec_of(base(storage=storage, runtime={"extraArgs": ["--compile", "reduce-overhead"]}))
    pod = M.build_statefulset(spec, cache_modes=cache_modes)["spec"]["template"]["spec"]
    server = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts[C.CACHE_MOUNT_PATH]["readOnly"] is True  # the checkpoints, always
    assert (C.COMPILE_CACHE_MOUNT_PATH in mounts) is writable
    assert ("--compile-cache-dir" in server["command"]) is writable
    claims = [v["persistentVolumeClaim"] for v in pod["volumes"] if "persistentVolumeClaim" in v]
    assert all(claim.get("readOnly", False) is not writable for claim in claims)
    args = server["command"][2:]
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    assert parser.parse_args(args).compile_cache_dir == (C.COMPILE_CACHE_MOUNT_PATH if writable else None)


def test_frontend_flows_into_the_command_and_the_default_writes_nothing() -> None:
    """Left out (inline, one process) the command line is the one before the field existed: no rollout."""
    assert "--frontend" not in " ".join(_server(M.build_statefulset(spec_of(base())))["command"])
    spec = spec_of(base(runtime={"frontend": {"mode": "process", "processes": 4}, "maxConnections": 64}))
    command = _server(M.build_statefulset(spec))["command"]
    at = command.index("--frontend")
    assert command[at : at + 4] == ["--frontend", "process", "--frontend-processes", "4"]
    opts = parse_serve(command[2:])
    serve_flags.check_values(opts)
    assert (opts.frontend, opts.frontend_processes, opts.max_connections) == ("process", 4, 64)
    process_one = _server(M.build_statefulset(spec_of(base(runtime={"frontend": {"mode": "process"}}))))["command"]
    assert "--frontend-processes" not in process_one and "process" in process_one


def test_cpu_device_requests_no_gpu() -> None:
    sts = M.build_statefulset(spec_of(VARIANTS["cpu-device"]))
    server = _server(sts)
    assert C.GPU_RESOURCE not in str(server.get("resources"))
    assert server["command"][server["command"].index("--device") + 1] == "cpu"
    assert server["command"][-2:] == ["--threads", "2"]
    assert {"name": "OMP_NUM_THREADS", "value": "2"} in server["env"]


def test_template_hash_rolls_on_what_changes_the_pods_only() -> None:
    def hash_of(obj: dict[str, Any]) -> str:
        # the cache claim's modes as observed: a claim keeps those it was created with whatever replicas says
        sts = M.build_statefulset(spec_of(obj), cache_modes=("ReadWriteOnce",))
        return str(sts["metadata"]["annotations"][C.ANNOTATION_TEMPLATE_HASH])

    original = hash_of(base())
    assert hash_of(base()) == original
    assert hash_of(base(replicas=5)) == original  # scaling is not a rollout
    assert hash_of(base(storage={"retainOnDelete": True})) == original
    rolling = [
        base(image="registry.example/policy:2"),
        base(runtime={"steps": 20}),
        base(runtime={"env": [{"name": "X", "value": "1"}]}),
        base(checkpoint={"source": "hf://org/policy", "revision": "v9"}),
        base(parallelism={"cfgp": 1, "dp": 2}),
    ]
    hashes = [hash_of(o) for o in rolling]
    assert original not in hashes and len(set(hashes)) == len(hashes)
    sts = M.build_statefulset(spec_of(base()))
    template = copy.deepcopy(sts["spec"]["template"])
    assert M.template_hash(template) == original


def test_serving_checkpoint_overrides_the_spec() -> None:
    """While a new checkpoint downloads, the StatefulSet keeps loading the old one."""
    spec = spec_of(base(checkpoint={"source": "hf://org/new"}))
    old = M.ServingCheckpoint(checkpoint_key("hf://org/old"), "hf://org/old")
    sts = M.build_statefulset(spec, old)
    assert f"{C.CACHE_MOUNT_PATH}/{old.key}" in _server(sts)["command"]
    assert sts["spec"]["template"]["metadata"]["labels"][C.LABEL_CHECKPOINT_KEY] == old.key
    assert sts["spec"]["template"]["metadata"]["annotations"][C.ANNOTATION_CHECKPOINT_SOURCE] == "hf://org/old"


# --- Services ------------------------------------------------------------------------------


def test_services_and_endpoint() -> None:
    spec = spec_of(base(service={"type": "LoadBalancer", "port": 9100, "annotations": {"lb": "internal"}}))
    svc, headless = M.build_service(spec), M.build_headless_service(spec)
    assert svc["spec"]["type"] == "LoadBalancer" and svc["metadata"]["annotations"] == {"lb": "internal"}
    assert svc["spec"]["ports"] == [{"name": C.PORT_NAME, "port": 9100, "targetPort": C.PORT_NAME, "protocol": "TCP"}]
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"]["publishNotReadyAddresses"] is True
    assert M.endpoint(spec) == "ws://ps.robots.svc:9100"


def test_service_patch_ignores_fields_the_server_adds() -> None:
    desired = M.build_service(spec_of(base(service={"annotations": {"lb": "internal"}})))
    live = copy.deepcopy(desired)
    live["spec"]["clusterIP"] = "10.0.0.7"
    live["spec"]["ports"][0]["nodePort"] = 31000
    live["metadata"]["annotations"]["cloud.example/id"] = "abc"
    assert not M.service_needs_patch(api_object(V1Service, live), desired)
    live["spec"]["ports"][0]["port"] = 1234
    assert M.service_needs_patch(api_object(V1Service, live), desired)


# --- sections the PolicyServer passes through ---------------------------------------------

PASSED_THROUGH: dict[str, Any] = {
    "tolerations": [{"key": "gpu", "operator": "Exists", "effect": "NoSchedule", "tolerationSeconds": 30}],
    "topologySpreadConstraints": [
        {"maxSkew": 1, "topologyKey": "zone", "whenUnsatisfiable": "DoNotSchedule", "labelSelector": {}}
    ],
    "affinity": {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {"weight": 5, "podAffinityTerm": {"topologyKey": "z", "labelSelector": {"matchLabels": {"q": "r"}}}}
            ]
        }
    },
    "volumes": [{"name": "cfg", "configMap": {"name": "c", "defaultMode": 420}}, {"name": "scratch", "emptyDir": {}}],
    "volumeMounts": [{"name": "cfg", "mountPath": "/cfg", "readOnly": True, "subPath": "a"}],
}
PASSED_ENV = [
    {"name": "A", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k", "optional": True}}},
    {"name": "B", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    {"name": "C", "value": ""},
]


def test_passed_through_sections_reach_the_body_unchanged() -> None:
    """The builders make the pod from the client's models; what the user wrote comes out as written (empty
    objects, empty strings, ints and all), not as the model's idea of it."""
    spec = spec_of(base(**copy.deepcopy(PASSED_THROUGH), runtime={"env": copy.deepcopy(PASSED_ENV)}))
    pod = M.build_statefulset(spec, cache_modes=["ReadWriteMany"])["spec"]["template"]["spec"]
    assert pod["tolerations"] == PASSED_THROUGH["tolerations"]
    assert pod["topologySpreadConstraints"] == PASSED_THROUGH["topologySpreadConstraints"]
    assert pod["affinity"] == PASSED_THROUGH["affinity"]
    assert pod["volumes"][-2:] == PASSED_THROUGH["volumes"]
    assert _server(M.build_statefulset(spec))["volumeMounts"][-1:] == PASSED_THROUGH["volumeMounts"]
    assert _server(M.build_statefulset(spec))["env"][-3:] == PASSED_ENV
    rwo = M.build_statefulset(spec, cache_modes=["ReadWriteOnce"])["spec"]["template"]["spec"]["affinity"]
    assert rwo["podAntiAffinity"] == PASSED_THROUGH["affinity"]["podAntiAffinity"] and "podAffinity" in rwo


def test_a_passed_through_field_the_client_does_not_know_is_refused_not_dropped() -> None:
    spec = spec_of(base(tolerations=[{"key": "gpu", "operator": "Exists", "fromTheFuture": True}]))
    with pytest.raises(ValueError, match="V1Toleration"):
        M.build_statefulset(spec)


def test_the_compile_directory_and_key_are_the_policyservers_own() -> None:
    """issue 39 item 3: each PolicyServer's server pods mount only its own compile directory and its own key, read
    only; the fetch and cleanup Jobs mount neither; the key Secret is created once, never read."""
    spec = spec_of(base())
    pod = M.build_statefulset(spec)["spec"]["template"]["spec"]
    server = pod["containers"][0]
    mounts = {m["mountPath"]: m for m in server["volumeMounts"]}
    assert mounts[C.COMPILE_CACHE_MOUNT_PATH]["subPath"] == f"{C.COMPILE_CACHE_DIR}/{spec.name}"
    key = mounts[COMPILE_KEY_DIR]
    assert key["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == key["name"]]
    assert volume["secret"]["secretName"] == f"{spec.name}-compile-key"
    command = server["command"]
    assert command[command.index(serve_flags.COMPILE_KEY_FLAG) + 1] == f"{COMPILE_KEY_DIR}/{M.TOKEN_FILE}"
    for job in (M.build_fetch_job(spec), M.build_gc_job(spec, spec.checkpoint.key)):
        job_pod = job["spec"]["template"]["spec"]
        assert all("compile" not in v["name"] for v in job_pod["volumes"]), job_pod["volumes"]
    # the download cannot write the compile directory, in the fetch Job nor in a perPod pod's fetch init container
    per_pod = M.build_statefulset(spec_of(base(storage={"mode": "perPod"})))["spec"]["template"]["spec"]
    for fetch in (M.build_fetch_job(spec)["spec"]["template"]["spec"]["containers"][0], per_pod["initContainers"][0]):
        assert fetch["name"] == M.FETCH_CONTAINER
        (over,) = [m for m in fetch["volumeMounts"] if m["mountPath"] == f"{C.CACHE_MOUNT_PATH}/{C.COMPILE_CACHE_DIR}"]
        assert over == {**over, "readOnly": True, "subPath": C.COMPILE_CACHE_DIR}, over
    secret = M.build_compile_key_secret(spec, "ab" * 32)
    assert secret["type"] == "Opaque" and secret["stringData"] == {M.COMPILE_KEY_DATA: "ab" * 32}
    assert secret["metadata"]["name"] == volume["secret"]["secretName"]
    # extraArgs cannot name another key (whoever held it could plant artifacts the pods load)
    for arg in (f"{serve_flags.COMPILE_KEY_FLAG}=/etc/mine/key", "--compile-k"):
        with pytest.raises(SpecError, match=r"spec\.runtime\.extraArgs\[0\]: .*--compile-key-file"):
            spec_of(base(runtime={"extraArgs": [arg]}))
    # a read-only-many shared claim gets no compile mount, and then no key either
    ro = spec_of(base(storage={"accessModes": ["ReadOnlyMany"]}, replicas=2))
    ro_pod = M.build_statefulset(ro)["spec"]["template"]["spec"]
    assert all("compile" not in v["name"] for v in ro_pod["volumes"])
