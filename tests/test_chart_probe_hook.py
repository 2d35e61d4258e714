"""The chart's ``helm test`` hook: a Pod that runs ``policyserver probe`` against the sample PolicyServer.

Rendered by Helm's own engine (helm-python-sdk) as ``tests/test_chart.py``
does.  The probe's command line must parse with the real CLI parser, its URL
must be the endpoint the operator writes into the sample's status, and its
token file the key of the Secret the sample's own server requires.
"""

from __future__ import annotations

import copy
from typing import Any

import helm_python
import kubernetes_validate
import pytest
import yaml

from policy_operator import cli
from policy_operator import constants as C
from policy_operator.operator import manifests
from policy_operator.operator.spec import parse_spec
from tests.support.chart import CHART, DOCS, EXAMPLES, K8S_VERSIONS, LINT_KUBE_VERSION, NS, RELEASE, chart, code_lines

HOOK_TEMPLATE = "templates/tests/probe-sample.yaml"
CFGP2_DP2 = {k: v for k, v in EXAMPLES["policyserver-cfgp2-dp2.yaml"]["spec"].items() if k != "image"}

VALUES: dict[str, dict[str, Any]] = {
    "sample": {"samplePolicyServer": {"enabled": True}},
    "sample-elsewhere-auth-port": {
        "samplePolicyServer": {
            "enabled": True,
            "name": "policy-cfgp2-dp2",
            "namespace": "team-a",
            "spec": {**CFGP2_DP2, "service": {"port": 9100}},
        },
        "watchNamespaces": ["team-a"],
        "imagePullSecrets": [{"name": "regcred"}],
        "image": {"digest": "sha256:" + "cd" * 32},
    },
    "sample-slow-start": {
        "samplePolicyServer": {"enabled": True, "test": {"retrySeconds": 600, "timeoutSeconds": 300}}
    },
}


@pytest.fixture(scope="module", autouse=True)
def _quiet_helm() -> None:
    helm_python.disable_logging()


def render(values: dict[str, Any]) -> list[dict[str, Any]]:
    chart().validate_schema(copy.deepcopy(values))
    files = chart().render(copy.deepcopy(values), name=RELEASE, namespace=NS)
    return [
        obj
        for path, text in sorted(files.items())
        if not path.endswith("NOTES.txt")
        for obj in yaml.safe_load_all(text)
        if obj
    ]


def hooks(values: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in render(values) if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]


def sample_and_hook(name: str) -> tuple[dict[str, Any], dict[str, Any]]:
    objs = render(VALUES[name])
    (ps,) = [o for o in objs if o["kind"] == C.KIND]
    (hook,) = [o for o in objs if "helm.sh/hook" in (o["metadata"].get("annotations") or {})]
    return ps, hook


@pytest.mark.parametrize("name", VALUES)
def test_hook_is_a_test_pod_that_helm_runs_only_on_helm_test(name: str) -> None:
    ps, hook = sample_and_hook(name)
    assert hook["kind"] == "Pod" and hook["spec"]["restartPolicy"] == "Never"
    annotations = hook["metadata"]["annotations"]
    assert annotations["helm.sh/hook"] == "test"  # never install/upgrade/delete
    assert set(annotations["helm.sh/hook-delete-policy"].split(",")) == {"before-hook-creation", "hook-succeeded"}
    assert hook["metadata"]["namespace"] == ps["metadata"]["namespace"]  # the Service it probes is there
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(hook, version, strict=True)
    assert hook["spec"]["automountServiceAccountToken"] is False  # it needs no API access
    (container,) = hook["spec"]["containers"]
    sc = container["securityContext"]
    assert (
        sc["readOnlyRootFilesystem"] and not sc["allowPrivilegeEscalation"] and sc["capabilities"] == {"drop": ["ALL"]}
    )


