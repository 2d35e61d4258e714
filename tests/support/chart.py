"""The Helm chart as the chart tests load it: where it is, the release it is rendered as, the examples it ships.

Shared by tests/test_chart*.py and tests/test_dashboard.py, so no test module
imports another.  ``chart()`` loads the chart once per session through Helm's
own engine (helm-python-sdk).
"""

from __future__ import annotations

import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import helm_python
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "policy-operator"
RELEASE, NS = "po", "robots"
K8S_VERSIONS = ("1.32.0", "1.37.0")
LINT_KUBE_VERSION = "v1.32.0"
EXAMPLES: dict[str, dict[str, Any]] = {
    p.name: yaml.safe_load(p.read_text()) for p in sorted((REPO / "examples").glob("policyserver-*.yaml"))
}
DOCS = {name: (REPO / "docs" / name).read_text() for name in ("install.md", "upgrades.md")}


@lru_cache(maxsize=1)
def chart() -> helm_python.Chart:
    return helm_python.Chart.load(CHART)


def code_lines(text: str) -> list[str]:
    """The command lines of a Markdown text's code blocks: continuations joined, trailing ``  #`` comments cut."""
    blocks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.M | re.S)
    lines, pending = [], ""
    for block in blocks:
        for line in block.splitlines():
            line = line.split("  #")[0].rstrip()
            if line.endswith("\\"):
                pending += line[:-1] + " "
                continue
            lines.append((pending + line).strip())
            pending = ""
    return [line for line in lines if line]
