"""Checkpoint sources as every side names them: schemes, revisions, the cache key, safe file names.

The operator validates a PolicyServer's ``checkpoint.source`` and names the
fetch Job and the pods' checkpoint directory after its key; ``policyserver
fetch`` (the Job) and rank 0 of the runtime download into that directory.  If
either side computed the key, split a revision or judged a file name
differently, a pod would wait forever for a directory nobody fills, or a
listing could write outside the volume.  So each of those facts is written
here once, torch-free and stdlib-only, and imported by both.
"""

from __future__ import annotations

import hashlib
import re
from typing import Final
from urllib.parse import urlsplit

HF_SCHEME: Final = "hf://"
# URI schemes a checkpoint may come from; anything else is a local path (absolute, for the operator).
SCHEMES: Final = ("hf", "http", "https", "s3", "file")
# What the operator accepts as ``checkpoint.source``: a supported scheme with something after it, or an
# absolute path (a volume the fetch Job mounts).  A relative path means nothing inside a pod.
SOURCE_PATTERN: Final = re.compile(rf"^(({'|'.join(SCHEMES)})://.+|/.*)$")
KEY_LENGTH: Final = 16  # hex digits: the fetch Job's name is <name>-fetch-<key>, inside a 63-character label


class InvalidSource(ValueError):
    """A source, revision or file name that no fetch may act on; ``str()`` says why, on one line."""


def scheme_of(source: str) -> str:
    """The lower-case URI scheme (``hf``, ``https``...), or ``""`` for a local path."""
    return urlsplit(source).scheme.lower() if "://" in source else ""


def check_source(source: str) -> None:
    """Refuse what the operator cannot hand to a fetch Job (the CRD's CEL rule says the same)."""
    if not SOURCE_PATTERN.match(source):
        raise InvalidSource(
            f"{source!r} has no supported scheme: use {', '.join(s + '://' for s in SCHEMES)} or an absolute path"
        )


def split_revision(source: str, revision: str | None) -> tuple[str, str | None]:
    """``hf://org/repo@rev`` -> (``hf://org/repo``, ``rev``), so both spellings share a key."""
    if source.startswith(HF_SCHEME) and "@" in source[len(HF_SCHEME) :]:
        base, _, inline = source.rpartition("@")
        if not inline:
            raise InvalidSource(f"{source}: empty revision after '@'")
        if revision is not None and revision != inline:
            raise InvalidSource(f"{source}: revision {inline!r} in the source conflicts with --revision {revision!r}")
        return base, inline
    return source, revision


def checkpoint_key(source: str, revision: str | None = None) -> str:
    """Directory name of one (source, revision) inside the shared cache volume.

    The operator names the fetch Job and the pods' checkpoint path with it and
    ``policyserver fetch`` downloads into ``DEST/<key>/``, so a checkpoint change
    lands in a new directory and never touches the one pods are serving from.
    Callers with a user's spelling use :func:`request_key`.
    """
    digest = hashlib.sha256(f"{source}\n{revision or ''}".encode()).hexdigest()
    return digest[:KEY_LENGTH]


def request_key(source: str, revision: str | None = None) -> str:
    """``checkpoint_key`` after moving an ``hf://org/repo@rev`` revision out of the source.

    What both the operator and ``policyserver fetch`` call on a source as a
    user wrote it, so ``hf://org/repo@v2`` and (``hf://org/repo``, ``v2``) are
    one checkpoint: one key, one Job, one directory.
    """
    base, rev = split_revision(source, revision)
    return checkpoint_key(base, rev)


def check_relpath(name: str) -> str:
    """A file name from a manifest, a listing or a spec, refused unless it stays inside the checkpoint.

    Refused: the empty name, absolute paths, ``..`` (escapes the directory),
    ``\\`` (a separator on Windows-made listings, and never in a name we write),
    and empty or ``.`` components (``a//b``, ``a/``, ``./a``: two spellings of
    one file would be two entries).  Returns the name unchanged.
    """
    if not name:
        raise InvalidSource(f"{name!r} is an empty file name")
    if "\\" in name:
        raise InvalidSource(f"{name!r} contains a backslash")
    if name.startswith("/"):
        raise InvalidSource(f"{name!r} is an absolute path")
    parts = name.split("/")
    if ".." in parts:
        raise InvalidSource(f"{name!r} leaves the checkpoint directory ('..')")
    if any(part in ("", ".") for part in parts):
        raise InvalidSource(f"{name!r} has an empty or '.' path component")
    return name
