"""The PolicyServer CRD: its schema, CEL rules and defaults, and their agreement with spec.py.

Every sample goes through the same steps kube-apiserver takes (defaults,
openAPIV3Schema, CEL) and through the operator's own parser; a spec either
side accepts, the other must accept too, with the same defaults.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator.spec import SpecError, parse_spec
from tests.support import crd_schema

REPO = Path(__file__).resolve().parents[1]
CRD_PATH = REPO / "crds" / "policyservers.yaml"
EXAMPLES = sorted((REPO / "examples").glob("policyserver-*.yaml"))
K8S_VERSION = "1.32.0"


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crd_schema.load_crd(CRD_PATH)


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd_schema.version_schema(crd, C.VERSION)


def load_example(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def minimal() -> dict[str, Any]:
    return load_example(REPO / "examples" / "policyserver-minimal.yaml")


def parse(obj: dict[str, Any]):
    return parse_spec(obj.get("spec"), name=obj["metadata"]["name"], namespace="default")


# --- the CRD object itself ------------------------------------------------------------

def test_crd_is_a_valid_apiextensions_object(crd: dict[str, Any]) -> None:
    kubernetes_validate.validate(crd, K8S_VERSION, strict=True)


def test_crd_names_come_from_constants(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{C.PLURAL}.{C.GROUP}"
    assert spec["group"] == C.GROUP
    assert spec["names"]["kind"] == C.KIND
    assert spec["names"]["plural"] == C.PLURAL
    assert spec["names"]["singular"] == C.SINGULAR
    assert spec["names"]["shortNames"] == [C.SHORT_NAME]
    assert C.CATEGORY in spec["names"]["categories"]
    assert [v["name"] for v in spec["versions"]] == [C.VERSION]


def _schema_at(schema: dict[str, Any], dotted: str) -> dict[str, Any]:
    node = schema
    for part in dotted.strip(".").split("."):
        node = node["properties"][part]
    return node


def test_scale_subresource_points_at_real_fields(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    scale = version["subresources"]["scale"]
    assert _schema_at(schema, scale["specReplicasPath"])["type"] == "integer"
    assert _schema_at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert _schema_at(schema, scale["labelSelectorPath"])["type"] == "string"


def test_printer_columns_point_at_real_fields(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    assert [c["name"] for c in columns][:1] == ["Ready"]
    assert {"Ready", "Layout", "Checkpoint", "Endpoint", "Age"} <= {c["name"] for c in columns}
    for column in columns:
        if column["jsonPath"] == ".metadata.creationTimestamp":
            continue
        assert _schema_at(schema, column["jsonPath"])["type"] == column["type"], column


def test_every_field_has_a_description(schema: dict[str, Any]) -> None:
    """kubectl explain must say something for every spec field the user sets."""
    missing = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, sub in (node.get("properties") or {}).items():
            here = f"{path}.{name}"
            if "description" not in sub:
                missing.append(here)
            walk(sub, here)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema["properties"]["spec"], "spec")
    assert missing == []


def test_every_cel_rule_compiles(schema: dict[str, Any]) -> None:
    rules = list(crd_schema.all_rules(schema))
    assert len(rules) >= 7
    for rule in rules:
        crd_schema._ENV.compile(rule)


# --- samples ----------------------------------------------------------------------------

def test_examples_cover_the_documented_layouts() -> None:
    layouts = set()
    for path in EXAMPLES:
        spec = parse(load_example(path))
        layouts.add((spec.layout.cfgp, spec.layout.dp))
    assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= layouts


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_by_crd_and_operator(crd: dict[str, Any], schema: dict[str, Any], path: Path) -> None:
    obj = load_example(path)
    assert obj["apiVersion"] == C.API_VERSION and obj["kind"] == C.KIND
    assert crd_schema.validate(crd, obj) == []
    # the operator's defaults are the CRD's: parsing the defaulted object changes nothing
    assert parse(crd_schema.apply_defaults(schema, obj)) == parse(obj)


def _set(obj: dict[str, Any], dotted: str, value: Any) -> dict[str, Any]:
    obj = copy.deepcopy(obj)
    *parents, last = dotted.split(".")
    node = obj
    for part in parents:
        node = node.setdefault(part, {})
    if value is _DELETE:
        node.pop(last, None)
    else:
        node[last] = value
    return obj


_DELETE = object()

INVALID = [
    ("spec.parallelism.cfgp", 3, "cfgp"),
    ("spec.parallelism.cfgp", 0, "cfgp"),
    ("spec.parallelism.dp", 0, "dp"),
    ("spec.parallelism", {"cfgp": 2, "dp": 1}, "spec.runtime", {"guidance": 1.0}, "guidance"),
    ("spec.parallelism", {"cfgp": 2}, "spec.runtime", {"guidance": 1}, "guidance"),
    ("spec.checkpoint.source", "ftp://host/ckpt", "source"),
    ("spec.checkpoint.source", "relative/dir", "source"),
    ("spec.checkpoint.source", "", "source"),
    ("spec.checkpoint.sha256", {"model.safetensors": "abc"}, "sha256"),
    ("spec.checkpoint.fetchJob", {"backoffLimit": -1}, "backoffLimit"),
    ("spec.resources", {"limits": {"nvidia.com/gpu": 4}}, "nvidia.com/gpu"),
    ("spec.resources", {"requests": {"nvidia.com/gpu": "1"}}, "nvidia.com/gpu"),
    ("spec.runtime", {"extraArgs": ["--port", "9000"]}, "--port"),
    ("spec.runtime", {"extraArgs": ["--cfgp=2"]}, "--cfgp"),
    ("spec.runtime", {"drainGraceSeconds": 30}, "drainGraceSeconds"),
    ("spec.runtime", {"steps": 0}, "steps"),
    ("spec.runtime", {"device": "tpu"}, "device"),
    ("spec.replicas", -1, "replicas"),
    ("spec.image", _DELETE, "image"),
    ("spec.checkpoint", _DELETE, "checkpoint"),
    ("spec.service", {"type": "ExternalName"}, "type"),
    ("spec.service", {"port": 70000}, "port"),
    ("spec.storage", {"existingClaim": "mine", "storageClassName": "fast"}, "storageClassName"),
    ("spec.storage", {"accessModes": ["ReadWriteSometimes"]}, "accessModes"),
    ("spec.bogusField", 1, "bogusField"),
    ("metadata.name", "Policy_Server", "name"),
    ("metadata.name", "p" * 41, "name"),
    ("metadata.name", "1policy", "name"),
]


@pytest.mark.parametrize("case", INVALID, ids=[f"{c[0]}={c[1]!r}"[:60] for c in INVALID])
def test_invalid_spec_is_refused_by_crd_and_operator(crd: dict[str, Any], case: tuple) -> None:
    *edits, word = case
    obj = minimal()
    for field, value in zip(edits[::2], edits[1::2]):
        obj = _set(obj, field, value)
    errors = crd_schema.validate(crd, obj)
    assert errors, f"the CRD accepted {field}={value!r}"
    with pytest.raises(SpecError) as exc:
        parse(obj)
    assert word.lower() in str(exc.value).lower()


VALID = [
    ("spec.parallelism", {"cfgp": 2, "dp": 4}, "spec.runtime", {"guidance": 1.5}),
    ("spec.parallelism", {"cfgp": 2}, "spec.runtime", {"guidance": 3}),  # an integer is a number
    ("spec.parallelism", {"cfgp": 1, "dp": 8}, "spec.runtime", {"guidance": 1.0}),
    ("spec.checkpoint.source", "/srv/checkpoints/pi0", "spec.replicas", 0),
    ("spec.checkpoint.source", "file:///srv/ckpt", "spec.storage", {"existingClaim": "shared-models"}),
    ("spec.checkpoint.source", "s3://bucket/prefix/", "spec.runtime", {"extraArgs": ["--heartbeat-s", "5"]}),
    ("spec.checkpoint.source", "http://10.0.0.1/ckpt/", "spec.runtime", {"extraArgs": ["--ports=1"]}),
    ("spec.resources", {"requests": {"cpu": 4, "memory": "16Gi"}}, "spec.service", {"type": "LoadBalancer"}),
]


@pytest.mark.parametrize("edits", VALID, ids=[f"{e[0]}={e[1]!r}"[:60] for e in VALID])
def test_valid_variants_are_accepted_by_both(crd: dict[str, Any], schema: dict[str, Any], edits: tuple) -> None:
    obj = minimal()
    for field, value in zip(edits[::2], edits[1::2]):
        obj = _set(obj, field, value)
    assert crd_schema.validate(crd, obj) == []
    assert parse(crd_schema.apply_defaults(schema, obj)) == parse(obj)


def test_defaults_of_the_crd_match_the_operator(schema: dict[str, Any]) -> None:
    """Spell out the defaulted minimal spec, so a changed default is a visible diff."""
    defaulted = crd_schema.apply_defaults(schema, minimal())["spec"]
    assert defaulted["parallelism"] == {"cfgp": 1, "dp": 1}
    assert defaulted["replicas"] == 1
    assert defaulted["service"] == {"type": "ClusterIP", "port": C.DEFAULT_PORT}
    assert defaulted["runtime"] == {"guidance": 3.0, "steps": 10, "drainGraceSeconds": 20,
                                    "startupTimeoutSeconds": 600, "device": "cuda"}
    assert defaulted["storage"] == {"size": "20Gi", "retainOnDelete": False}
    assert defaulted["checkpoint"]["fetchJob"] == {"backoffLimit": 3, "ttlSecondsAfterFinished": 3600}
    spec = parse({"metadata": {"name": "p"}, "spec": defaulted})
    assert spec.runtime.guidance == 3.0 and spec.storage.size == "20Gi" and spec.service.port == C.DEFAULT_PORT


def test_status_written_by_the_operator_fits_the_schema(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    """A full status as conditions.build_status writes it passes the status schema, and nothing would be pruned."""
    from policy_operator.operator import child_status, conditions, rank_probe

    spec = parse(load_example(REPO / "examples" / "policyserver-cfgp2-dp2.yaml"))
    ranks = tuple(rank_probe.RankHealth(r, r // 2, r % 2, "serving", True) for r in range(4))
    pods = [rank_probe.PodHealth("p-0", "10.0.0.1", "Running", 4, 4, True, ranks),
            rank_probe.PodHealth("p-1", None, "Pending", 4, message="verify-checkpoint: Init:Error")]
    update = conditions.build_status(
        spec, checkpoint=child_status.CheckpointState("Ready", "Downloaded", "done", "j"),
        workload=child_status.WorkloadState(exists=True, desired=2, current=2, serving_key=spec.checkpoint.key,
                                       template_hash="abc"),
        pods=pods, service_exists=True, previous=None, generation=3, now="2025-01-01T00:00:00Z")
    obj = {**minimal(), "status": update.status}
    assert crd_schema.validate(crd, obj) == []
    status_schema = crd_schema.to_json_schema(schema["properties"]["status"])
    assert set(update.status) <= set(status_schema["properties"])
    assert set(update.status["pods"][0]) <= set(status_schema["properties"]["pods"]["items"]["properties"])


def test_every_spec_and_status_field_is_in_the_reference(schema: dict[str, Any]) -> None:
    doc = (REPO / "docs" / "crd.md").read_text()

    def documented(path: str) -> bool:
        parent, _, leaf = path.rpartition(".")
        leaf = leaf.removesuffix("[]")
        if f"`{path}" in doc:
            return True
        return bool(parent) and documented(parent) and (f"`{leaf}`" in doc or f"`.{leaf}`" in doc)

    missing = []

    def walk(node: dict[str, Any], path: str) -> None:
        for name, sub in (node.get("properties") or {}).items():
            here = f"{path}.{name}"
            if not documented(here):
                missing.append(here)
            walk(sub, here)
        if isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    for top in ("spec", "status"):
        walk(schema["properties"][top], top)
    assert missing == []
