"""The generated PolicyServer CRD: committed files match the model, the schema is one Kubernetes accepts,
and every example in docs/crd.md gets the verdict the doc promises from the CRD and from the operator.

The CRD side runs offline through ``tests/support/crd_schema.py`` (defaults,
the schema as JSON Schema, the CEL rules with cel-python); a real API server
(types, CEL cost estimation, messages) is the ``cluster`` test at the end.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from policy_operator import constants as C
from policy_operator.operator import crd as G
from policy_operator.operator.kube_model import CEL_VALIDATIONS, INT_OR_STRING, PRESERVE_UNKNOWN
from policy_operator.operator.resource import PolicyServerStatus
from policy_operator.operator.spec import SpecError, parse_spec
from tests.support import crd_schema

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = sorted((REPO / "examples").glob("policyserver-*.yaml"))
DOC_EXAMPLES = G.doc_examples()


@pytest.fixture(scope="module")
def crd() -> dict[str, Any]:
    return crd_schema.load_crd(G.CRD_PATH)


@pytest.fixture(scope="module")
def schema(crd: dict[str, Any]) -> dict[str, Any]:
    return crd_schema.version_schema(crd, C.VERSION)


def parse(obj: dict[str, Any]):
    return parse_spec(obj.get("spec"), name=obj["metadata"]["name"], namespace="default")


# --- generated files -----------------------------------------------------------------------------


def test_committed_crd_and_doc_tables_are_generated_from_the_model() -> None:
    stale = G.stale_files()
    assert not stale, f"{', '.join(str(p.relative_to(REPO)) for p in stale)} differ from the model: run make crd"


def test_generator_check_mode_writes_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    doc = tmp_path / "crd.md"
    doc.write_text(G.DOC_PATH.read_text().replace("| `spec.image` |", "| `spec.imageX` |"))
    monkeypatch.setattr(G, "DOC_PATH", doc)
    monkeypatch.setattr(G, "CRD_PATH", tmp_path / "policyservers.yaml")
    monkeypatch.setattr(G, "REPO", tmp_path)
    before = doc.read_text()
    assert G.main(["--check"]) == 1 and doc.read_text() == before and not G.CRD_PATH.exists()
    assert G.main([]) == 0 and G.main(["--check"]) == 0
    assert doc.read_text() == G.render_doc(before) and G.CRD_PATH.read_text() == G.render_crd()


def test_a_doc_without_the_markers_is_an_error() -> None:
    with pytest.raises(ValueError, match="rules"):
        G.render_doc("# no markers here\n")


def test_the_chart_ships_the_generated_file_through_a_link() -> None:
    link = REPO / "charts" / "policy-operator" / "crds" / "policyservers.yaml"
    assert link.is_symlink() and link.resolve() == G.CRD_PATH.resolve()


# --- the CRD is one Kubernetes accepts ---------------------------------------------------------------


@pytest.mark.parametrize("version", ["1.32.0", "1.37.0"])
def test_crd_is_a_valid_apiextensions_object(crd: dict[str, Any], version: str) -> None:
    kubernetes_validate.validate(crd, version, strict=True)


def _nodes(node: dict[str, Any], path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = [(path or "<root>", node)]
    for name, sub in (node.get("properties") or {}).items():
        out += _nodes(sub, f"{path}.{name}")
    for key in ("items", "additionalProperties"):
        if isinstance(node.get(key), dict):
            out += _nodes(node[key], f"{path}[{key}]")
    return out


def test_schema_is_structural(schema: dict[str, Any]) -> None:
    """What the apiserver requires of a structural schema and pydantic's JSON schema would otherwise contain."""
    problems = []
    for path, node in _nodes(schema):
        if "type" not in node and not node.get(INT_OR_STRING):
            problems.append(f"{path}: no type")
        for key in ("$ref", "$defs", "title", "const", "nullable", "oneOf", "allOf"):
            if key in node:
                problems.append(f"{path}: {key}")
        if node.get("additionalProperties") is not None and (
            node.get("properties") or not isinstance(node["additionalProperties"], dict)
        ):
            problems.append(f"{path}: additionalProperties beside properties, or not a schema")
        if node.get(PRESERVE_UNKNOWN) and node.get("type") != "object":
            problems.append(f"{path}: preserve-unknown-fields on a non-object")
        if "default" in node and (path.startswith(".metadata") or node["default"] is None):
            problems.append(f"{path}: default {node['default']!r}")
    assert problems == []
    assert schema["properties"]["metadata"] == {
        "type": "object",
        "properties": {
            "name": {
                "type": "string",
                "minLength": 1,
                "maxLength": 40,
                "pattern": schema["properties"]["metadata"]["properties"]["name"]["pattern"],
            }
        },
    }


