"""Compile artifacts kept on the cache volume, so a later pod of the same spec loads them instead of compiling.

``--compile`` makes warm-up trace, lower and code-generate the denoiser once
per batch bucket: most of a fresh pod's time to Ready on a GPU, paid again by
every surge pod of a rollout and every scale-up although nothing changed.
torch's portable compile-cache artifacts (``torch.compiler.save_cache_artifacts``:
inductor's FX-graph entries with their Triton kernels, AOTAutograd entries,
autotuning results) are written after warm-up by global rank 0 to
``--compile-cache-dir``, one file per key; every rank of a later pod with the
same key loads that file before it compiles, so its warm-up hits those caches.

The key is everything that makes an artifact wrong or useless: the checkpoint
(its manifest's digest), the policy class, dtype, compile mode, batch buckets,
layout and CFG mode, torch/Triton/Python versions and the device (GPU model
and compute capability, or the CPU's vector ISA).  torch's own cache entries
are content-addressed too, so an artifact that does not fit is a miss, never
a wrong kernel.

A file is ``MAGIC``, one JSON header line (the key, the payload's size and
sha256, an HMAC-SHA256 tag) and the payload (``checkpoint/compile_file.py``, torch-free: ``policyserver
checkpoint prune`` removes a checkpoint's files with it).  One that is truncated, corrupt, of another key,
untagged or tagged under another key, or that torch refuses is ignored with one warning and the pod compiles
as if there were none (then writes a good one).

The payload is a pickle (torch's ``load_cache_artifacts`` unpickles it), so
whoever can write the directory could run code in every server that loads
from it.  ``--compile-key-file`` names this PolicyServer's own secret key (the
operator keeps it in a Secret only this PolicyServer's pods mount): a file is
written with a tag under it and loaded only when its tag verifies, before
torch sees a byte.  Without a key file, artifacts are loaded and saved only in
a directory private to this user (owned by it, writable by no group or other
user; created so when missing), and only files owned by it and writable by no
one else; otherwise the cache is off, with one warning.  Writers never corrupt the file:
each writes a temporary file of its own in the same directory and renames it
over the final name (atomic on one filesystem), so two pods writing at once
leave one complete file.  A read-only or full volume only costs the next pod
its shortcut (one warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import stat
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from policy_operator import __version__
from policy_operator.runtime.checkpoint.compile_file import ArtifactError, checkpoint_identity, decode, encode, path_for

log = logging.getLogger(__name__)

MIN_KEY_BYTES = 16  # an HMAC key shorter than this is a mistake, not a secret


def read_key(path: str) -> bytes:
    """The --compile-key-file key (surrounding whitespace stripped); ValueError (one line, no secret) otherwise."""
    try:
        secret = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ValueError(f"--compile-key-file {path}: cannot read it ({exc.strerror or exc})") from None
    if len(secret) < MIN_KEY_BYTES:
        raise ValueError(f"--compile-key-file {path}: the key is shorter than {MIN_KEY_BYTES} bytes")
    return secret


def _unshared(st: os.stat_result) -> bool:
    """Owned by this user and writable by no group or other user."""
    return st.st_uid == os.geteuid() and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def private_directory(directory: Path) -> bool:
    """Whether only this user can put files in ``directory`` (created private when missing)."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = directory.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and _unshared(st)


def device_kind(device: torch.device) -> str:
    """What generated code depends on: the GPU model and compute capability, or the CPU's architecture and ISA."""
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        return f"cuda:{torch.cuda.get_device_name(device)}:sm{major}{minor}:cuda{torch.version.cuda}"
    return f"{device.type}:{platform.machine()}:{torch.backends.cpu.get_cpu_capability()}"


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return str(getattr(triton, "__version__", "unknown"))


def cache_key(
    *,
    checkpoint: str | os.PathLike[str],
    policy: str,
    dtype: str,
    mode: str,
    buckets: Sequence[int],
    layout: str,
    cfg_mode: str,
    device: torch.device,
) -> dict[str, str]:
    """Every input that invalidates compiled artifacts, as strings (the file's header repeats it)."""
    return {
        "checkpoint": checkpoint_identity(checkpoint),
        "policy": policy,
        "dtype": dtype,
        "compile_mode": mode,
        "buckets": ",".join(map(str, buckets)),
        "layout": layout,
        "cfg_mode": cfg_mode,
        "device": device_kind(device),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "python": platform.python_version(),
        "policy_operator": __version__,
    }


TORCH_CACHE_LOGGER = "torch.compiler._cache"


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    logger = logging.getLogger(name)
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


