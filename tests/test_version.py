"""One version: pyproject.toml's, which the package reports and the chart and every example image name."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import yaml

import policy_operator

REPO = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
IMAGE = re.compile(r"ghcr\.io/policy-operator/[a-z-]+:([A-Za-z0-9._-]+)")


def test_the_package_reports_the_pyproject_version() -> None:
    assert policy_operator.__version__ == VERSION


def test_the_chart_app_version_is_the_pyproject_version() -> None:
    chart = yaml.safe_load((REPO / "charts" / "policy-operator" / "Chart.yaml").read_text())
    assert chart["appVersion"] == VERSION


def test_every_image_in_the_examples_and_docs_is_tagged_with_the_version() -> None:
    files = [*sorted((REPO / "examples").glob("*.yaml")), *sorted((REPO / "docs").glob("*.md")), REPO / "README.md"]
    tags = {(str(p.relative_to(REPO)), tag) for p in files for tag in IMAGE.findall(p.read_text())}
    assert tags, "no image reference found: the pattern no longer matches the examples"
    assert {(where, tag) for where, tag in tags if tag != VERSION} == set()


def test_make_crd_writes_the_version_where_it_is_quoted() -> None:
    """A version bump is pyproject.toml and `make crd`: the generator rewrites every quoted copy."""
    from policy_operator.operator import crd

    assert crd.CHART_PATH in crd.versioned_files()
    bumped = crd.render_version(crd.CHART_PATH.read_text(), "9.9.9")
    assert yaml.safe_load(bumped)["appVersion"] == "9.9.9"
    assert yaml.safe_load(bumped)["version"] == yaml.safe_load(crd.CHART_PATH.read_text())["version"]  # its own
    for path in crd.versioned_files():
        text = path.read_text()
        assert set(IMAGE.findall(crd.render_version(text, "9.9.9"))) <= {"9.9.9"}, path
        assert crd.render_version(text) == text, f"{path} is stale: run make crd"
