"""Download a checkpoint once into a shared volume: verified, resumable, race-safe.

``policyserver fetch SOURCE DEST`` puts the checkpoint in ``DEST/<key>/`` where
``key = checkpoint_key(source, revision)``, so a new checkpoint or revision lands
next to the one pods are serving, never over it.  The operator's fetch Job runs
this CLI and rank 0 of the runtime calls :func:`fetch` when no pre-filled volume
was mounted; both may run at once on the same volume, hence the lock.

Order of one fetch, and why:

1. ``DEST/<key>/.complete.json`` matches the request and the files still match
   it -> done, no network at all (idempotent Job restarts, N pods starting).
2. Take ``DEST/.fetch/<key>.lock`` (filelock): N concurrent fetchers make one
   download; the others wait and then find step 1 true.
3. List the source, reuse what the staging dir ``DEST/.fetch/<key>/`` already
   holds after checking it, download the rest (HTTP resumes inside a file).
4. Check every size and hash the source vouched for; a bad file is deleted and
   the fetch fails with exit 4, leaving no marker.
5. Write the marker inside staging, then one ``rename`` publishes the directory.

Only regular files and directories are ever published: a symlink, or a file
where a directory belongs, found at ``DEST/<key>``, ``DEST/.fetch/<key>`` or
anywhere inside staging is removed (the link, never what it points to) before
a byte is written, so a planted link cannot make the fetch write outside DEST.
A hard link (a file with a second name, possibly outside DEST) is removed the
same way, every file is written through a fresh inode (``staging.py``), and a
tree holding one is never published.

Exit codes: ``FetchExit`` in ``policy_operator/exit_codes.py`` (0 ok, 2 usage,
3 source unreachable/auth, 4 verification failed, 5 disk full, 6 hub repository or
revision not found, 1 anything else).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from policy_operator.constants import (
    COMPLETE_MARKER,
    ENV_HF_TOKEN,
    FETCH_PROGRESS_PORT,
    MANIFEST_FILE,
    PROGRESS_PATH,
)
from policy_operator.exit_codes import FetchExit, describe
from policy_operator.fetch_progress import FetchProgress
from policy_operator.runtime.checkpoint.errors import (
    DiskFullError,
    FetchError,
    SourceError,
    UsageError,
    VerificationError,
    is_disk_full,
    redact_url,
    scrub,
)
from policy_operator.runtime.checkpoint.format import CheckpointError, parse_manifest, sha256_file
from policy_operator.runtime.checkpoint.http import STALL_TIMEOUT_S, Patience
from policy_operator.runtime.checkpoint.marker import check_complete, fsync_path, make_marker, read_marker, write_marker
from policy_operator.runtime.checkpoint.progress_meter import Progress, human_bytes
from policy_operator.runtime.checkpoint.progress_server import ProgressServer
from policy_operator.runtime.checkpoint.references import fetch_references
from policy_operator.runtime.checkpoint.remotes import HfSource, RemoteFile, Source, make_source
from policy_operator.runtime.checkpoint.staging import has_other_names
from policy_operator.source_uri import HF_SCHEME, InvalidSource, checkpoint_key, split_revision
from policy_operator.tokens import read_token_file

__all__ = [
    "COMPLETE_MARKER",
    "FetchError",
    "UsageError",
    "SourceError",
    "VerificationError",
    "DiskFullError",
    "fetch",
    "read_marker",
    "check_complete",
    "add_arguments",
    "main",
]

WORK_DIR = ".fetch"  # DEST/.fetch/<key>/ (staging) and DEST/.fetch/<key>.lock, on the same volume as DEST/<key>
LOCK_REPORT_S = 30.0
_SHA256 = re.compile(r"[0-9a-fA-F]{64}")


class _Log:
    def __init__(self, enabled: bool, on_progress: Callable[[FetchProgress], None] | None = None) -> None:
        self.enabled = enabled
        self.on_progress = on_progress  # the download's progress, every few seconds, from the reporter's thread

    def __call__(self, message: str) -> None:
        if self.enabled:
            print(f"fetch: {message}", file=sys.stderr, flush=True)


def fetch(
    source: str,
    dest: str | os.PathLike[str],
    *,
    revision: str | None = None,
    sha256: dict[str, str] | None = None,
    token: str | None = None,
    verify: bool = False,
    progress: bool = True,
    stall_timeout_s: float = STALL_TIMEOUT_S,
    on_progress: Callable[[FetchProgress], None] | None = None,
) -> Path:
    """Make ``DEST/<key>/`` hold the complete, verified checkpoint and return that path.

    ``sha256`` adds expected hashes ({file name: hex}) on top of the source's own;
    ``token`` goes to the source as a bearer token (for ``hf://`` the ``HF_TOKEN``
    environment variable is the fallback; it is never sent to other hosts);
    ``verify`` re-hashes an already complete directory instead of checking sizes
    only; ``progress=False`` silences everything but errors (raised);
    ``stall_timeout_s``: an HTTP body that delivers (next to) nothing for that
    long is dropped and resumed (``Patience``); ``on_progress`` is called with
    the download's progress every few seconds (a server's own metrics).
    """
    if token is None:
        token = os.environ.get(ENV_HF_TOKEN) if str(source).startswith(HF_SCHEME) else None
    try:
        if not (math.isfinite(stall_timeout_s) and stall_timeout_s > 0):
            raise UsageError(f"--stall-timeout-s must be > 0, got {stall_timeout_s}")
        return _fetch(
            str(source),
            Path(dest),
            revision,
            dict(sha256 or {}),
            token,
            verify,
            _Log(progress, on_progress),
            Patience(stall_timeout_s=stall_timeout_s),
        )
    except FetchError as exc:
        exc.args = (scrub(str(exc), [token] if token else []),)
        raise


def _fetch(
    source: str,
    dest: Path,
    revision: str | None,
    overrides: dict[str, str],
    token: str | None,
    verify: bool,
    log: _Log,
    patience: Patience,
) -> Path:
    try:
        base, rev = split_revision(source, revision)
    except InvalidSource as exc:
        raise UsageError(str(exc)) from None
    for name, value in overrides.items():
        if not _SHA256.fullmatch(value):
            raise UsageError(f"--sha256 {name}={value}: not a 64-digit hex sha256")
    overrides = {name: value.lower() for name, value in overrides.items()}
    key = checkpoint_key(base, rev)
    final = dest / key
    shown = redact_url(base)
    if _is_complete(final, shown, rev, verify, log, quiet=True):
        log(f"{shown}: already complete in {final}")
        return final
    src = make_source(base, rev, token, patience)  # usage errors before anything touches the volume
    if rev is not None and not isinstance(src, HfSource):
        log(f"note: --revision {rev} only names the directory; {shown} has no revisions")
    work = dest / WORK_DIR
    try:
        _make_real_dir(work, log)
        with _locked(work / f"{key}.lock", key, log):
            if _is_complete(final, shown, rev, verify, log):
                log(f"{shown}: completed by another fetcher in {final}")
                return final
            _download(src, shown, rev, key, overrides, work / key, final, log)
    except OSError as exc:
        if is_disk_full(exc):
            raise DiskFullError(
                f"{dest}: no space left on device ({exc.strerror}); partial files stay in {work / key} for the next run"
            ) from None
        raise
    return final


def _is_complete(final: Path, shown: str, rev: str | None, verify: bool, log: _Log, quiet: bool = False) -> bool:
    if final.is_symlink() or (final.exists() and not final.is_dir()):
        if not quiet:
            log(f"{final} is {'a symlink' if final.is_symlink() else 'not a directory'}; fetching again")
        return False
    marker = read_marker(final)
    if marker is None:
        if final.exists() and not quiet:
            log(f"{final} has no valid {COMPLETE_MARKER}; fetching again")
        return False
    if marker.get("source") != shown or marker.get("revision") != rev:
        log(f"{final} holds {marker.get('source')}@{marker.get('revision')}, not {shown}@{rev}; fetching again")
        return False
    try:
        check_complete(final, verify=verify)
    except CheckpointError as exc:
        log(f"{exc}; fetching again")
        return False
    return True


@contextmanager
def _locked(path: Path, key: str, log: _Log) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock = FileLock(path)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"another fetch of {key} holds {path}; waiting for it")
        while True:
            try:
                lock.acquire(timeout=LOCK_REPORT_S)
                break
            except Timeout:
                log(f"still waiting for {path}")
    try:
        yield
    finally:
        lock.release()


def _expectations(f: RemoteFile, overrides: dict[str, str]) -> list[tuple[str, str]]:
    out = []
    if f.sha256:
        out.append((f.sha256.lower(), f.origin))
    if f.name in overrides:
        out.append((overrides[f.name], "--sha256"))
    return out


def git_blob_sha1(path: Path) -> str:
    """The id git gives a file's contents: how the hub vouches for files not in LFS."""
    h = hashlib.sha1(f"blob {path.stat().st_size}\0".encode())
    with open(path, "rb") as fh:
        while chunk := fh.read(4 << 20):
            h.update(chunk)
    return h.hexdigest()