@dataclass
class CompileCache:
    """One key's file under the cache directory: ``load`` before compiling, ``save`` after warm-up."""

    directory: Path
    key: dict[str, str]
    secret: bytes | None = None  # --compile-key-file's key; None: a private directory, files unshared
    loaded: bool = False

    @property
    def path(self) -> Path:
        return path_for(self.directory, self.key)

    def load(self) -> bool:
        """Populate torch's compile caches from the file, if there is a good one; never raises."""
        path = self.path
        try:
            with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NOFOLLOW)) as f:
                if self.secret is None and not _unshared(os.fstat(f.fileno())):
                    log.warning(
                        "compile cache: ignoring %s: another user owns it or may write it, and no "
                        "--compile-key-file authenticates it; compiling",
                        path,
                    )
                    return False
                data = f.read()
        except FileNotFoundError:
            log.info("compile cache: nothing for this spec at %s yet; compiling", path)
            return False
        except OSError as exc:
            log.warning("compile cache: ignoring %s: cannot read it (%s); compiling", path, exc.strerror or exc)
            return False
        try:
            payload = decode(data, self.key, self.secret)
            with _quiet(TORCH_CACHE_LOGGER):  # it logs a refused payload with a traceback; one line here instead
                info = torch.compiler.load_cache_artifacts(payload)
            if info is None:
                raise ArtifactError("torch could not read its artifacts")
        except ArtifactError as exc:
            log.warning("compile cache: ignoring %s: %s; compiling", path, exc)
            return False
        except Exception as exc:  # noqa: BLE001 - whatever torch makes of a bad payload, the pod compiles instead
            log.warning(
                "compile cache: ignoring %s: torch refused it (%s: %s); compiling",
                path,
                type(exc).__name__,
                str(exc).splitlines()[0][:200] if str(exc) else "",
            )
            return False
        count = sum(len(v) for v in info.artifacts.values())
        self.loaded = True
        log.info("compile cache: loaded %d artifacts (%d bytes) from %s", count, len(payload), path)
        return True

    def finish(self) -> bool:
        """After warm-up (every shape compiled): log how many graphs came from the caches, and save when this
        process had no good file (True when it wrote one)."""
        from torch._dynamo.utils import counters

        inductor = counters["inductor"]
        log.info(
            "compile cache: %d graph(s) from the cache, %d compiled",
            inductor["fxgraph_cache_hit"],
            inductor["fxgraph_cache_miss"] + inductor["fxgraph_cache_bypass"],
        )
        return self.save()

    def save(self) -> bool:
        """Write what this process compiled, atomically (temporary file + rename); never raises."""
        if self.loaded:
            return False  # the file already holds this key's artifacts
        try:
            saved = torch.compiler.save_cache_artifacts()
        except Exception as exc:  # noqa: BLE001 - the cache is a shortcut, never a reason to fail a pod
            log.warning("compile cache: could not serialize the artifacts: %s: %s", type(exc).__name__, exc)
            return False
        if saved is None or not saved[0]:
            log.info("compile cache: nothing was compiled; nothing to save")
            return False
        return self.write(saved[0])

    def write(self, payload: bytes) -> bool:
        """``payload`` as this key's file: a temporary file of this writer's own, then renamed over the final name,
        so a reader (or a second writer) never sees a partial file; never raises."""
        data = encode(self.key, payload, self.secret)
        path = self.path
        tmp: str | None = None
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=self.directory)
            if self.secret is not None:  # tagged: a pod running as another user may read it (mkstemp made it 0600)
                os.fchmod(fd, 0o644)
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
            tmp = None
        except OSError as exc:
            log.warning("compile cache: could not write %s (%s); the next pod compiles too", path, exc.strerror or exc)
            return False
        finally:
            if tmp is not None:
                try:
                    os.unlink(tmp)
                except OSError:
                    pass
        log.info("compile cache: saved %d bytes of artifacts to %s", len(data), path)
        return True


def open_cache(directory: str | None, *, key_file: str | None = None, **key: object) -> CompileCache | None:
    """The cache for this spec under ``directory`` (None: no compile cache), already loaded if it had a file;
    None with one warning when neither ``key_file`` (--compile-key-file) nor the directory's privacy
    authenticates what it holds."""
    if not directory:
        return None
    secret = None
    if key_file:
        try:
            secret = read_key(key_file)
        except ValueError as exc:
            log.warning("compile cache: off (%s)", exc)
            return None
    elif not private_directory(Path(directory)):
        log.warning(
            "compile cache: off: %s is not private to this user and no --compile-key-file authenticates its "
            "artifacts (anyone who can write there could run code in this server)",
            directory,
        )
        return None
    try:
        cache = CompileCache(Path(directory), cache_key(**key), secret)  # type: ignore[arg-type]
    except OSError as exc:  # the checkpoint's files are unreadable: loading it reports that better
        log.warning("compile cache: off (%s)", exc)
        return None
    cache.load()
    return cache


__all__ = [
    "ArtifactError",
    "CompileCache",
    "cache_key",
    "checkpoint_identity",
    "decode",
    "device_kind",
    "encode",
    "open_cache",
    "private_directory",
    "read_key",
]