def test_every_field_has_a_description(schema: dict[str, Any]) -> None:
    """kubectl explain must say something for every field of spec and status."""
    missing = [
        path
        for path, node in _nodes(schema)
        if path.startswith((".spec", ".status")) and "[" not in path.rsplit(".", 1)[-1] and "description" not in node
    ]
    assert missing == []


def _rules(schema: dict[str, Any]) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    return [(path, node, rule) for path, node in _nodes(schema) for rule in node.get(CEL_VALIDATIONS) or ()]


def _resolve(node: dict[str, Any], dotted: str) -> dict[str, Any]:
    for part in filter(None, dotted.split(".")):
        node = node["properties"][part]
    return node


def test_every_cel_rule_compiles_and_reads_only_bounded_values(schema: dict[str, Any]) -> None:
    """The apiserver refuses a CRD whose rules may cost too much: strings and lists they walk need bounds."""
    rules = _rules(schema)
    assert len(rules) >= 10
    for path, node, rule in rules:
        crd_schema.compile_rule(rule["rule"])
        if "default" in node:  # the apiserver checks rules against a default as written, before nested defaults
            assert crd_schema.eval_rule(rule["rule"], node["default"]), (path, rule["rule"], node["default"])
        if "fieldPath" in rule:
            _resolve(node, rule["fieldPath"])  # the apiserver refuses a fieldPath the schema lacks
        walked = re.sub(r"has\(self[.\w]*\)", "", rule["rule"])  # has() reads no value
        read = [node] + [
            _resolve(node, m)
            for m in re.findall(r"self((?:\.\w+)+)", walked)
            if not m.endswith((".matches", ".startsWith", ".endsWith", ".contains", ".all", ".exists"))
        ]
        for target in read:
            if target.get("type") == "string":
                assert "maxLength" in target or "enum" in target, (path, rule["rule"])
            if target.get("type") == "array" and re.search(r"\.(all|exists)\(", rule["rule"]):
                assert "maxItems" in target, (path, rule["rule"])
            if (
                target.get("type") == "object"
                and "additionalProperties" in target
                and re.search(r"\.(all|exists)\(", rule["rule"])
            ):
                assert "maxProperties" in target, (path, rule["rule"])


