"""The checkpoint directory format: ``config.json`` + ``model.safetensors`` + ``manifest.json``.

The manifest lists every file with its size and sha256 so that a plain HTTP
directory (no listing API) can be fetched file by file and verified, and so a
volume's contents can be trusted by checking them rather than a status flag.
No torch here: the operator image and the fetch Job import this module too.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

from policy_operator.constants import CONFIG_FILE, MANIFEST_FILE, WEIGHTS_FILE
from policy_operator.source_uri import InvalidSource, check_relpath

MANIFEST_FORMAT = "policy-checkpoint/v1"
_CHUNK = 4 << 20


class CheckpointError(RuntimeError):
    """A checkpoint directory that is missing, incomplete or does not verify."""


@dataclass(frozen=True)
class FileEntry:
    name: str
    size: int
    sha256: str

    def as_dict(self) -> dict[str, object]:
        return {"size": self.size, "sha256": self.sha256}


def sha256_file(path: str | os.PathLike[str]) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def build_manifest(directory: str | os.PathLike[str]) -> dict[str, object]:
    """Describe every regular file under ``directory`` (except the manifest itself)."""
    root = Path(directory)
    files: dict[str, object] = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if rel == MANIFEST_FILE or rel.startswith("."):
            continue
        files[rel] = FileEntry(rel, path.stat().st_size, sha256_file(path)).as_dict()
    return {"format": MANIFEST_FORMAT, "files": files}


def write_manifest(directory: str | os.PathLike[str]) -> dict[str, object]:
    manifest = build_manifest(directory)
    Path(directory, MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return manifest


def parse_manifest(data: bytes | str) -> list[FileEntry]:
    """Entries of a manifest document; raises CheckpointError on anything malformed."""
    try:
        doc = json.loads(data)
        files = doc["files"]
        entries = [FileEntry(str(name), int(e["size"]), str(e["sha256"]).lower()) for name, e in files.items()]
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise CheckpointError(f"malformed {MANIFEST_FILE}: {exc}") from exc
    for entry in entries:
        try:
            check_relpath(entry.name)
        except InvalidSource as exc:
            raise CheckpointError(f"{MANIFEST_FILE} names a file outside the checkpoint: {exc}") from None
    return entries


def read_manifest(directory: str | os.PathLike[str]) -> list[FileEntry]:
    path = Path(directory, MANIFEST_FILE)
    if not path.is_file():
        raise CheckpointError(f"{directory} has no {MANIFEST_FILE}")
    return parse_manifest(path.read_bytes())


def check_links_stay_inside(directory: str | os.PathLike[str]) -> None:
    """Refuse a checkpoint directory holding a symbolic link that resolves outside it (a weights file linked to
    another model's, a config linked to a secret): what is served is what the directory holds.  Links within it
    are fine.  The error names the link by its place in the checkpoint, never where it points."""
    root = Path(directory).resolve()
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in (*dirnames, *filenames):
            path = Path(dirpath, name)
            if path.is_symlink() and not Path(os.path.realpath(path)).is_relative_to(root):
                raise CheckpointError(
                    f"{path.relative_to(root).as_posix()} is a symbolic link out of the checkpoint directory; "
                    "copy the file into it instead"
                )


def verify_checkpoint(directory: str | os.PathLike[str], *, hashes: bool = True) -> list[FileEntry]:
    """Check a checkpoint directory against its manifest (sizes, and hashes unless told not to); no link in it
    may lead out of it (``check_links_stay_inside``)."""
    root = Path(directory)
    check_links_stay_inside(root)
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (root / required).is_file():
            raise CheckpointError(f"{root} is not a checkpoint: {required} is missing")
    entries = read_manifest(root)
    for entry in entries:
        path = root / entry.name
        if not path.is_file():
            raise CheckpointError(f"{entry.name}: listed in {MANIFEST_FILE} but missing")
        size = path.stat().st_size
        if size != entry.size:
            raise CheckpointError(f"{entry.name}: size {size} != {entry.size} from {MANIFEST_FILE}")
        if hashes:
            digest = sha256_file(path)
            if digest != entry.sha256:
                raise CheckpointError(f"{entry.name}: sha256 {digest} != {entry.sha256} from {MANIFEST_FILE}")
    return entries
