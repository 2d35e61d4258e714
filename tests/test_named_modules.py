"""Every project module named outside Python exists: a Dockerfile's import check, a script's import, the chart's
generated-from note, a doc's reference.

Python imports are checked by the interpreter and the linters; these names are strings that nothing imports
until an image is built or a script runs on a device.  runtime/Dockerfile's build check imported
``policy_operator.runtime.serving.ingress`` after that module had become ``serving/admission.py`` and
``serving/server.py``: every ``docker build`` of the runtime image failed at that line, and no test ran it.
``bench/results/`` is left out: each result records the tree it measured.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOTTED = re.compile(r"\bpolicy_operator(?:\.[A-Za-z_][A-Za-z_0-9]*)+")
PATTERNS = ("**/Dockerfile", "**/*.sh", "Makefile", "**/*.md", "**/*.yaml", "**/*.tpl", "pyproject.toml")
SKIPPED = ("bench/results/", ".venv/", ".cache/", ".git/", "node_modules/")


def _files() -> list[Path]:
    found: set[Path] = set()
    for pattern in PATTERNS:
        for path in REPO.glob(pattern):
            rel = path.relative_to(REPO).as_posix()
            if path.is_file() and not rel.startswith(SKIPPED) and not rel.startswith("."):
                found.add(path)
    return sorted(found)


def _named() -> list[tuple[str, str]]:
    return sorted(
        {(path.relative_to(REPO).as_posix(), name) for path in _files() for name in DOTTED.findall(path.read_text())}
    )


def _resolve(name: str) -> object:
    """The module ``name`` names, or the attribute: the longest importable prefix, then getattr for the rest."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        module_name = ".".join(parts[:i])
        try:
            spec = importlib.util.find_spec(module_name)
        except ModuleNotFoundError:
            spec = None
        if spec is not None:
            obj: object = importlib.import_module(module_name)
            for attr in parts[i:]:
                obj = getattr(obj, attr)  # AttributeError names what is missing
            return obj
    raise ModuleNotFoundError(name)


NAMED = _named()


def test_the_scan_finds_the_names_the_images_and_the_chart_depend_on() -> None:
    """The scan reads the files that matter: without this a pattern that matched nothing would pass every case."""
    where = {(path, name) for path, name in NAMED}
    assert ("runtime/Dockerfile", "policy_operator.runtime.worker") in where
    assert ("operator/Dockerfile", "policy_operator.operator.handlers") in where
    assert ("charts/policy-operator/templates/rbac.yaml", "policy_operator.operator.rbac.RULES") in where


@pytest.mark.parametrize(("path", "name"), NAMED, ids=[f"{p}:{n}" for p, n in NAMED])
def test_every_named_module_or_attribute_exists(path: str, name: str) -> None:
    try:
        _resolve(name)
    except (ModuleNotFoundError, AttributeError) as exc:
        pytest.fail(f"{path} names {name}, which does not exist ({exc})")


def test_a_missing_module_or_attribute_is_reported() -> None:
    with pytest.raises(AttributeError, match="ingress"):  # a package without that module
        _resolve("policy_operator.runtime.serving.ingress")
    with pytest.raises(ModuleNotFoundError):
        _resolve("policy_operatr.runtime")
    with pytest.raises(AttributeError):
        _resolve("policy_operator.operator.rbac.NO_SUCH_RULES")
    assert _resolve("policy_operator.operator.rbac.RULES")
