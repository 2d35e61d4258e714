"""Hub repositories a LeRobot checkpoint names, fetched into the cache so that serving never reaches a hub.

A LeRobot pretrained directory is not self-contained.  SmolVLA's
``config.json`` names the VLM whose config and processor it builds
(``vlm_model_name``), and a saved processor pipeline's tokenizer step names
the repository of its tokenizer (``tokenizer_name``: SmolVLM's, or
PaliGemma's for pi0/pi0.5).  A server pod loads with ``HF_HUB_OFFLINE=1``, so
each of those must be on the cache volume before the pod starts.

``policyserver fetch --references`` (the fetch Job of a ``policy.type:
lerobot`` PolicyServer) therefore fetches every named repository like a
checkpoint of its own, into ``DEST/<key of hf://ORG/REPO>/`` with the same
lock, verification and marker, and records it in a read-only view of the
Hugging Face cache, ``DEST/.hub/models--ORG--REPO/`` (``refs/main`` holding
the commit, ``snapshots/<commit>`` a relative link to ``DEST/<key>``).  The
server's ``HF_HUB_CACHE`` points at that view: LeRobot and transformers
resolve ``ORG/REPO`` there, offline, with no change to their code.  A name
that no fetch can reach (a path on the machine the checkpoint was saved on)
fails the fetch with exit 2, naming the file and the key, before any server
pod exists.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from policy_operator.builtin_policies import LEROBOT_FAMILIES
from policy_operator.constants import HUB_VIEW_DIR
from policy_operator.runtime.checkpoint.errors import FetchError, UsageError
from policy_operator.runtime.checkpoint.marker import fsync_path, read_marker
from policy_operator.source_uri import HF_SCHEME, request_key

# keys whose string value LeRobot (or transformers under it) hands to from_pretrained
#: The keys naming another hub repository: LeRobot's VLM and processor-step names, and each served family's own
REFERENCE_KEYS = (
    "vlm_model_name",
    "tokenizer_name",
    "processor_name",
    *sorted({key for family in LEROBOT_FAMILIES.values() for key in family.references}),
)
DEFAULT_REF = "main"  # what from_pretrained("ORG/REPO") asks for without a revision
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_MAX_JSON_BYTES = 16 << 20


@dataclass(frozen=True)
class Reference:
    """One repository a checkpoint names: where (file and key) and which."""

    repo_id: str
    file: str
    key: str

    @property
    def source(self) -> str:
        return f"{HF_SCHEME}{self.repo_id}"

    @property
    def cache_key(self) -> str:
        """The directory the fetch puts it in, ``DEST/<cache_key>``."""
        return request_key(self.source)


def _values(doc: Any, keys: tuple[str, ...]) -> Iterator[tuple[str, Any]]:
    stack = [doc]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for k, v in node.items():
                if k in keys:
                    yield k, v
                if isinstance(v, (dict, list)):
                    stack.append(v)
        elif isinstance(node, list):
            stack.extend(v for v in node if isinstance(v, (dict, list)))


def find_references(checkpoint: Path) -> list[Reference]:
    """Every hub repository the checkpoint's JSON files name, once each; UsageError for one no fetch can reach."""
    found: dict[str, Reference] = {}
    for path in sorted(checkpoint.glob("*.json")):
        if path.name.startswith(".") or not path.is_file() or path.stat().st_size > _MAX_JSON_BYTES:
            continue
        try:
            doc = json.loads(path.read_bytes())
        except ValueError:
            continue  # not a config; nothing LeRobot would load from it either
        for key, value in _values(doc, REFERENCE_KEYS):
            if not isinstance(value, str) or not value:
                continue
            if (checkpoint / value).exists() and not value.startswith("/"):
                continue  # a directory inside the checkpoint itself
            if not _REPO_ID.match(value):
                raise UsageError(
                    f"{path.name}: {key} names {value!r}, which is not a hub repository (ORG/REPO) "
                    f"and not inside the checkpoint: the server cannot load it offline; save the "
                    f"checkpoint with {key} set to a repository the fetch can download"
                )
            found.setdefault(value, Reference(value, path.name, key))
    return list(found.values())


