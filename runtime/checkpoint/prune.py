"""Remove old checkpoint directories from a cache volume: ``policyserver checkpoint prune``.

A cache keeps every checkpoint it ever downloaded (``DEST/<key>/``), so after
a few switches it fills up and the next download fails with "disk full".  The
operator runs this once the StatefulSet has fully rolled to a new checkpoint
(a cleanup Job on a shared cache, an init container on a per-pod cache), so
no pod still serves from what it removes.  What it keeps:

* every ``--keep KEY`` (the checkpoint the pods now serve);
* the ``--keep-last N`` newest complete checkpoints, the kept keys counted;
* anything newer than the newest kept key: a download that finished after the
  operator decided to prune is the *next* checkpoint, not an old one;
* anything it cannot prove is a finished download (no valid marker): a
  directory being published, or one a human put there;
* the fetcher's work directory ``DEST/.fetch`` (partial downloads resume);
* every hub repository a kept checkpoint names (``references.py``: a LeRobot
  checkpoint's VLM and tokenizer, fetched next to it): a pod loads them
  offline.  Such a repository is not a checkpoint of its own: it does not
  count towards ``--keep-last``, and goes once no kept checkpoint names it.

The compile artifacts in ``DEST/.compile`` (``--compile-cache-dir`` of the
pods, ``compile_file.py``) go with their checkpoint: a file whose header names
a checkpoint no longer on the volume is removed; one whose header it cannot read
stays, as does every file of a checkpoint still there (other layouts of it
included).

A directory is removed by renaming it into ``DEST/.fetch`` first, so it stops
being a checkpoint at once (a reader sees all of it or nothing), then
deleting it, under the fetcher's own per-key lock so a fetch of the same key
never races the removal.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from collections.abc import Callable
from pathlib import Path

from policy_operator.constants import COMPILE_CACHE_DIR, COMPLETE_MARKER
from policy_operator.runtime.checkpoint.compile_file import SUFFIX, checkpoint_identity, stored_checkpoint
from policy_operator.runtime.checkpoint.fetch import WORK_DIR
from policy_operator.runtime.checkpoint.marker import read_marker
from policy_operator.runtime.checkpoint.references import referenced_keys


def _finished(directory: Path) -> float | None:
    """When a complete checkpoint was published (its marker's mtime), or None when it is not one."""
    if read_marker(directory) is None:
        return None
    try:
        return os.stat(directory / COMPLETE_MARKER).st_mtime
    except OSError:
        return None


def prunable(dest: Path, keep: set[str], keep_last: int) -> list[Path]:
    """The directories ``prune`` would remove, oldest first (pure reads)."""
    complete = {
        p.name: t for p in dest.iterdir() if p.is_dir() and p.name != WORK_DIR and (t := _finished(p)) is not None
    }
    kept_times = [complete[k] for k in keep if k in complete]
    if not kept_times:  # the serving checkpoint is not here: nothing is known to be old
        return []
    newest_kept = max(kept_times)
    named = {name: referenced_keys(dest / name) for name in complete}
    dependencies = set().union(*named.values()) - keep
    older = sorted(
        (
            (t, name)
            for name, t in complete.items()
            if name not in keep and name not in dependencies and t <= newest_kept
        ),
        reverse=True,
    )
    spare = max(0, keep_last - len(kept_times))
    removed = {name for _, name in older[spare:]}
    needed = set().union(*(named[name] for name in complete if name not in removed and name not in dependencies))
    removed |= {name for name in dependencies & complete.keys() if name not in needed and complete[name] <= newest_kept}
    return [dest / name for _, name in sorted((complete[name], name) for name in removed)]


def prune(dest: Path, keep: set[str], keep_last: int, log: Callable[[str], None] = print) -> list[str]:
    """Remove the old checkpoints, and the compile artifacts of checkpoints no longer here; the keys removed."""
    from filelock import FileLock, Timeout

    removed = []
    work = dest / WORK_DIR
    for directory in prunable(dest, keep, keep_last):
        work.mkdir(parents=True, exist_ok=True)
        lock = FileLock(work / f"{directory.name}.lock")
        try:
            lock.acquire(timeout=0)
        except Timeout:
            log(f"{directory}: a fetch of {directory.name} is running; kept")
            continue
        try:
            trash = work / f"pruning-{directory.name}"
            shutil.rmtree(trash, ignore_errors=True)
            os.rename(directory, trash)
            shutil.rmtree(trash)
        finally:
            lock.release()
        removed.append(directory.name)
        log(f"removed {directory}")
    if any(_finished(dest / key) is not None for key in keep):  # as prunable: else nothing is known to be old
        prune_artifacts(dest, log)
    return removed


def prune_artifacts(dest: Path, log: Callable[[str], None] = print) -> list[Path]:
    """Remove the compile-artifacts files of checkpoints no longer on the volume; the files removed."""
    directory = dest / COMPILE_CACHE_DIR
    if not directory.is_dir():
        return []
    present = {
        checkpoint_identity(p) for p in dest.iterdir() if p.is_dir() and p.name != WORK_DIR and _finished(p) is not None
    }
    removed = []
    for path in sorted(directory.glob(f"**/*{SUFFIX}")):  # each PolicyServer's own directory under it too
        checkpoint = stored_checkpoint(path)
        if checkpoint is None or checkpoint in present:
            continue
        try:
            path.unlink()
        except FileNotFoundError:  # another prune, or a writer's rename over it, came first
            continue
        removed.append(path)
        log(f"removed {path}: the compile artifacts of a checkpoint no longer here")
    return removed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dest", metavar="DEST", help="the cache volume (checkpoints in DEST/<key>/)")
    parser.add_argument(
        "--keep",
        action="append",
        default=[],
        metavar="KEY",
        required=True,
        help="a checkpoint key that stays (repeatable): the one the pods serve",
    )
    parser.add_argument(
        "--keep-last",
        type=int,
        default=1,
        metavar="N",
        help="keep the N newest complete checkpoints, the --keep ones counted (default 1)",
    )


def main(args: argparse.Namespace) -> int:
    dest = Path(args.dest)
    if args.keep_last < 1:
        print("policyserver: error: --keep-last must be at least 1", file=sys.stderr)
        return 2
    if not dest.is_dir():
        print(f"policyserver: error: {dest} is not a directory", file=sys.stderr)
        return 2
    removed = prune(dest, set(args.keep), args.keep_last)
    print(f"{dest}: removed {len(removed)} old checkpoint(s)" + (f": {', '.join(removed)}" if removed else ""))
    return 0
