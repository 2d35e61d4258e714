"""Where a checkpoint comes from: one class per URI scheme, all with the same two steps.

``list_files`` asks the source what it holds and which hashes it vouches for
(network, small); ``download`` puts the bytes of the files still missing into
the staging directory (network, large).  The caller does everything else —
locking, verifying, the marker, the rename — once, for every scheme, so a new
scheme cannot forget a step.  Modelled on KServe's storage-initializer URI
schemes.
"""

from __future__ import annotations

import glob
import hashlib
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Literal
from urllib.parse import quote, unquote, urlsplit

from policy_operator.constants import ENV_HF_ENDPOINT, MANIFEST_FILE
from policy_operator.runtime.checkpoint.errors import NotFoundError, SourceError, UsageError, redact_url
from policy_operator.runtime.checkpoint.format import CheckpointError, parse_manifest
from policy_operator.runtime.checkpoint.http import DEFAULT_PATIENCE, Patience, download_file, fetch_small, head_size
from policy_operator.runtime.checkpoint.progress_meter import Progress
from policy_operator.runtime.checkpoint.staging import copy_new, create_new
from policy_operator.source_uri import HF_SCHEME, SCHEMES, InvalidSource, check_relpath, scheme_of

_HF_REPO_TYPES = {"models": "model", "datasets": "dataset", "spaces": "space"}


@dataclass(frozen=True)
class RemoteFile:
    """One file the source holds, with what the source promises about it."""

    name: str  # relative POSIX path inside the checkpoint directory
    size: int | None
    sha256: str | None = None
    git_sha1: str | None = None  # hub files that are not in LFS are vouched for by their git blob id
    origin: str = "source"  # who vouches for the hashes, for error messages


def safe_relpath(name: str) -> str:
    """A listed name, refused (SourceError) unless it stays inside the checkpoint directory."""
    try:
        return check_relpath(name)
    except InvalidSource as exc:
        raise SourceError(f"the source lists a file outside the checkpoint: {exc}") from None


class Source(ABC):
    """One checkpoint location; ``shown`` is safe to log (no secrets)."""

    shown: str
    resolved_revision: str | None = None
    patience = DEFAULT_PATIENCE  # how long HTTP downloads keep trying (make_source sets the caller's)

    @abstractmethod
    def list_files(self) -> list[RemoteFile]: ...

    @abstractmethod
    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        """Place ``needed`` under ``staging``; return sha256 digests computed on the way, if any."""


# --- http(s) ---------------------------------------------------------------------
class HttpDirSource(Source):
    """A checkpoint directory on a plain web server: its manifest.json is the listing."""

    def __init__(self, base_url: str, token: str | None) -> None:
        self.base = base_url if base_url.endswith("/") else base_url + "/"
        self.token = token
        self.shown = redact_url(self.base)
        self._manifest: bytes | None = None

    def _url(self, name: str) -> str:
        parts = urlsplit(self.base)
        path = parts.path + quote(name)
        return parts._replace(path=path).geturl()

    def list_files(self) -> list[RemoteFile]:
        data = fetch_small(self._url(MANIFEST_FILE), token=self.token)
        try:
            entries = parse_manifest(data)
        except CheckpointError as exc:
            raise SourceError(f"{self.shown}{MANIFEST_FILE}: {exc}") from None
        self._manifest = data
        origin = f"{self.shown}{MANIFEST_FILE}"
        files = [RemoteFile(safe_relpath(e.name), e.size, e.sha256, origin=origin) for e in entries]
        files.append(
            RemoteFile(MANIFEST_FILE, len(data), hashlib.sha256(data).hexdigest(), origin="the manifest as read")
        )
        return files

    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        digests: dict[str, str] = {}
        for f in needed:
            target = staging / f.name
            if f.name == MANIFEST_FILE and self._manifest is not None:
                with create_new(target) as out:
                    out.write(self._manifest)  # the very bytes the listing came from
                progress.advance(len(self._manifest))
                digests[f.name] = hashlib.sha256(self._manifest).hexdigest()
                continue
            digests[f.name] = download_file(
                self._url(f.name), target, size=f.size, token=self.token, progress=progress, patience=self.patience
            )
        return digests