def _not_a_real_dir(path: Path) -> str | None:
    """Why ``path`` may not be used as one of our directories (a link, a file...), or None."""
    if path.is_symlink():
        return "a symlink"
    if path.exists() and not path.is_dir():
        return "not a directory"
    return None


def _make_real_dir(path: Path, log: _Log) -> None:
    """``mkdir -p path``, after removing a link or a file of that name (never what a link points to)."""
    why = _not_a_real_dir(path)
    if why:
        log(f"{path} is {why}; replacing it with a directory")
        path.unlink()
    path.mkdir(parents=True, exist_ok=True)


def _links_under(root: Path) -> list[Path]:
    """Every entry under ``root`` that is not a directory or a regular file of one name: symlinks, special files,
    and hard links (a file that is also reachable from outside DEST)."""
    found = []
    for dirpath, dirs, files in os.walk(root):  # never follows links to directories
        for name in dirs + files:
            path = Path(dirpath, name)
            if path.is_symlink() or not (path.is_file() or path.is_dir()) or has_other_names(path):
                found.append(path)
    return found


def _download(
    src: Source, shown: str, rev: str | None, key: str, overrides: dict[str, str], staging: Path, final: Path, log: _Log
) -> None:
    _prepare_staging(final, staging, log)
    files = _listing(src, shown, overrides, log)
    digests, progress = _fetch_missing(src, shown, staging, files, overrides, log)
    records = _verify_staged(staging, files, digests, overrides, shown)
    _check_manifest(staging, records)
    _prune(staging, set(records))
    planted = _links_under(staging)
    if planted:  # appeared while we held the lock: someone else writes here
        raise FetchError(f"refusing to publish {staging}: {planted[0]} is a symlink, a hard link or a special file")
    _fsync_tree(staging, records)
    write_marker(
        staging,
        make_marker(key=key, source=shown, revision=rev, resolved_revision=src.resolved_revision, files=records),
    )
    os.rename(staging, final)
    fsync_path(final.parent)
    log(progress.summary(len(files), final))


