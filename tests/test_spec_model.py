"""The PolicyServer spec model's own verdicts: what parse_spec accepts, refuses (with which field path) and derives.

The CRD is generated from the same model (tests/test_crd.py checks the
generated files and the apiserver-side verdicts); here the operator's side is
checked on its own, including that the CEL rules it evaluates agree with the
runtime's definitions they translate (source_uri.py, ParallelLayout, the worker's
flags).
"""

from __future__ import annotations

import argparse
import copy
from typing import Any

import pytest

from policy_operator import constants as C
from policy_operator import serve_flags
from policy_operator.builtin_policies import BUILTIN_POLICIES, LEROBOT_FAMILIES, check_unconditional
from policy_operator.layout import LayoutError, ParallelLayout
from policy_operator.operator import spec as S
from policy_operator.operator.spec import PolicyServerSpec, SpecError, parse_spec
from policy_operator.source_uri import InvalidSource, check_relpath, check_source, request_key

HEX = "ab" * 32


def base(**overrides: Any) -> dict[str, Any]:
    return {"image": "registry.example/policy:1", "checkpoint": {"source": "hf://org/policy"}, **overrides}


def parse(spec: dict[str, Any], name: str = "ps") -> PolicyServerSpec:
    return parse_spec(spec, name=name, namespace="robots")


def refused(spec: dict[str, Any], name: str = "ps") -> SpecError:
    with pytest.raises(SpecError) as exc:
        parse(spec, name)
    return exc.value