def test_printer_columns_and_scale_point_at_real_fields(crd: dict[str, Any], schema: dict[str, Any]) -> None:
    version = crd["spec"]["versions"][0]
    assert version["subresources"]["status"] == {}
    scale = version["subresources"]["scale"]
    assert G.schema_at(schema, scale["specReplicasPath"])["type"] == "integer"
    assert G.schema_at(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert G.schema_at(schema, scale["labelSelectorPath"])["type"] == "string"
    columns = version["additionalPrinterColumns"]
    assert [c["name"] for c in columns][:1] == ["Ready"]
    for column in columns:
        if not column["jsonPath"].startswith(".metadata."):
            assert G.schema_at(schema, column["jsonPath"])["type"] == column["type"], column


def test_names_and_keep_annotation(crd: dict[str, Any]) -> None:
    spec = crd["spec"]
    assert crd["metadata"]["name"] == f"{C.PLURAL}.{C.GROUP}"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    assert (spec["group"], spec["names"]["kind"], spec["names"]["plural"], spec["names"]["singular"]) == (
        C.GROUP,
        C.KIND,
        C.PLURAL,
        C.SINGULAR,
    )
    # not in "all" (nor any category): `kubectl delete all --all` must leave PolicyServers alone
    assert spec["names"]["shortNames"] == [C.SHORT_NAME] and "categories" not in spec["names"]
    assert [v["name"] for v in spec["versions"]] == [C.VERSION]


# --- docs/crd.md's examples: the verdict it promises, from the CRD and from the operator -------------


def test_the_doc_has_examples_for_every_rule(schema: dict[str, Any]) -> None:
    refused = [ex for ex in DOC_EXAMPLES if ex.path]
    assert len(refused) >= 20 and any(ex.path is None for ex in DOC_EXAMPLES)
    failing = set()
    for ex in refused:
        defaulted = crd_schema.apply_defaults(schema, ex.obj)
        failing |= {
            rule["rule"]
            for _, rule, value in crd_schema.iter_rules(schema, defaulted)
            if not crd_schema.eval_rule(rule["rule"], value)
        }
    assert {rule["rule"] for _, _, rule in _rules(schema)} <= failing


@pytest.mark.parametrize("example", DOC_EXAMPLES, ids=[f"line{ex.line}-{ex.path or 'accepted'}" for ex in DOC_EXAMPLES])
def test_doc_example_verdict(crd: dict[str, Any], example: G.DocExample) -> None:
    obj = example.obj
    assert (obj["apiVersion"], obj["kind"]) == (C.API_VERSION, C.KIND)
    errors = crd_schema.validate(crd, obj)
    if example.path is None:
        assert errors == []
        parse(obj)
        return
    dotted = re.sub(r"\[(\d+)\]", r".\1", example.path)  # jsonschema's paths say spec.env.0, CEL's spec.env[0]
    parent, _, leaf = dotted.rpartition(".")
    errors = [re.sub(r"\[(\d+)\]", r".\1", e) for e in errors]
    assert any(e.startswith(f"{dotted}:") or (e.startswith(f"{parent}:") and repr(leaf) in e) for e in errors), errors
    if example.admission_only:  # inside a core/v1 object: the operator passes it on, the apiserver checks it
        parse(obj)
        return
    with pytest.raises(SpecError) as exc:
        parse(obj)
    assert exc.value.path == example.path, str(exc.value)


# --- the repository's examples and the operator's status ---------------------------------------------


def test_examples_cover_the_documented_layouts() -> None:
    layouts = {(s.layout.cfgp, s.layout.dp) for s in (parse(yaml.safe_load(p.read_text())) for p in EXAMPLES)}
    assert {(1, 1), (2, 1), (1, 2), (2, 2)} <= layouts


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_example_is_accepted_and_the_crds_defaults_are_the_models(
    crd: dict[str, Any], schema: dict[str, Any], path: Path
) -> None:
    obj = yaml.safe_load(path.read_text())
    assert crd_schema.validate(crd, obj) == []
    defaulted = crd_schema.apply_defaults(schema, obj)
    assert parse(defaulted) == parse(obj)
    # the apiserver fills in every scalar default the model has, no more
    assert defaulted["spec"]["runtime"].keys() >= {"drainGraceSeconds", "startupTimeoutSeconds", "device", "batching"}
    assert defaulted["spec"]["policy"] == {
        "type": "reference",
        "trustRemoteCode": False,
        **obj["spec"].get("policy", {}),
    }
    assert defaulted["spec"]["runtime"]["batching"].keys() == {"maxBatch", "windowMs"}  # nested defaults too


def test_status_written_by_the_operator_fits_the_model_and_the_crd(crd: dict[str, Any]) -> None:
    """Nothing the operator writes would be pruned: every key is declared in the closed status model."""
    from policy_operator.operator import download_state, rank_probe, status, workload_state

    obj = yaml.safe_load((REPO / "examples" / "policyserver-cfgp2-dp2.yaml").read_text())
    spec = parse(obj)
    ranks = tuple(rank_probe.RankHealth(r, r // 2, r % 2, "serving", True) for r in range(4))
    pods = [
        rank_probe.PodHealth("p-0", "10.0.0.1", "Running", 4, 4, True, ranks),
        rank_probe.PodHealth("p-1", None, "Pending", 4, message="verify-checkpoint: Init:Error"),
    ]
    update = status.build_status(
        spec,
        checkpoint=download_state.CheckpointState(
            download_state.CheckpointPhase.READY, download_state.Reason.DOWNLOADED, "done", "j"
        ),
        workload=workload_state.WorkloadState(
            exists=True, desired=2, current=2, serving_key=spec.checkpoint.key, template_hash="abc"
        ),
        pods=pods,
        service_exists=True,
        previous=None,
        generation=3,
        now="2025-01-01T00:00:00Z",
    )
    PolicyServerStatus.model_validate(update.document)
    assert crd_schema.validate(crd, {**obj, "status": update.document}) == []
    with pytest.raises(ValueError, match="handlerResult"):
        PolicyServerStatus.model_validate({**update.document, "handlerResult": {}})


# --- the real apiserver ------------------------------------------------------------------------------


@pytest.mark.cluster
def test_real_apiserver_installs_the_crd_and_agrees_with_the_model_on_every_doc_example(control_plane) -> None:
    """kube-apiserver (structural schema, CEL cost estimate, then each example at admission, dry-run) and
    parse_spec give every docs/crd.md example the same verdict, and a refusal names the same field."""
    cp = control_plane
    cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(G.CRD_PATH))
    cp.kubectl("wait", "--for=condition=Established", f"crd/{C.PLURAL}.{C.GROUP}", "--timeout=60s")
    namespace = "crd-doc-examples"
    cp.create_namespace(namespace)
    disagreements = []
    for example in DOC_EXAMPLES:
        result = cp.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-", input=yaml.safe_dump(example.obj), check=False
        )
        try:
            parse(example.obj)
            model = None
        except SpecError as exc:
            model = exc.path
        if example.path is None:
            ok = result.returncode == 0 and model is None
        else:
            ok = (
                result.returncode != 0
                and f"{example.path}:" in result.stderr
                and model == (None if example.admission_only else example.path)
            )
        if not ok:
            disagreements.append(
                f"line {example.line} ({example.path}): apiserver rc={result.returncode} "
                f"{result.stderr.strip()[-300:]!r}; parse_spec: {model}"
            )
    assert disagreements == []
    explained = cp.kubectl("explain", "policyserver.spec.parallelism").stdout
    assert " ".join(
        G.open_api_schema()["properties"]["spec"]["properties"]["parallelism"]["description"].split()[:6]
    ) in " ".join(explained.split())