def _prepare_staging(final: Path, staging: Path, log: _Log) -> None:
    """The staging directory, holding whatever an earlier run left that may still be good, and no link out."""
    for path in (final, staging):
        why = _not_a_real_dir(path)
        if why:  # e.g. a file left by hand where the checkpoint directory belongs: every rerun would fail on it
            log(f"{path} is {why}; removing it")
            path.unlink()
    if final.exists():
        # Unmarked, stale or damaged: its files may still be good, so they become staging
        # contents to be checked like any partial download instead of being fetched again.
        if staging.exists():
            shutil.rmtree(final)
        else:
            os.rename(final, staging)
            (staging / COMPLETE_MARKER).unlink(missing_ok=True)
    staging.mkdir(parents=True, exist_ok=True)
    planted = _links_under(staging)
    for path in planted:  # a write through one would land outside DEST
        path.unlink()
    if planted:
        log(
            f"removed {len(planted)} symlinks, hard links or special files from {staging}: "
            f"{', '.join(str(p.relative_to(staging)) for p in planted[:5])}"
        )


def _listing(src: Source, shown: str, overrides: dict[str, str], log: _Log) -> list[RemoteFile]:
    """What the source holds, each name once, and every --sha256 naming one of them."""
    files = src.list_files()
    names = {f.name for f in files}
    if len(names) != len(files):
        raise SourceError(f"{shown}: the listing names a file twice")
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise UsageError(
            f"--sha256 names {', '.join(unknown)}, which {shown} does not have "
            f"(it has: {', '.join(sorted(names)[:10])})"
        )
    for f in files:
        if not _expectations(f, overrides) and not f.git_sha1:
            log(
                f"warning: nothing vouches for {f.name}'s content (no manifest, no --sha256); recording its sha256 as found"
            )
    return files


def _fetch_missing(
    src: Source, shown: str, staging: Path, files: list[RemoteFile], overrides: dict[str, str], log: _Log
) -> tuple[dict[str, str], Progress]:
    """Download what staging does not already hold verified: (sha256 of each file known so far, the progress)."""
    digests, needed = _reuse_staged(staging, files, overrides, log)
    partial = sum(_part_size(staging / f.name) for f in needed)
    present = sum(f.size or 0 for f in files if f.name in digests) + partial
    total = sum(f.size or 0 for f in files)
    _check_space(staging, sum(f.size or 0 for f in needed) - partial)

    if needed:
        log(f"{shown}: {len(needed)} of {len(files)} files to download ({human_bytes(total - present)}) into {staging}")
    with Progress(
        total or None, label="fetch", initial=present, enabled=log.enabled, on_update=log.on_progress
    ) as progress:
        if needed:
            digests.update(src.download(staging, needed, progress))
    return digests, progress