def repo_folder(repo_id: str) -> str:
    """huggingface_hub's cache folder name of a model repository."""
    return "models--" + repo_id.replace("/", "--")


def _replace_link(link: Path, target: str) -> None:
    tmp = link.with_name(f".{link.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    os.symlink(target, tmp)
    os.replace(tmp, link)


def _replace_text(path: Path, text: str) -> None:
    from policy_operator.runtime.checkpoint.staging import create_new

    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with create_new(tmp) as f:
        f.write(text.encode())
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def link_into_view(dest: Path, repo_id: str, key: str) -> Path:
    """Make ``DEST/.hub`` resolve ``repo_id`` (revision main) to the fetched ``DEST/<key>``; the snapshot path."""
    marker = read_marker(dest / key) or {}
    commit = str(marker.get("resolved_revision") or key)
    folder = dest / HUB_VIEW_DIR / repo_folder(repo_id)
    for sub in ("refs", "snapshots"):
        path = folder / sub
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            path.unlink()  # a planted link must not redirect what the view writes
        path.mkdir(parents=True, exist_ok=True)
    snapshot = folder / "snapshots" / commit
    if snapshot.is_dir() and not snapshot.is_symlink():
        raise FetchError(f"{snapshot} is a directory, not the fetch's link; remove it")
    _replace_link(snapshot, os.path.join("..", "..", "..", key))
    _replace_text(folder / "refs" / DEFAULT_REF, commit)
    fsync_path(folder / "refs")
    fsync_path(folder / "snapshots")
    return snapshot


def fetch_references(
    checkpoint: Path, dest: Path, *, fetch_one: Callable[[str], Path], log: Callable[[str], None] = lambda _: None
) -> list[Reference]:
    """Fetch every repository ``checkpoint`` names into ``dest`` (``fetch_one(source)``) and link it into the view.

    A failure names the file and key that asked for the repository, with the
    fetch's own exit code (a hub that does not answer is worth a retry; a
    name that is not a repository is not).
    """
    refs = find_references(checkpoint)
    for ref in refs:
        log(f"{ref.file} {ref.key} names {ref.repo_id}: fetching it for offline loading")
        try:
            path = fetch_one(ref.source)
        except FetchError as exc:
            exc.args = (f"{ref.file} {ref.key} names {ref.repo_id}, which the server needs offline: {exc}",)
            raise
        link_into_view(dest, ref.repo_id, path.name)
    return refs


def check_references(checkpoint: Path, dest: Path) -> list[Reference]:
    """Every repository ``checkpoint`` names is complete in ``dest`` and resolvable in its view, or CheckpointError."""
    from policy_operator.runtime.checkpoint.format import CheckpointError
    from policy_operator.runtime.checkpoint.marker import check_complete

    refs = find_references(checkpoint)
    for ref in refs:
        where = f"{ref.file} {ref.key} names {ref.repo_id}"
        try:
            check_complete(dest / ref.cache_key)
        except CheckpointError as exc:
            raise CheckpointError(f"{where}, not fetched: {exc}; run policyserver fetch --references") from None
        folder = dest / HUB_VIEW_DIR / repo_folder(ref.repo_id)
        try:
            commit = (folder / "refs" / DEFAULT_REF).read_text().strip()
        except OSError:
            commit = ""
        if not commit or (folder / "snapshots" / commit).resolve() != (dest / ref.cache_key).resolve():
            raise CheckpointError(f"{where}, not in {dest / HUB_VIEW_DIR}; run policyserver fetch --references")
    return refs


def referenced_keys(checkpoint: Path) -> set[str]:
    """Cache keys of the repositories ``checkpoint`` names (they stay while it is kept); none when unreadable."""
    try:
        return {ref.cache_key for ref in find_references(checkpoint)}
    except (FetchError, OSError):
        return set()
