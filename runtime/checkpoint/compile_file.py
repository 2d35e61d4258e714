"""The compile-artifacts file on the cache volume, without torch: the runtime writes it, ``prune`` reads its key.

A file is ``MAGIC``, one JSON header line (the key, the payload's size and
sha256, and the writer's HMAC-SHA256 tag over all of these) and the payload
(``runtime/compile_cache.py`` says what the key holds and why).  The payload
is a pickle that torch unpickles, so a file is only ever handed to torch once
its tag verifies under the reader's own key (``--compile-key-file``): a file
written by another PolicyServer's pod, or changed by anyone without the key,
is refused before a byte of its payload is read as anything but bytes.  A file
written without a key carries no tag; only a reader whose directory is private
to it loads one (``compile_cache.py``).  Its checkpoint is named by ``checkpoint_identity`` -- a digest of the
checkpoint's contents, not of its cache key -- so ``policyserver checkpoint
prune``, which runs in the torch-free fetch image, can tell which files belong
to checkpoints it removes: their artifacts go with them instead of piling up in
``<cache>/.compile`` at every change of checkpoint.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from policy_operator.constants import CONFIG_FILE, MANIFEST_FILE

MAGIC = b"policy-operator compile artifacts v2\n"
LEGACY_MAGICS = (b"policy-operator compile artifacts v1\n",)  # no tag: never loaded, still pruned with its checkpoint
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


def tag(secret: bytes, key: Mapping[str, str], size: int, sha256: str) -> str:
    """The HMAC-SHA256 of everything a header says (the payload through its sha256), under ``secret``."""
    signed = MAGIC + json.dumps({"key": dict(key), "bytes": size, "sha256": sha256}, sort_keys=True).encode()
    return hmac.new(secret, signed, hashlib.sha256).hexdigest()


def encode(key: Mapping[str, str], payload: bytes, secret: bytes | None = None) -> bytes:
    """A file of ``payload`` for ``key``, tagged under ``secret`` (None: untagged, for a private directory)."""
    header: dict[str, Any] = {"key": dict(key), "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()}
    if secret is not None:
        header["hmac"] = tag(secret, key, header["bytes"], header["sha256"])
    return MAGIC + json.dumps(header, sort_keys=True).encode() + b"\n" + payload


def _header(data: bytes) -> tuple[dict[str, Any], int, str, str | None, int]:
    """(key, payload size, payload sha256, tag or None, where the header line ends) of a file's first bytes."""
    if any(data.startswith(legacy) for legacy in LEGACY_MAGICS):
        raise ArtifactError("an untagged file of an older format")
    if not data.startswith(MAGIC):
        raise ArtifactError("not a compile-artifacts file")
    end = data.find(b"\n", len(MAGIC), len(MAGIC) + MAX_HEADER_BYTES)
    if end < 0:
        raise ArtifactError("no header")
    try:
        header = json.loads(data[len(MAGIC) : end])
        key, size, sha256, mac = header["key"], int(header["bytes"]), str(header["sha256"]), header.get("hmac")
        if not isinstance(key, dict) or not (mac is None or isinstance(mac, str)):
            raise TypeError("key")
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ArtifactError(f"unreadable header ({type(exc).__name__})") from None
    return key, size, sha256, mac, end


def decode(data: bytes, key: Mapping[str, str], secret: bytes | None = None) -> bytes:
    """The payload of a cache file written for ``key``; ArtifactError when it is not one, intact -- and, with
    ``secret``, tagged under it (checked first: nothing else of an unauthenticated file matters)."""
    stored_key, size, sha256, mac, end = _header(data)
    if secret is not None:
        if mac is None:
            raise ArtifactError("it has no HMAC tag (written without a --compile-key-file)")
        if not hmac.compare_digest(mac, tag(secret, stored_key, size, sha256)):
            raise ArtifactError("its HMAC tag does not verify under this server's key (another writer, or changed)")
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
        for legacy in LEGACY_MAGICS:  # same header line: pruned with its checkpoint like any other
            if head.startswith(legacy):
                head = MAGIC + head[len(legacy) :]
        checkpoint = _header(head)[0].get("checkpoint")
    except (OSError, ArtifactError):
        return None
    return checkpoint if isinstance(checkpoint, str) else None