class HttpFileSource(Source):
    """A URL naming one file: the checkpoint is that file alone."""

    def __init__(self, url: str, token: str | None) -> None:
        self.url = url
        self.token = token
        self.shown = redact_url(url)
        name = unquote(PurePosixPath(urlsplit(url).path).name)
        if not name:
            raise UsageError(f"{self.shown}: names no file (end a directory URL with '/')")
        self.name = safe_relpath(name)

    def list_files(self) -> list[RemoteFile]:
        return [RemoteFile(self.name, head_size(self.url, token=self.token), origin=self.shown)]

    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        return {
            f.name: download_file(
                self.url, staging / f.name, size=f.size, token=self.token, progress=progress, patience=self.patience
            )
            for f in needed
        }


def http_source(url: str, token: str | None) -> Source:
    """A path ending in ``/`` (or naming manifest.json) is a checkpoint directory; else one file."""
    path = urlsplit(url).path
    if path.endswith("/") or path == "":
        return HttpDirSource(url, token)
    if PurePosixPath(path).name == MANIFEST_FILE:
        return HttpDirSource(url[: url.rindex(MANIFEST_FILE)], token)
    return HttpFileSource(url, token)


# --- s3 ----------------------------------------------------------------------------
class S3Source(Source):
    """``s3://bucket/prefix/`` (a checkpoint directory with manifest.json) or ``s3://bucket/key``.

    boto3 only signs: the bytes travel over presigned HTTPS GETs through the same
    resumable Range code as plain HTTP, so S3 downloads resume the same way.
    """

    def __init__(self, url: str) -> None:
        try:
            import boto3
        except ImportError:
            raise UsageError(
                f"{url}: s3:// sources need boto3, which is not installed in this image "
                "(pip install boto3), or serve the checkpoint over http(s)://"
            ) from None
        parts = urlsplit(url)
        self.bucket, self.key = parts.netloc, parts.path.lstrip("/")
        if not self.bucket:
            raise UsageError(f"{url}: no bucket")
        self.shown = url
        self._client = boto3.client("s3")
        self._inner: Source | None = None

    def _presign(self, key: str) -> str:
        return self._client.generate_presigned_url(
            "get_object", Params={"Bucket": self.bucket, "Key": key}, ExpiresIn=6 * 3600
        )

    def _make_inner(self) -> Source:
        source: Source
        if self.key == "" or self.key.endswith("/"):
            source = _PresignedDir(self, self.key)
        else:
            source = HttpFileSource(self._presign(self.key), None)
        source.shown = self.shown
        source.patience = self.patience
        return source

    def list_files(self) -> list[RemoteFile]:
        try:
            self._inner = self._make_inner()
            return self._inner.list_files()
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - botocore: no credentials, bad region, ...; one line, exit 3
            raise SourceError(f"{self.shown}: {type(exc).__name__}: {exc}") from None

    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        assert self._inner is not None, "list_files first"
        return self._inner.download(staging, needed, progress)


class _PresignedDir(HttpDirSource):
    def __init__(self, s3: S3Source, prefix: str) -> None:
        super().__init__("https://unused.invalid/", None)
        self._s3, self._prefix = s3, prefix

    def _url(self, name: str) -> str:
        return self._s3._presign(self._prefix + name)