def rule(model: type, text_part: str) -> S.Rule:
    """The CEL rule of ``model`` (class-level or on a field's type) whose text contains ``text_part``."""
    from policy_operator.operator.kube_model import kube_schema

    found: list[dict[str, Any]] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            found.extend(r for r in node.get("x-kubernetes-validations", ()) if text_part in r["rule"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(kube_schema(model))
    (one,) = {r["rule"]: r for r in found}.values()
    return S.Rule(one["rule"], one["message"])


# --- refusals name the field as the CRD spells it ------------------------------------------------

INVALID = [
    (base(parallelism={"cfgp": 3}), "spec.parallelism.cfgp"),
    (base(parallelism={"cfgp": 0}), "spec.parallelism.cfgp"),
    (base(parallelism={"dp": 0}), "spec.parallelism.dp"),
    (base(parallelism={"dp": 17}), "spec.parallelism.dp"),
    (base(parallelism={"cfgp": 2, "dp": 9}), "spec.parallelism.dp"),
    (base(parallelism={"cfgp": 2}, runtime={"guidance": 1.0}), "spec.parallelism.cfgp"),
    (base(parallelism={"cfgp": 2}, runtime={"guidance": 1}), "spec.parallelism.cfgp"),  # an integer is a number
    (base(checkpoint={"source": "ftp://host/ckpt"}), "spec.checkpoint.source"),
    (base(checkpoint={"source": "relative/dir"}), "spec.checkpoint.source"),
    (base(checkpoint={"source": ""}), "spec.checkpoint.source"),
    (base(checkpoint={"source": "https://h/" + "x" * 2048}), "spec.checkpoint.source"),
    (base(checkpoint={"source": "hf://org/p@"}), "spec.checkpoint.source"),
    (base(checkpoint={"source": "hf://org/p@a@b"}), "spec.checkpoint.source"),
    (base(checkpoint={"source": "hf://org/p@v1", "revision": "v2"}), "spec.checkpoint.revision"),
    (base(checkpoint={"source": "hf://org/p", "revision": ""}), "spec.checkpoint.revision"),
    (base(checkpoint={"source": "hf://org/p", "revision": "r" * 257}), "spec.checkpoint.revision"),
    (
        base(checkpoint={"source": "hf://org/p", "sha256": {"model.safetensors": "abc"}}),
        "spec.checkpoint.sha256.model.safetensors",
    ),
    (base(checkpoint={"source": "hf://org/p", "sha256": {"../x": HEX}}), "spec.checkpoint.sha256"),
    (base(checkpoint={"source": "hf://org/p", "sha256": {f"f{i}": HEX for i in range(257)}}), "spec.checkpoint.sha256"),
    (base(checkpoint={"source": "hf://org/p", "secretRef": {"name": "Bad_Name"}}), "spec.checkpoint.secretRef.name"),
    (
        base(checkpoint={"source": "hf://org/p", "secretRef": {"name": "t", "key": "a/b"}}),
        "spec.checkpoint.secretRef.key",
    ),
    (base(checkpoint={"source": "hf://org/p", "secretRef": {"key": "t"}}), "spec.checkpoint.secretRef.name"),
    (
        base(checkpoint={"source": "hf://org/p", "fetchJob": {"backoffLimit": -1}}),
        "spec.checkpoint.fetchJob.backoffLimit",
    ),
    (
        base(checkpoint={"source": "hf://org/p", "fetchJob": {"backoffLimit": 21}}),
        "spec.checkpoint.fetchJob.backoffLimit",
    ),
    (
        base(checkpoint={"source": "hf://org/p", "fetchJob": {"resources": {"limits": {"memory": "4 GB"}}}}),
        "spec.checkpoint.fetchJob.resources.limits.memory",
    ),
    (
        base(checkpoint={"source": "hf://org/p", "fetchJob": {"env": [{"value": "x"}]}}),
        "spec.checkpoint.fetchJob.env[0].name",
    ),
    (base(resources={"limits": {C.GPU_RESOURCE: 4}}), "spec.resources.limits"),
    (base(resources={"requests": {C.GPU_RESOURCE: "1"}}), "spec.resources.requests"),
    (base(resources={"requests": {"cpu": "-1"}}), "spec.resources.requests.cpu"),
    (base(resources={"requests": {"cpu": 0.5}}), "spec.resources.requests.cpu"),  # the API has int-or-string only
    (base(resources={"shmSize": "2 GiB"}), "spec.resources.shmSize"),
    (base(storage={"size": "lots"}), "spec.storage.size"),
    (base(storage={"existingClaim": "mine", "storageClassName": "fast"}), "spec.storage.storageClassName"),
    (base(storage={"existingClaim": "Mine"}), "spec.storage.existingClaim"),
    (base(storage={"accessModes": ["ReadWriteSometimes"]}), "spec.storage.accessModes[0]"),
    (base(storage={"retainOnDelete": "yes"}), "spec.storage.retainOnDelete"),
    (base(runtime={"extraArgs": ["--port", "9000"]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": ["--dtype", "bfloat16", "--cfgp=2"]}), "spec.runtime.extraArgs[2]"),
    (base(runtime={"extraArgs": ["--guid", "1.0"]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": ["--x"] * 65}), "spec.runtime.extraArgs"),
    (base(runtime={"extraArgs": ["--policy", "m:C"]}), "spec.runtime.extraArgs[0]"),  # spec.policy says it
    (base(policy={"type": "lerobot"}, parallelism={"cfgp": 2}), "spec.parallelism.cfgp"),
    (base(policy={"type": "lerobot"}, runtime={"guidance": 3.0}), "spec.runtime.guidance"),
    (base(policy={"type": "lerobot", "family": "smolvla"}, parallelism={"cfgp": 2}), "spec.parallelism.cfgp"),
    (base(policy={"type": "lerobot", "family": "openvla"}), "spec.policy.family"),  # not a served type
    (base(policy={"type": "reference", "family": "lingbot_va"}), "spec.policy.family"),
    (base(policy={"family": "lingbot_va"}, parallelism={"cfgp": 2}), "spec.policy.family"),  # type reference
    (base(policy={"type": "import"}), "spec.policy.importPath"),
    (base(policy={"type": "reference", "importPath": "m.p:P"}), "spec.policy.importPath"),
    (base(policy={"type": "import", "importPath": "m/p.py"}), "spec.policy.importPath"),
    (base(policy={"type": "openvla"}), "spec.policy.type"),
    (base(runtime={"extraArgs": ["--policy=" + "m" * 1024]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": [7]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"drainGraceSeconds": 30}), "spec.runtime.drainGraceSeconds"),
    (base(runtime={"startupTimeoutSeconds": 10}), "spec.runtime.startupTimeoutSeconds"),
    (base(runtime={"steps": 0}), "spec.runtime.steps"),
    (base(runtime={"guidance": -0.5}), "spec.runtime.guidance"),
    (base(runtime={"device": "tpu"}), "spec.runtime.device"),
    (
        base(runtime={"env": [{"name": "A", "value": "1", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}}]}),
        "spec.runtime.env[0].valueFrom",
    ),
    (base(runtime={"env": [{"name": "1=A", "value": "1"}]}), "spec.runtime.env[0].name"),
    (base(replicas=-1), "spec.replicas"),
    (base(replicas="3"), "spec.replicas"),  # strict JSON types, as the apiserver's schema
    (base(replicas=True), "spec.replicas"),
    ({"checkpoint": {"source": "hf://o/p"}}, "spec.image"),
    (base(image="two words"), "spec.image"),
    ({"image": "x"}, "spec.checkpoint"),
    (base(imagePullPolicy="Sometimes"), "spec.imagePullPolicy"),
    (base(imagePullSecrets=[{"name": "Reg_Cred"}]), "spec.imagePullSecrets[0].name"),
    (base(priorityClassName="High Priority"), "spec.priorityClassName"),
    (base(service={"type": "ExternalName"}), "spec.service.type"),
    (base(service={"port": 70000}), "spec.service.port"),
    (base(bogusField=1), "spec.bogusField"),
    (base(runtime={"guidanceScale": 2.0}), "spec.runtime.guidanceScale"),
    (base(runtime={"batching": {"maxBatch": 0}}), "spec.runtime.batching.maxBatch"),
    (base(runtime={"batching": {"maxBatch": serve_flags.MAX_MAX_BATCH + 1}}), "spec.runtime.batching.maxBatch"),
    (base(runtime={"batching": {"maxBatch": 2.0}}), "spec.runtime.batching.maxBatch"),  # an integer, not a number
    (base(runtime={"batching": {"maxBatch": "8"}}), "spec.runtime.batching.maxBatch"),
    (base(runtime={"batching": {"windowMs": -0.5}}), "spec.runtime.batching.windowMs"),
    (base(runtime={"batching": {"windowMs": 1000.5}}), "spec.runtime.batching.windowMs"),
    (base(runtime={"batching": {"windowMs": "2ms"}}), "spec.runtime.batching.windowMs"),
    (base(runtime={"batching": {"window": 2}}), "spec.runtime.batching.window"),
    (base(runtime={"rtc": {"mode": "always"}}), "spec.runtime.rtc.mode"),
    (base(runtime={"rtc": {"maxInferenceDelay": -1}}), "spec.runtime.rtc.maxInferenceDelay"),
    (base(runtime={"rtc": {"maxInferenceDelay": serve_flags.MAX_RTC_DELAY + 1}}), "spec.runtime.rtc.maxInferenceDelay"),
    (base(runtime={"extraArgs": ["--rtc", "guided"]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": ["--max-batch", "32"]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": ["--threads", "2", "--batch-window-ms=0"]}), "spec.runtime.extraArgs[2]"),
    (base(runtime={"extraArgs": ["--max-b", "32"]}), "spec.runtime.extraArgs[0]"),
    (base(runtime={"extraArgs": ["--threads", "2", "--compile=foo"]}), "spec.runtime.extraArgs[2]"),
    (base(runtime={"extraArgs": ["--compile", "foo", "--threads", "2"]}), "spec.runtime.extraArgs"),  # operator's
]


@pytest.mark.parametrize(("spec", "path"), INVALID, ids=[p for _, p in INVALID])
def test_invalid_spec_is_refused_naming_the_field(spec: dict[str, Any], path: str) -> None:
    error = refused(spec)
    assert error.path == path, str(error)
    assert str(error).startswith(f"{path}: ") and error.message


@pytest.mark.parametrize("name", ["Policy_Server", "p" * 41, "1policy", "policy.server", ""])
def test_name_must_keep_every_child_name_valid(name: str) -> None:
    assert refused(base(), name=name).path == "metadata.name"
    parse(base(), name="p" * S.MAX_NAME_LENGTH)


def test_batching_bounds_are_refused_with_the_bound_in_the_message() -> None:
    assert (
        str(refused(base(runtime={"batching": {"maxBatch": 300}})))
        == f"spec.runtime.batching.maxBatch: Input should be less than or equal to {serve_flags.MAX_MAX_BATCH} (got 300)"
    )
    assert (
        str(refused(base(runtime={"batching": {"windowMs": -1}})))
        == "spec.runtime.batching.windowMs: Input should be greater than or equal to 0 (got -1)"
    )
    assert "unknown field" in str(refused(base(runtime={"maxBatch": 4})))  # it lives under runtime.batching


def test_every_problem_is_reported_the_first_one_names_the_path() -> None:
    error = refused(base(replicas=-1, service={"port": 0}))
    assert error.path == "spec.replicas"
    assert str(error).startswith("spec.replicas: ") and "; spec.service.port: " in error.message


def test_an_unparseable_spec_is_a_spec_error_not_a_crash() -> None:
    unparseable: list[Any] = [None, [], "spec", {"checkpoint": []}]  # not the dict refused() takes
    for spec in unparseable:
        assert isinstance(refused(spec), SpecError)


# --- what is accepted, and what the operator derives from it ---------------------------------------


def test_defaults_fill_an_empty_section() -> None:
    spec = parse(base())
    assert spec.to_api() == {
        "image": "registry.example/policy:1",
        "imagePullSecrets": [],
        "checkpoint": {
            "source": "hf://org/policy",
            "sha256": {},
            "fetchJob": {"backoffLimit": 3, "ttlSecondsAfterFinished": 3600, "env": []},
        },
        "policy": {"type": "reference", "trustRemoteCode": False},
        "parallelism": {"cfgp": 1, "dp": 1},
        "replicas": 1,
        "progressDeadlineSeconds": 900,
        "resources": {"requests": {}, "limits": {}, "shmSize": "2Gi"},
        "nodeSelector": {},
        "tolerations": [],
        "topologySpreadConstraints": [],
        "podLabels": {},
        "podAnnotations": {},
        "volumes": [],
        "volumeMounts": [],
        "maxGpusPerPod": 8,
        "storage": {"mode": "shared", "size": "20Gi", "accessModes": [], "keepCheckpoints": 1, "retainOnDelete": False},
        "service": {"type": "ClusterIP", "port": C.DEFAULT_PORT, "annotations": {}},
        "runtime": {
            "batching": {"maxBatch": serve_flags.DEFAULT_MAX_BATCH, "windowMs": serve_flags.DEFAULT_BATCH_WINDOW_MS},
            "rtc": {"mode": "off"},
            "extraArgs": [],
            "env": [],
            "drainGraceSeconds": 20,
            "startupTimeoutSeconds": 600,
            "device": "cuda",
            "maxConnections": serve_flags.DEFAULT_MAX_CONNECTIONS,
            "frontend": {"mode": serve_flags.DEFAULT_FRONTEND, "processes": 1},
        },
        "auth": {},
    }
    assert PolicyServerSpec.model_validate(spec.to_api()) == PolicyServerSpec.model_validate(base())


def test_null_means_unset_as_the_apiserver_prunes_it() -> None:
    assert parse(base(replicas=None, runtime={"guidance": None}, storage=None)) == parse(base())


def test_derived_values() -> None:
    spec = parse(
        base(
            parallelism={"cfgp": 2, "dp": 3},
            replicas=2,
            checkpoint={"source": "hf://org/p@v2", "sha256": {"a/model.safetensors": HEX.upper()}},
            resources={"requests": {"cpu": 4, "memory": "16Gi"}},
        )
    )
    assert (spec.name, spec.namespace) == ("ps", "robots")
    assert spec.layout == ParallelLayout(cfgp=2, dp=3) and spec.gpus_per_pod == 6
    assert (
        spec.checkpoint.key
        == request_key("hf://org/p", "v2")
        == parse(base(checkpoint={"source": "hf://org/p", "revision": "v2"})).checkpoint.key
    )
    assert spec.checkpoint.path == f"{C.CACHE_MOUNT_PATH}/{spec.checkpoint.key}" and spec.checkpoint.is_hf
    assert spec.checkpoint.sha256 == {"a/model.safetensors": HEX}  # lower-cased, as the fetcher compares
    assert spec.resources.requests == {"cpu": "4", "memory": "16Gi"}  # quantities as the strings the API returns
    assert spec.access_modes == ("ReadWriteMany",)
    assert parse(base()).access_modes == ("ReadWriteOnce",)
    assert parse(base(storage={"mode": "perPod", "accessModes": ["ReadWriteOncePod"]}, replicas=3)).access_modes == (
        "ReadWriteOncePod",
    )
    assert parse(base(runtime={"device": "cpu"}, parallelism={"dp": 2})).gpus_per_pod == 0


@pytest.mark.parametrize(
    "spec",
    [
        base(parallelism={"cfgp": 2, "dp": 8}, runtime={"guidance": 1.5}, maxGpusPerPod=16),
        base(parallelism={"cfgp": 1, "dp": 16}, runtime={"guidance": 1.0}, maxGpusPerPod=16),
        base(checkpoint={"source": "/srv/checkpoints/pi0"}, replicas=0),
        base(checkpoint={"source": "file:///srv/ckpt"}, storage={"existingClaim": "shared-models"}),
        base(checkpoint={"source": "s3://bucket/prefix/"}, runtime={"extraArgs": ["--heartbeat-s", "5"]}),
        base(checkpoint={"source": "http://10.0.0.1/ckpt/", "secretRef": {"name": "tok", "key": "api.key"}}),
        base(runtime={"extraArgs": ["--ports=1", "--dtype=bfloat16", "--cache-dir", "/tmp/c", "--policys", "m:C"]}),
        base(resources={"requests": {"cpu": "500m", "memory": "1.5Gi", "ephemeral-storage": "1e9"}}),
        base(
            tolerations=[{"key": C.GPU_RESOURCE, "operator": "Exists", "effect": "NoSchedule"}],
            affinity={"nodeAffinity": {}},
            nodeSelector={"gpu": "h100"},
        ),
    ],
    ids=range(9),
)
def test_valid_variants_are_accepted(spec: dict[str, Any]) -> None:
    assert parse(copy.deepcopy(spec)).to_api()["image"] == spec["image"]


# --- the CEL rules say what the runtime's own definitions say -----------------------------------------


def _worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    serve_flags.add_arguments(parser)
    return parser


def test_extra_args_refuse_every_managed_flag_and_abbreviation_and_nothing_else() -> None:
    flags = [s for a in _worker_parser()._actions for s in a.option_strings if s.startswith("--")]
    assert set(serve_flags.MANAGED_FLAGS) <= set(flags)
    for flag in flags:
        forms = [flag, f"{flag}=1"]
        if flag in serve_flags.MANAGED_FLAGS:
            # every prefix argparse could expand to this flag, e.g. --guid for --guidance
            forms += [flag[:n] for n in range(3, len(flag))] + [f"{flag[:n]}=1" for n in range(3, len(flag))]
            for form in forms:
                assert refused(base(runtime={"extraArgs": [form]})).path == "spec.runtime.extraArgs[0]", form
        elif flag == serve_flags.COMPILE_KEY_FLAG:  # not a spec field, the operator's own key: refused too
            for form in [*forms, "--compile-k", "--compile-key=/x"]:
                assert refused(base(runtime={"extraArgs": [form]})).path == "spec.runtime.extraArgs[0]", form
        elif flag == serve_flags.COMPILE_FLAG:  # a mode torch.compile takes, or none (eager); no other
            assert refused(base(runtime={"extraArgs": [f"{flag}=1"]})).path == "spec.runtime.extraArgs[0]"
            for mode in (*serve_flags.COMPILE_MODES, serve_flags.COMPILE_OFF):
                parse(base(runtime={"extraArgs": [f"{flag}={mode}"]}))
            parse(base(runtime={"extraArgs": [flag]}))
        else:
            for form in forms:
                parse(base(runtime={"extraArgs": [form]}))


def test_argparse_would_let_an_abbreviation_override_a_managed_flag() -> None:
    """Why the rule refuses abbreviations: the worker's parser expands them and the last value wins."""
    args = _worker_parser().parse_args(["--checkpoint", "/m", "--guidance", "3.0", "--guid", "1.0"])
    assert args.guidance == 1.0


RELPATHS = [
    "model.safetensors",
    "a/b.json",
    "..a",
    "a..b/c",
    ".hidden",
    "",
    "/abs",
    "../x",
    "a/../b",
    "a/..",
    "a//b",
    "a/",
    "./a",
    "a/./b",
    ".",
    "a\\b",
    "..\\x",
]


@pytest.mark.parametrize("name", RELPATHS)
def test_sha256_file_rule_is_the_fetchers_path_check(name: str) -> None:
    try:
        check_relpath(name)
        safe = True
    except InvalidSource:
        safe = False
    assert rule(S.CheckpointSpec, "self.all(f").holds({name: HEX}) == safe


SOURCES = [
    "hf://org/repo",
    "hf://org/repo@v1",
    "https://h/ckpt/",
    "http://h/f.safetensors",
    "s3://b/p/",
    "file:///srv/c",
    "/srv/c",
    "ftp://h/c",
    "relative",
    "hf://",
    "s3:/b",
    "HF://org/repo",
    "//h/c",
]


@pytest.mark.parametrize("source", SOURCES)
def test_source_rule_is_the_fetchers_scheme_check(source: str) -> None:
    try:
        check_source(source)
        fetchable = True
    except InvalidSource:
        fetchable = False
    assert rule(S.CheckpointSpec, "self.matches('^((hf").holds(source) == fetchable


@pytest.mark.parametrize("cfgp", [1, 2])
@pytest.mark.parametrize("guidance", [0.0, 1.0, 1.5, 3.0])
def test_guidance_rule_is_the_layouts_check(cfgp: int, guidance: float) -> None:
    try:
        ParallelLayout(cfgp=cfgp).check_guidance(guidance)
        runs = True
    except LayoutError:
        runs = False
    verdict = rule(PolicyServerSpec, "self.runtime.guidance != 1.0").holds(
        {"parallelism": {"cfgp": cfgp, "dp": 1}, "runtime": {"guidance": guidance}}
    )
    assert verdict == runs


def test_the_runtime_defaults_are_the_specs() -> None:
    runtime = parse(base()).runtime
    args = _worker_parser().parse_args(["--checkpoint", "/m"])
    assert (runtime.guidance, runtime.steps, float(runtime.drain_grace_seconds)) == (
        args.guidance,
        args.steps,
        args.drain_grace_s,
    )
    assert (runtime.batching.max_batch, runtime.batching.window_ms) == (args.max_batch, args.batch_window_ms)
    assert (runtime.batching.latency_budget_ms, runtime.max_connections) == (
        args.latency_budget_ms,
        args.max_connections,
    )
    assert (runtime.rtc.mode, runtime.rtc.max_inference_delay) == (args.rtc, args.rtc_max_delay)
    assert parse(base()).policy.flag == args.policy


POLICIES = [(name, None) for name in BUILTIN_POLICIES] + [("lerobot", family) for family in LEROBOT_FAMILIES]


@pytest.mark.parametrize(("policy", "family"), POLICIES, ids=[f"{p}-{f}" for p, f in POLICIES])
@pytest.mark.parametrize("cfgp", [1, 2])
@pytest.mark.parametrize("guidance", [None, 0.0, 1.0, 3.0])
def test_policy_guidance_rules_are_the_runtimes_checks(
    policy: str, family: str | None, cfgp: int, guidance: float | None
) -> None:
    """Admission refuses exactly the (policy, family, cfgp, guidance) a pod would refuse at start (a LeRobot
    checkpoint of the declared family), guidance unset included."""
    has_unconditional = BUILTIN_POLICIES[policy].has_unconditional
    if family is not None:
        has_unconditional = LEROBOT_FAMILIES[family].has_unconditional
    effective = serve_flags.policy_guidance(guidance, has_unconditional)
    try:
        ParallelLayout(cfgp=cfgp).check_guidance(effective)
        check_unconditional(policy, has_unconditional, cfgp=cfgp, guidance=effective)
        runs = True
    except LayoutError:
        runs = False
    policy_doc = {"type": policy} if family is None else {"type": policy, "family": family}
    doc = {
        "policy": policy_doc,
        "parallelism": {"cfgp": cfgp, "dp": 1},
        "runtime": {} if guidance is None else {"guidance": guidance},
    }
    rules = [
        r
        for r in PolicyServerSpec.cel_rules
        if ("self.runtime.guidance" in r.rule or "self.policy" in r.rule) and "lerobotGrpcPort" not in r.rule
    ]
    assert len(rules) == 3
    assert all(r.holds(doc) for r in rules) == runs
    spec = base(policy=policy_doc, parallelism={"cfgp": cfgp}, runtime=doc["runtime"])
    if runs:
        # a LeRobot CFG family's guidance unset is its checkpoint's own (LingBot-VA: 5.0), not the reference's 3.0
        own = policy == "lerobot" and has_unconditional and guidance is None
        assert parse(spec).guidance == (None if own else effective)
    else:
        with pytest.raises(SpecError):
            parse(spec)


def test_policy_type_is_the_pods_policy_flag() -> None:
    assert parse(base()).policy.flag == "reference"
    assert parse(base(policy={"type": "lerobot"})).policy.flag == "lerobot"
    spec = parse(base(policy={"type": "import", "importPath": "my_robot.policies:Mine"}, parallelism={"cfgp": 2}))
    assert spec.policy.flag == "my_robot.policies:Mine" and spec.policy.has_unconditional is None
    assert spec.guidance is None  # an import's own: only a pod can tell whether it has an unconditional branch


def test_a_lerobot_cfg_family_is_served_with_cfgp2_and_the_checkpoints_guidance() -> None:
    """policy.family lingbot_va admits cfgp=2 for lerobot; its pods get --lerobot-family and no --guidance (the
    checkpoint's 5.0, not the reference's 3.0), unless runtime.guidance says otherwise."""
    from policy_operator.operator.manifests import ServingCheckpoint, worker_command

    def command(**runtime: Any) -> list[str]:
        spec = parse(base(policy={"type": "lerobot", "family": "lingbot_va"}, parallelism={"cfgp": 2}, runtime=runtime))
        assert spec.policy.has_unconditional is True
        return worker_command(spec, ServingCheckpoint.of(spec))

    argv = command()
    assert argv[argv.index("--lerobot-family") + 1] == "lingbot_va" and argv[argv.index("--cfgp") + 1] == "2"
    assert "--guidance" not in argv
    argv = command(guidance=2.0)
    assert argv[argv.index("--guidance") + 1] == "2.0"
    unguided = parse(base(policy={"type": "lerobot"}))
    assert "--lerobot-family" not in worker_command(unguided, ServingCheckpoint.of(unguided))
    refusal = refused(base(policy={"type": "lerobot"}, parallelism={"cfgp": 2}))
    assert "unless policy.family names a LeRobot family trained for classifier-free guidance (lingbot_va)" in str(
        refusal
    )


@pytest.mark.parametrize(
    ("max_batch", "window_ms"),
    [
        (0, 2.0),
        (1, 2.0),
        (serve_flags.MAX_MAX_BATCH, 2.0),
        (serve_flags.MAX_MAX_BATCH + 1, 2.0),
        (8, -0.001),
        (8, 0.0),
        (8, 0.5),
        (8, float(S.MAX_BATCH_WINDOW_MS)),
        (8, S.MAX_BATCH_WINDOW_MS + 0.001),
    ],
)
def test_batching_bounds_are_the_runtimes_check(max_batch: int, window_ms: float) -> None:
    """spec.runtime.batching accepts exactly the --max-batch / --batch-window-ms values serve_flags.check_values does."""
    opts = serve_flags.ServeOptions.from_args(
        _worker_parser().parse_args(
            ["--checkpoint", "/m", "--max-batch", str(max_batch), "--batch-window-ms", str(window_ms)]
        )
    )
    try:
        serve_flags.check_values(opts)
        runs = True
    except ValueError:
        runs = False
    try:
        parse(base(runtime={"batching": {"maxBatch": max_batch, "windowMs": window_ms}}))
        accepted = True
    except SpecError:
        accepted = False
    assert accepted == runs


def test_an_integer_window_is_a_number() -> None:
    """The apiserver stores windowMs: 2 as the JSON integer 2; the model reads it as the float the flag takes."""
    batching = parse(base(runtime={"batching": {"maxBatch": 4, "windowMs": 2}})).runtime.batching
    assert (batching.max_batch, batching.window_ms) == (4, 2.0) and isinstance(batching.window_ms, float)


# --- spec.volumes: an allow-list of sources ---------------------------------------------------------


def test_the_volume_source_lists_cover_kubernetes_volume_exactly() -> None:
    from policy_operator.operator.crd import kubernetes_definitions

    sources = set(kubernetes_definitions()["io.k8s.api.core.v1.Volume"]["properties"]) - {"name"}
    assert set(S.ALLOWED_VOLUME_SOURCES) | set(S.REFUSED_VOLUME_SOURCES) == sources
    assert not set(S.ALLOWED_VOLUME_SOURCES) & set(S.REFUSED_VOLUME_SOURCES)
    assert "hostPath" in S.REFUSED_VOLUME_SOURCES


@pytest.mark.parametrize("source", S.ALLOWED_VOLUME_SOURCES)
def test_an_allowed_volume_source_is_accepted(source: str) -> None:
    parsed = parse(base(volumes=[{"name": "extra", source: {}}]))
    assert parsed.volumes == [{"name": "extra", source: {}}]


@pytest.mark.parametrize("source", ["hostPath", "nfs", "iscsi", "image", "gitRepo"])
def test_a_refused_volume_source_is_refused_with_its_path(source: str) -> None:
    err = refused(base(volumes=[{"name": "ok", "emptyDir": {}}, {"name": "bad", source: {"path": "/"}}]))
    assert err.path == "spec.volumes[1]" and "hostPath" in err.message


def test_an_unknown_volume_source_is_refused_by_the_parser() -> None:
    err = refused(base(volumes=[{"name": "new", "someFutureSource": {}}]))
    assert "someFutureSource is not an allowed volume source" in err.message
