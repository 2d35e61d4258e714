"""The compile-artifacts file on the cache volume, without torch: the runtime writes it, ``prune`` reads its key.

A file is ``MAGIC``, one JSON header line (the key, the payload's size and
sha256) and the payload (``runtime/compile_cache.py`` says what the key holds
and why).  Its checkpoint is named by ``checkpoint_identity`` -- a digest of the
checkpoint's contents, not of its cache key -- so ``policyserver checkpoint
prune``, which runs in the torch-free fetch image, can tell which files belong
to checkpoints it removes: their artifacts go with them instead of piling up in
``<cache>/.compile`` at every change of checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_operator.constants import CONFIG_FILE, MANIFEST_FILE

MAGIC = b"policy-operator compile artifacts v1\n"
SUFFIX = ".artifacts"
MAX_HEADER_BYTES = 64 << 10


class ArtifactError(ValueError):
    """A cache file that must not be loaded; the message says why, in a few words."""


def checkpoint_identity(checkpoint: str | os.PathLike[str]) -> str:
    """A digest naming the checkpoint's contents: its manifest (every file's sha256) when it has one, else the
    names, sizes and modification times of its files (a plug-in's own checkpoint layout)."""
    root = Path(checkpoint)
    digest = hashlib.sha256()
    manifest = root / MANIFEST_FILE
    if manifest.is_file():
        digest.update(manifest.read_bytes())
        return digest.hexdigest()
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        stat = path.stat()
        digest.update(f"{path.relative_to(root).as_posix()}\0{stat.st_size}\0{stat.st_mtime_ns}\n".encode())
    if (root / CONFIG_FILE).is_file():
        digest.update((root / CONFIG_FILE).read_bytes())
    return digest.hexdigest()


def path_for(directory: Path, key: Mapping[str, str]) -> Path:
    """The file of ``key`` under ``directory``: one per key."""
    digest = hashlib.sha256(json.dumps(dict(key), sort_keys=True).encode()).hexdigest()[:32]
    return directory / f"{digest}{SUFFIX}"


def encode(key: Mapping[str, str], payload: bytes) -> bytes:
    header = {"key": dict(key), "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def _header(data: bytes) -> tuple[dict[str, Any], int, str, int]:
    """(key, payload size, payload sha256, where the header line ends) of a file's first bytes."""
    if not data.startswith(MAGIC):
        raise ArtifactError("not a compile-artifacts file")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
    if end < 0:
        raise ArtifactError("no header")
    try:
        header = json.loads(data[len(MAGIC) : end])
        key, size, sha256 = header["key"], int(header["bytes"]), str(header["sha256"])
        if not isinstance(key, dict):
            raise TypeError("key")
    except (ValueError, KeyError, TypeError) as exc:
        raise ArtifactError(f"unreadable header ({type(exc).__name__})") from None
    return key, size, sha256, end


def decode(data: bytes, key: Mapping[str, str]) -> bytes:
    """The payload of a cache file written for ``key``; ArtifactError when it is not one, intact."""
    stored_key, size, sha256, end = _header(data)
    if stored_key != dict(key):
        changed = sorted(k for k in set(stored_key) | set(key) if stored_key.get(k) != key.get(k))
        raise ArtifactError(f"written for another spec ({', '.join(changed)} differ)")
    payload = data[end + 1 :]
    if len(payload) != size:
        raise ArtifactError(f"truncated ({len(payload)} of {size} bytes)")
    if hashlib.sha256(payload).hexdigest() != sha256:
        raise ArtifactError("checksum mismatch")
    return payload


def stored_checkpoint(path: Path) -> str | None:
    """The ``checkpoint_identity`` a file's header names, reading only the header; None when it has none (not
    an artifacts file, unreadable, or a key without one)."""
    try:
        with path.open("rb") as f:
            head = f.read(len(MAGIC) + MAX_HEADER_BYTES + 1)
        checkpoint = _header(head)[0].get("checkpoint")
    except (OSError, ArtifactError):
        return None
    return checkpoint if isinstance(checkpoint, str) else None