# --- local --------------------------------------------------------------------------
class LocalSource(Source):
    """A directory or file on a mounted volume, copied (a reflink where the filesystem has them).

    Never hard-linked: a published file must have no other name, or whoever
    can write the source could change what the pods serve after it was verified.
    """

    def __init__(self, path: Path, shown: str) -> None:
        self.path = path
        self.shown = shown

    def list_files(self) -> list[RemoteFile]:
        if self.path.is_file():
            return [RemoteFile(self.path.name, self.path.stat().st_size, origin=self.shown)]
        if not self.path.is_dir():
            raise SourceError(f"{self.shown}: no such file or directory")
        manifest = self.path / MANIFEST_FILE
        if manifest.is_file():
            origin = str(manifest)
            try:
                entries = parse_manifest(manifest.read_bytes())
            except CheckpointError as exc:
                raise SourceError(f"{origin}: {exc}") from None
            files = [RemoteFile(safe_relpath(e.name), e.size, e.sha256, origin=origin) for e in entries]
            return files + [RemoteFile(MANIFEST_FILE, manifest.stat().st_size, origin=origin)]
        files = []
        for p in sorted(self.path.rglob("*")):
            rel = p.relative_to(self.path)
            if p.is_file() and not any(part.startswith(".") for part in rel.parts):
                files.append(RemoteFile(rel.as_posix(), p.stat().st_size, origin=self.shown))
        if not files:
            raise SourceError(f"{self.shown}: directory is empty")
        return files

    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        for f in needed:
            src = self.path if self.path.is_file() else self.path / f.name
            dst = staging / f.name
            dst.parent.mkdir(parents=True, exist_ok=True)
            tmp = dst.with_name(dst.name + ".part")
            try:
                copy_new(src, tmp)
            except FileNotFoundError:
                raise SourceError(f"{src}: listed but missing") from None
            os.replace(tmp, dst)
            progress.advance(f.size or 0)
        return {}


def local_source(source: str) -> LocalSource:
    if source.startswith("file://"):
        parts = urlsplit(source)
        if parts.netloc not in ("", "localhost"):
            raise UsageError(f"{source}: file:// URLs name a local path (file:///path), not host {parts.netloc!r}")
        return LocalSource(Path(unquote(parts.path)), source)
    return LocalSource(Path(source).expanduser(), source)


# --- hugging face hub --------------------------------------------------------------
class HfSource(Source):
    """``hf://org/repo`` through huggingface_hub's own ``snapshot_download``.

    The revision is resolved to a commit first and everything after uses the
    commit, so a branch moving mid-download cannot mix two versions.  Hashes come
    from the hub's tree listing: sha256 for LFS files, the git blob id otherwise.
    huggingface_hub resumes per file, not within a file (its partial files are
    per process and discarded).  ``HF_ENDPOINT`` is read per call, not at import.
    """

    def __init__(self, repo_id: str, repo_type: str, revision: str | None, token: str | None) -> None:
        self.repo_id, self.repo_type, self.revision, self.token = repo_id, repo_type, revision, token
        prefix = "" if repo_type == "model" else f"{repo_type}s/"
        self.shown = f"{HF_SCHEME}{prefix}{repo_id}"
        self.endpoint = os.environ.get(ENV_HF_ENDPOINT) or None

    def _api(self):
        from huggingface_hub import HfApi

        return HfApi(endpoint=self.endpoint, token=self.token or None)

    def list_files(self) -> list[RemoteFile]:
        from huggingface_hub.hf_api import RepoFile

        api = self._api()
        with _hub_errors(self.shown):
            info = api.repo_info(self.repo_id, repo_type=self.repo_type, revision=self.revision)
            commit = info.sha
            if not commit:
                raise SourceError(f"{self.shown}: the hub did not say which commit {self.revision or 'main'} is")
            tree = [
                f
                for f in api.list_repo_tree(self.repo_id, repo_type=self.repo_type, revision=commit, recursive=True)
                if isinstance(f, RepoFile)
            ]
        self.resolved_revision = commit
        origin = f"{self.shown}@{commit[:12]} (hub tree)"
        files = []
        for f in tree:
            lfs = f.lfs
            files.append(
                RemoteFile(
                    safe_relpath(f.path),
                    int(f.size),
                    sha256=(lfs.sha256.lower() if lfs is not None else None),
                    git_sha1=(None if lfs is not None else f.blob_id),
                    origin=origin,
                )
            )
        return files

    def download(self, staging: Path, needed: list[RemoteFile], progress: Progress) -> dict[str, str]:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # ours is the one progress line
        meta = staging / ".cache" / "huggingface"
        for stale in (meta / "download").rglob("*.incomplete") if (meta / "download").is_dir() else ():
            stale.unlink(missing_ok=True)  # huggingface_hub never resumes these; they only take space
        base = progress.done

        def on_disk() -> int:
            total = 0
            for f in needed:
                try:
                    total += (staging / f.name).stat().st_size
                except OSError:
                    pass
            if (meta / "download").is_dir():
                total += sum(p.stat().st_size for p in (meta / "download").rglob("*.incomplete") if p.is_file())
            return base + total

        progress.poll = on_disk
        with _hub_errors(self.shown):
            snapshot_download(
                self.repo_id,
                repo_type=self.repo_type,
                revision=self.resolved_revision,
                local_dir=staging,
                cache_dir=staging / ".cache" / "hub",
                token=self.token or None,
                endpoint=self.endpoint,
                allow_patterns=[glob.escape(f.name) for f in needed],
                max_workers=4,
            )
        progress.poll = None
        progress.done = max(progress.done, on_disk())
        return {}


