"""The completion marker ``DEST/<key>/.complete.json`` and the check that trusts contents, not flags.

The marker is written inside the staging directory before the rename that
publishes it, so a directory with a marker was complete when it appeared.  But a
volume outlives the Job that filled it — a node crash, an ``rm`` by hand, a
half-restored backup — so readers do not take the marker's word for it:
``check_complete`` compares every recorded file's size (and, on request, its
sha256) with what is on disk.  That is the difference from a status flag on a CR.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from policy_operator.constants import COMPLETE_MARKER, MANIFEST_FILE
from policy_operator.runtime.checkpoint.format import CheckpointError, parse_manifest, sha256_file
from policy_operator.runtime.checkpoint.staging import create_new

MARKER_FORMAT = "policy-fetch/v1"


def read_marker(directory: str | os.PathLike[str]) -> dict | None:
    """The marker's contents, or None when there is none (or it is unreadable: not complete)."""
    try:
        doc = json.loads(Path(directory, COMPLETE_MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(doc, dict) or doc.get("format") != MARKER_FORMAT or not isinstance(doc.get("files"), dict):
        return None
    return doc


def write_marker(directory: Path, doc: dict) -> None:
    """Write the marker atomically and durably (fsync file, then directory)."""
    tmp = directory / (COMPLETE_MARKER + ".tmp")
    with create_new(tmp) as f:
        f.write((json.dumps(doc, indent=2, sort_keys=True) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / COMPLETE_MARKER)
    fsync_path(directory)


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (a rename is durable only once its directory is synced)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def make_marker(
    *, key: str, source: str, revision: str | None, resolved_revision: str | None, files: dict[str, dict[str, object]]
) -> dict:
    return {
        "format": MARKER_FORMAT,
        "key": key,
        "source": source,
        "revision": revision,
        "resolved_revision": resolved_revision,
        "files": files,
        "bytes": sum(int(e["size"]) for e in files.values()),  # type: ignore[call-overload]
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def check_complete(directory: str | os.PathLike[str], verify: bool = False) -> dict:
    """Return the marker of a fetched directory whose files still match it; else raise CheckpointError.

    Sizes are always checked (cheap); sha256 only with ``verify`` (reads every
    byte).  A manifest.json in the directory must agree with the marker too, so a
    checkpoint edited after its manifest was written is caught here.
    """
    root = Path(directory)
    if not root.is_dir():
        raise CheckpointError(f"{root}: no such directory (checkpoint not fetched)")
    marker = read_marker(root)
    if marker is None:
        raise CheckpointError(f"{root}: no valid {COMPLETE_MARKER}; the fetch did not finish here")
    problems = []
    for name, entry in sorted(marker["files"].items()):
        path = root / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{name}: missing")
            continue
        if size != entry.get("size"):
            problems.append(f"{name}: size {size} != {entry.get('size')} recorded in {COMPLETE_MARKER}")
        elif verify and sha256_file(path) != entry.get("sha256"):
            problems.append(f"{name}: sha256 differs from {entry.get('sha256')} recorded in {COMPLETE_MARKER}")
    if MANIFEST_FILE in marker["files"] and not problems:
        for e in parse_manifest((root / MANIFEST_FILE).read_bytes()):
            recorded = marker["files"].get(e.name)
            if recorded is None or recorded.get("sha256") != e.sha256 or recorded.get("size") != e.size:
                problems.append(f"{e.name}: {MANIFEST_FILE} and {COMPLETE_MARKER} disagree")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(f"{root}: incomplete or changed since fetched: {'; '.join(problems[:3])}{more}")
    return marker