def _fsync_tree(staging: Path, records: dict[str, dict[str, object]]) -> None:
    """Make every byte and directory entry durable before the marker may vouch for them.

    HTTP downloads are already synced (a no-op here); files written by
    huggingface_hub or copied from a local source are not.
    """
    for name in records:
        fd = os.open(staging / name, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for directory in {(staging / name).parent for name in records}:
        fsync_path(directory)


def _part_size(path: Path) -> int:
    try:
        return path.with_name(path.name + ".part").stat().st_size
    except OSError:
        return 0


def _reuse_staged(
    staging: Path, files: list[RemoteFile], overrides: dict[str, str], log: _Log
) -> tuple[dict[str, str], list[RemoteFile]]:
    """Keep staged files that provably match the source; everything else is (re)fetched."""
    digests: dict[str, str] = {}
    needed = []
    for f in files:
        path = staging / f.name
        if not path.is_file():
            needed.append(f)
            continue
        expected = _expectations(f, overrides)
        ok = (expected or f.git_sha1) and (f.size is None or path.stat().st_size == f.size)
        if ok:
            digest = sha256_file(path)
            ok = all(digest == want for want, _ in expected) and (not f.git_sha1 or git_blob_sha1(path) == f.git_sha1)
        if ok:
            digests[f.name] = digest
        else:
            path.unlink()
            needed.append(f)
    if digests:
        log(f"reusing {len(digests)} already downloaded and verified files from {staging}")
    return digests, needed


def _check_space(staging: Path, need: int) -> None:
    free = shutil.disk_usage(staging).free
    if need > free:
        raise DiskFullError(f"{staging.parent.parent}: {human_bytes(need)} more needed, {human_bytes(free)} free")


def _verify_staged(
    staging: Path, files: list[RemoteFile], digests: dict[str, str], overrides: dict[str, str], shown: str
) -> dict[str, dict[str, object]]:
    records: dict[str, dict[str, object]] = {}
    missing, bad = [], []
    for f in files:
        path = staging / f.name
        if not path.is_file():
            missing.append(f.name)
            continue
        size = path.stat().st_size
        if f.size is not None and size != f.size:
            bad.append(f"{f.name}: size {size} (downloaded) != {f.size} (expected, from {f.origin})")
            path.unlink()
            continue
        digest = digests.get(f.name) or sha256_file(path)
        wrong = [
            f"{f.name}: sha256 {digest} (downloaded) != {want} (expected, from {origin})"
            for want, origin in _expectations(f, overrides)
            if digest != want
        ]
        if not wrong and f.git_sha1 and (blob := git_blob_sha1(path)) != f.git_sha1:
            wrong.append(f"{f.name}: git blob sha1 {blob} (downloaded) != {f.git_sha1} (expected, from {f.origin})")
        if wrong:
            bad.extend(wrong)
            path.unlink()
            continue
        records[f.name] = {"size": size, "sha256": digest}
    if bad:
        raise VerificationError("verification failed, bad files deleted: " + "; ".join(bad))
    if missing:
        raise SourceError(
            f"{shown}: download ended without {', '.join(missing[:5])}{' and more' if len(missing) > 5 else ''}"
        )
    return records


def _check_manifest(staging: Path, records: dict[str, dict[str, object]]) -> None:
    """A manifest.json inside a hub repo or local directory must agree with what arrived."""
    if MANIFEST_FILE not in records:
        return
    try:
        entries = parse_manifest((staging / MANIFEST_FILE).read_bytes())
    except CheckpointError as exc:
        raise VerificationError(str(exc)) from None
    bad = []
    for e in entries:
        got = records.get(e.name)
        if got is None:
            bad.append(f"{e.name}: listed in {MANIFEST_FILE} but not in the source")
        elif got["size"] != e.size or got["sha256"] != e.sha256:
            bad.append(f"{e.name}: sha256 {got['sha256']} (downloaded) != {e.sha256} (expected, from {MANIFEST_FILE})")
            (staging / e.name).unlink(missing_ok=True)
    if bad:
        raise VerificationError("verification failed: " + "; ".join(bad))


def _prune(staging: Path, keep: set[str]) -> None:
    """Drop partials, tool metadata (huggingface_hub's .cache) and files the source no longer lists."""
    shutil.rmtree(staging / ".cache", ignore_errors=True)
    for root, dirs, filenames in os.walk(staging, topdown=False):
        for name in filenames:
            path = Path(root, name)
            if path.relative_to(staging).as_posix() not in keep:
                path.unlink()
        for name in dirs:
            try:
                Path(root, name).rmdir()
            except OSError:
                pass  # not empty: holds kept files


# --- CLI ---------------------------------------------------------------------------------
def _parse_sha256(values: list[str]) -> dict[str, str]:
    out = {}
    for value in values:
        name, sep, digest = value.rpartition("=")
        if not sep or not name:
            raise UsageError(f"--sha256 {value}: expected FILE=HASH")
        out[name] = digest
    return out


def _read_token(path: str) -> str:
    try:
        return read_token_file(path, "--token-file")
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "source",
        metavar="SOURCE",
        help="hf://ORG/REPO[@REV], http(s)://HOST/DIR/ (a directory with manifest.json) or "
        "http(s)://HOST/FILE, s3://BUCKET/PREFIX/ (needs boto3), file:///PATH or a local path",
    )
    parser.add_argument("dest", metavar="DEST", help="the shared volume; the checkpoint lands in DEST/<key>/")
    parser.add_argument("--revision", default=None, help="branch, tag or commit (hf://); part of the key for all")
    parser.add_argument(
        "--sha256",
        action="append",
        default=[],
        metavar="FILE=HASH",
        help="expected sha256 of FILE, checked on top of the source's own hashes (repeatable)",
    )
    parser.add_argument(
        "--token-file",
        default=None,
        metavar="F",
        help=f"bearer token for the source (default for hf://: ${ENV_HF_TOKEN})",
    )
    parser.add_argument(
        "--verify", action="store_true", help="re-hash an already complete directory instead of checking sizes only"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress or info lines, only errors")
    parser.add_argument(
        "--references",
        action="store_true",
        help="also fetch every hub repository the checkpoint's JSON files name (a LeRobot "
        "checkpoint's VLM and tokenizer) into DEST, and make DEST/.hub resolve them offline "
        "(HF_HUB_CACHE=DEST/.hub, HF_HUB_OFFLINE=1)",
    )
    parser.add_argument(
        "--stall-timeout-s",
        type=float,
        default=STALL_TIMEOUT_S,
        metavar="S",
        help="an HTTP body that delivers nothing (or under 1 KiB/s) for S seconds is dropped and "
        "resumed from the bytes received (default %(default)s)",
    )
    parser.add_argument(
        "--progress-port",
        type=int,
        default=None,
        metavar="PORT",
        help=f"also answer GET {PROGRESS_PATH} on PORT with the newest progress line (the operator's fetch Job "
        f"passes {FETCH_PROGRESS_PORT}; its status reads it there, not from the pod's log)",
    )
    parser.epilog = f"Prints the checkpoint directory as the last line of stdout. Exit codes: {describe(FetchExit)}."


def main(args: argparse.Namespace) -> int:
    if args.progress_port is None:
        return _main(args, None)
    with ProgressServer(args.progress_port) as server:
        return _main(args, server.update)


def _main(args: argparse.Namespace, on_progress: Callable[[FetchProgress], None] | None) -> int:
    secrets = [s for s in (os.environ.get(ENV_HF_TOKEN),) if s]
    try:
        token = _read_token(args.token_file) if args.token_file else None
        if token:
            secrets.append(token)
        path = fetch(
            args.source,
            args.dest,
            revision=args.revision,
            sha256=_parse_sha256(args.sha256),
            token=token,
            verify=args.verify,
            progress=not args.quiet,
            stall_timeout_s=args.stall_timeout_s,
            on_progress=on_progress,
        )
        if args.references:  # the hub's own token (HF_TOKEN), never the checkpoint source's
            fetch_references(
                path,
                Path(args.dest),
                log=_Log(not args.quiet),
                fetch_one=lambda source: fetch(
                    source,
                    args.dest,
                    verify=args.verify,
                    progress=not args.quiet,
                    stall_timeout_s=args.stall_timeout_s,
                    on_progress=on_progress,
                ),
            )
    except FetchError as exc:
        print(f"policyserver fetch: error: {scrub(str(exc), secrets)}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("policyserver fetch: interrupted; the next run resumes", file=sys.stderr)
        return FetchExit.INTERRUPTED
    except Exception as exc:  # noqa: BLE001 - one readable line, never a traceback with secrets
        print(
            f"policyserver fetch: unexpected error: {scrub(f'{type(exc).__name__}: {exc}', secrets)}", file=sys.stderr
        )
        return FetchExit.ERROR
    print(path)
    return FetchExit.OK


if __name__ == "__main__":
    _parser = argparse.ArgumentParser(prog="policyserver fetch", description=__doc__.splitlines()[0])
    add_arguments(_parser)
    sys.exit(main(_parser.parse_args()))
