"""The module tables of docs/architecture.md and docs/operator.md are the modules' docstrings, as `make docs` writes them.

A module added, removed or renamed, or a docstring changed, fails here until
``make docs`` has rewritten the tables (as tests/test_crd.py does for the CRD).
"""

from __future__ import annotations

from pathlib import Path

from tools import architecture

REPO = Path(__file__).resolve().parents[1]


def test_module_tables_are_current() -> None:
    assert architecture.stale(REPO) == [], "run `make docs`"


def test_every_module_has_a_docstring_for_its_row() -> None:
    missing = [
        m.path for folders in architecture.TABLES.values() for m in architecture.modules(REPO, folders) if not m.summary
    ]
    assert missing == []


def test_a_new_module_makes_the_tables_stale(tmp_path: Path) -> None:
    for doc in architecture.TABLES:
        (tmp_path / doc).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / doc).write_text((REPO / doc).read_text())
    for folder in architecture.PACKAGES:
        (tmp_path / folder).symlink_to(REPO / folder)
    architecture.write(tmp_path)  # current for this tree, whether or not the repository's docs are
    assert architecture.stale(tmp_path) == []
    (tmp_path / "operator").unlink()
    (tmp_path / "operator").mkdir()
    for path in (REPO / "operator").glob("*.py"):
        (tmp_path / "operator" / path.name).symlink_to(path)
    (tmp_path / "operator" / "new_step.py").write_text('"""A step nobody documented yet."""\n')
    assert architecture.stale(tmp_path) == ["docs/architecture.md", "docs/operator.md"]
    architecture.write(tmp_path)
    assert architecture.stale(tmp_path) == []
    assert "| `operator/new_step.py` | A step nobody documented yet. |" in (tmp_path / "docs/operator.md").read_text()
