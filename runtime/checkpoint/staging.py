"""How the fetch opens the files it writes: each one a fresh inode with one name, never another file's.

Anyone who can write to the cache volume can plant a name in the staging
directory before a fetch runs: a symlink, or a hard link to a file outside
DEST (a hard link needs no write access to its target's directory, only to
the file).  Writing through such a name would overwrite the outside file
with the checkpoint's bytes, and publishing it would make a served file that
someone else may still change.  So a file is only ever *created* here
(``O_CREAT | O_EXCL | O_NOFOLLOW``, after unlinking whatever had the name),
appended to only when it is a regular file with a link count of 1, and a
tree is published only when none of its files has another name.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path
from typing import BinaryIO

_NEW = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_COPY_CHUNK = 1 << 30


def create_new(path: Path) -> BinaryIO:
    """``path`` opened for writing as a new, empty inode; a file, link or hard link of that name is unlinked first."""
    path.unlink(missing_ok=True)
    return os.fdopen(os.open(path, _NEW, 0o644), "wb")


def open_own(path: Path) -> BinaryIO | None:
    """``path`` opened for appending when it is a regular file with no other name, else None (start it afresh)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ELOOP, errno.EISDIR, errno.ENXIO):
            return None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        return None
    return os.fdopen(fd, "ab")


def has_other_names(path: Path) -> bool:
    """A regular file that is also reachable under another name (a hard link), which must not be written or published."""
    try:
        st = path.lstat()
    except FileNotFoundError:
        return False
    return stat.S_ISREG(st.st_mode) and st.st_nlink > 1


def copy_new(src: Path, dst: Path) -> None:
    """Copy ``src`` into a new inode at ``dst`` (``copy_file_range``: a reflink where the filesystem has them)."""
    with open(src, "rb") as fin, create_new(dst) as fout:
        try:
            while os.copy_file_range(fin.fileno(), fout.fileno(), _COPY_CHUNK):
                pass
        except OSError as exc:  # another filesystem or an old kernel: copy the rest by reading
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM):
                raise
            shutil.copyfileobj(fin, fout, 4 << 20)