class _hub_errors:
    """Translate huggingface_hub / httpx errors into our exit codes, at one boundary.

    huggingface_hub's own classes decide: ``RepositoryNotFoundError`` (its ``GatedRepoError`` included: the hub
    answers 401/404 alike for a repository that is absent or hidden from the token) and ``RevisionNotFoundError``
    are a missing source (exit 6, failed at once); any other hub or transport error is an unreachable source
    (exit 3, retried).
    """

    def __init__(self, shown: str) -> None:
        self.shown = shown

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type, exc, tb) -> Literal[False]:
        if exc is None:
            return False
        from huggingface_hub.errors import HFValidationError, RepositoryNotFoundError, RevisionNotFoundError

        if isinstance(exc, HFValidationError):
            raise UsageError(f"{self.shown}: {exc}") from None
        first = " ".join(str(exc).split("\n\n")[:2]).replace("\n", " ").strip()
        if isinstance(exc, (RepositoryNotFoundError, RevisionNotFoundError)):
            raise NotFoundError(f"{self.shown}: not on the hub ({type(exc).__name__}: {first})") from None
        if _is_hub_error(exc):
            raise SourceError(f"{self.shown}: {type(exc).__name__}: {first}") from None
        return False


def _is_hub_error(exc: BaseException) -> bool:
    from huggingface_hub import errors

    hub_errors: tuple[type[BaseException], ...] = (
        errors.HfHubHTTPError,
        errors.LocalEntryNotFoundError,
        errors.OfflineModeIsEnabled,
        errors.FileMetadataError,
    )
    if isinstance(exc, hub_errors):
        return True
    module = type(exc).__module__ or ""
    return module.split(".")[0] in ("httpx", "httpx2", "httpcore")


def hf_source(source: str, revision: str | None, token: str | None) -> HfSource:
    path = source[len(HF_SCHEME) :].strip("/")
    parts = path.split("/")
    repo_type = "model"
    if len(parts) == 3 and parts[0] in _HF_REPO_TYPES:
        repo_type = _HF_REPO_TYPES[parts.pop(0)]
    if len(parts) != 2 or not all(parts):
        raise UsageError(f"{source}: expected hf://ORG/REPO[@REVISION]")
    return HfSource("/".join(parts), repo_type, revision, token)


def make_source(source: str, revision: str | None, token: str | None, patience: Patience = DEFAULT_PATIENCE) -> Source:
    """The Source for a (revision-split) source string; unknown schemes are a usage error."""
    src = _make_source(source, revision, token)
    src.patience = patience
    return src


def _make_source(source: str, revision: str | None, token: str | None) -> Source:
    scheme = scheme_of(source)
    if scheme == "hf":
        return hf_source(source, revision, token)
    if scheme in ("http", "https"):
        return http_source(source, token)
    if scheme == "s3":
        return S3Source(source)
    if scheme == "file" or (scheme == "" and source):
        return local_source(source)
    raise UsageError(
        f"{redact_url(source)}: unsupported source scheme {scheme + '://' if scheme else '(empty)'}; "
        f"supported: {', '.join(s + '://' for s in SCHEMES)}, a local path"
    )
