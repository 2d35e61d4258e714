"""docs/architecture.md's one-rank request path numbers are the code's: bench/request_path.py --front-end, measured.

A real one-rank server with ``--frontend inline`` and with ``--frontend
process``, one request traced through every process (the bench script's own
tracer), counted as the document counts it.  The counts move by a hop or two
with timing (whether the routing snapshot is refreshed on this request), so
each must lie within ``SLACK`` of the documented one; a change that adds or
removes a step of the path fails here until the table says so.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SLACK_HOPS = 4
ROW = re.compile(
    r"^\| `--frontend (inline|process)` \|.*\| (\d+) hops \((\d+) entered from another file\), (\d+) files, "
    r"(\d+) crossings \|$",
    re.MULTILINE,
)


def documented() -> dict[str, tuple[int, int, int]]:
    """Per mode, the "now" column: (hops, entered from another file, files)."""
    text = (REPO / "docs" / "architecture.md").read_text()
    return {m.group(1): (int(m.group(2)), int(m.group(3)), int(m.group(4))) for m in ROW.finditer(text)}


def test_the_document_has_both_rows() -> None:
    assert set(documented()) == {"inline", "process"}


@pytest.mark.slow  # two servers, traced
def test_the_documented_request_path_is_the_measured_one() -> None:
    pytest.importorskip("openpi_client")
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    sys.path.insert(0, str(REPO / "bench"))
    try:
        import request_path  # bench/request_path.py
    finally:
        sys.path.remove(str(REPO / "bench"))
    measured = request_path.front_end_paths(WebsocketClientPolicy)
    for mode, (hops, entered, files) in documented().items():
        got = measured[mode]
        assert abs(got["hops"] - hops) <= SLACK_HOPS, (mode, got["hops"], hops)
        assert abs(got["module_hops"] - entered) <= SLACK_HOPS, (mode, got["module_hops"], entered)
        assert abs(len(got["files"]) - files) <= 1, (mode, got["files"], files)
