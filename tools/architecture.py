"""The generated parts of docs/architecture.md and docs/operator.md, and the code-shape numbers they quote.

The module tables are the first line of each module's docstring, so a module
added, removed or renamed shows up in the docs by running ``make docs``
(tests/test_architecture_doc.py fails while they are stale, like the CRD
docs).  ``--measure`` prints the import-linter layers and the longest
functions; ``--root DIR`` measures another tree (a ``git archive`` of an
older commit), which is how the before/after table was made.
"""

from __future__ import annotations

import argparse
import ast
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# folder -> import name (pyproject's package-dir)
PACKAGES = {
    "policy_operator": "policy_operator",
    "runtime": "policy_operator.runtime",
    "operator": "policy_operator.operator",
}
BEGIN, END = "<!-- modules:begin ({}) -->", "<!-- modules:end -->"
# doc -> the folders whose module table it carries
TABLES = {"docs/architecture.md": ("policy_operator", "runtime", "operator"), "docs/operator.md": ("operator",)}


@dataclass(frozen=True)
class Module:
    path: str  # relative to the repository root
    summary: str  # the docstring's first line


def modules(root: Path, folders: tuple[str, ...]) -> Iterator[Module]:
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py"), key=lambda p: (len(p.relative_to(root).parts), str(p))):
            if path.name == "__init__.py" and path.parent != root / folder:
                continue  # a subpackage: its __init__ is its row, listed before its modules by the sort
            doc = ast.get_docstring(ast.parse(path.read_text()))
            yield Module(str(path.relative_to(root)), (doc or "").strip().splitlines()[0] if doc else "")


def table(root: Path, folders: tuple[str, ...]) -> str:
    rows = ["| module | what it is for (its docstring's first line) |", "|---|---|"]
    for m in modules(root, folders):
        rows.append(f"| `{m.path}` | {m.summary.replace('|', '\\|') or '**no docstring**'} |")
    return "\n".join(rows)


def rendered(doc_text: str, root: Path, folders: tuple[str, ...]) -> str:
    """``doc_text`` with the table between its markers replaced by the current one."""
    begin = BEGIN.format(", ".join(folders))
    head, sep, rest = doc_text.partition(begin)
    if not sep:
        raise SystemExit(f"marker {begin!r} missing")
    _, sep, tail = rest.partition(END)
    if not sep:
        raise SystemExit(f"marker {END!r} missing")
    return f"{head}{begin}\n{table(root, folders)}\n{END}{tail}"


def stale(root: Path = REPO) -> list[str]:
    return [
        doc
        for doc, folders in TABLES.items()
        if rendered((root / doc).read_text(), root, folders) != (root / doc).read_text()
    ]


def write(root: Path = REPO) -> None:
    for doc, folders in TABLES.items():
        (root / doc).write_text(rendered((root / doc).read_text(), root, folders))


# --- measures --------------------------------------------------------------------------------------------------------


def layers(root: Path) -> list[tuple[str, list[str]]]:
    """(contract name, layers top to bottom) of every import-linter layers contract in pyproject.toml."""
    config = tomllib.loads((root / "pyproject.toml").read_text()).get("tool", {}).get("importlinter", {})
    return [(c["name"], list(c["layers"])) for c in config.get("contracts", []) if c.get("type") == "layers"]


def functions(root: Path) -> list[tuple[int, str]]:
    """(lines, "path:name") of every function and method of the product code (not tests, not bench)."""
    out = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.end_lineno is not None:
                    out.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(root)}:{node.name}"))
    return sorted(out, reverse=True)


def measure(root: Path, top: int) -> str:
    lines = []
    for name, stack in layers(root):
        lines.append(f"{name}: {len(stack)} layers, top to bottom: {' / '.join(stack)}")
    if not lines:
        lines.append("no import-linter layers contract")
    found = functions(root)
    lines.append(f"{len(found)} functions; the {top} longest (lines):")
    lines += [f"  {n:4d}  {where}" for n, where in found[:top]]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the module tables of the docs")
    parser.add_argument("--check", action="store_true", help="exit 1 if a module table is stale")
    parser.add_argument("--measure", action="store_true", help="print the layers and the longest functions")
    parser.add_argument("--root", type=Path, default=REPO, help="the tree to read (default: this repository)")
    parser.add_argument("--top", type=int, default=8, help="how many of the longest functions (default 8)")
    args = parser.parse_args(argv)
    if args.write:
        write(args.root)
    if args.check and (docs := stale(args.root)):
        print(f"stale module tables in {', '.join(docs)}: run `make docs`", file=sys.stderr)
        return 1
    if args.measure:
        print(measure(args.root, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