@pytest.mark.parametrize("name", VALUES)
def test_hook_command_parses_and_probes_the_samples_endpoint(name: str) -> None:
    ps, hook = sample_and_hook(name)
    (container,) = hook["spec"]["containers"]
    assert container["command"] == ["policyserver", "probe"]
    args = cli.build_parser().parse_args(container["command"][1:] + container["args"])
    assert cli.COMMANDS[args.command][0] == "policy_operator.runtime.probe"
    spec = parse_spec(ps["spec"], name=ps["metadata"]["name"], namespace=ps["metadata"]["namespace"])
    assert args.url == manifests.endpoint(spec)  # what status.endpoint says
    test_values = VALUES[name]["samplePolicyServer"].get("test", {})
    assert args.retry_seconds == test_values.get("retrySeconds", 60)
    assert args.timeout == test_values.get("timeoutSeconds", 60)
    # the operator image: the probe is torch-free, and the cluster pulled that image already
    operator_image = [o for o in render(VALUES[name]) if o["kind"] == "Deployment"][0]["spec"]["template"]["spec"]
    assert container["image"] == operator_image["containers"][0]["image"]
    assert hook["spec"].get("imagePullSecrets") == operator_image.get("imagePullSecrets")


def test_hook_presents_the_token_the_samples_server_requires() -> None:
    ps, hook = sample_and_hook("sample-elsewhere-auth-port")
    spec = parse_spec(ps["spec"], name=ps["metadata"]["name"], namespace=ps["metadata"]["namespace"])
    secret = spec.auth.secret_ref
    assert secret is not None
    (container,) = hook["spec"]["containers"]
    args = cli.build_parser().parse_args(container["command"][1:] + container["args"])
    (mount,) = container["volumeMounts"]
    (volume,) = hook["spec"]["volumes"]
    assert mount["name"] == volume["name"] and mount["readOnly"] is True
    assert volume["secret"]["secretName"] == secret.name
    (item,) = volume["secret"]["items"]
    assert item["key"] == secret.key and args.token_file == f"{mount['mountPath']}/{item['path']}"
    # no token file for a sample without auth
    _, plain = sample_and_hook("sample")
    assert "--token-file" not in " ".join(plain["spec"]["containers"][0]["args"]) and "volumes" not in plain["spec"]


def test_no_hook_without_the_sample_or_when_switched_off() -> None:
    assert hooks({}) == []
    assert hooks({"samplePolicyServer": {"enabled": True, "test": {"enabled": False}}}) == []
    assert hooks({"samplePolicyServer": {"enabled": False, "test": {"enabled": True}}}) == []


@pytest.mark.parametrize("name", VALUES)
def test_lint_strict_with_the_hook(name: str) -> None:
    report = helm_python.lint(
        CHART, copy.deepcopy(VALUES[name]), strict=True, namespace=NS, kube_version=LINT_KUBE_VERSION
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize(
    ("values", "where"),
    [
        ({"samplePolicyServer": {"test": {"retrySeconds": -1}}}, "/samplePolicyServer/test/retrySeconds"),
        ({"samplePolicyServer": {"test": {"timeoutSeconds": 0}}}, "/samplePolicyServer/test/timeoutSeconds"),
        ({"samplePolicyServer": {"test": {"enabled": "yes"}}}, "/samplePolicyServer/test/enabled"),
        ({"samplePolicyServer": {"test": {"image": "x"}}}, "/samplePolicyServer/test"),
    ],
)
def test_schema_rejects_bad_test_values(values: dict[str, Any], where: str) -> None:
    with pytest.raises(helm_python.HelmValuesError) as exc:
        chart().validate_schema(copy.deepcopy(values))
    assert where in str(exc.value)


def test_install_doc_shows_the_probe_and_helm_test_as_the_chart_has_them() -> None:
    text = DOCS["install.md"]
    lines = code_lines(text)
    assert any(line.startswith("helm test ") and "--logs" in line for line in lines)
    probes = [line for line in lines if line.startswith("policyserver probe ")]
    assert probes and all(cli.build_parser().parse_args(line.split()[1:]).command == "probe" for line in probes)
    defaults = chart().values["samplePolicyServer"]
    assert f"`samplePolicyServer.test.retrySeconds` ({defaults['test']['retrySeconds']} by default)" in " ".join(
        text.split()
    )
    assert f"ws://{defaults['name']}.NAMESPACE.svc:{C.DEFAULT_PORT}" in text
    # the example output is the probe's own format
    from policy_operator.runtime.probe import ProbeResult

    ok_line = next(line for line in text.splitlines() if line.startswith("ok ws://"))
    assert (
        ProbeResult(
            "ws://127.0.0.1:8000",
            ok=True,
            policy="reference-flow-policy",
            layout="cfgp=2,dp=1",
            action_shape=(16, 8),
            latency_ms=41.7,
        ).line()
        == ok_line
    )
