"""Resumable, hashed HTTP(S) downloads with the standard library.

Why stdlib and not huggingface_hub's downloader: a plain checkpoint directory on
an HTTP server has no hub API, and since huggingface_hub 1.x partial files are
process-unique and deleted, so a killed download cannot be resumed with it.
Here a file grows in ``NAME.part`` next to a small ``NAME.part.json`` holding the
server's validator; the next run asks for ``Range: bytes=<size>-`` with
``If-Range`` so a changed file restarts from zero instead of being spliced.
The sha256 is computed while the bytes stream in, so a verified download reads
each byte from disk zero extra times.

Every download ends (``Patience``): bytes received before a dropped, reset or
stalled connection are kept and the rest is asked for with ``Range``; an
attempt counts as progress only when the file grows past the most it ever
held, so a server that ignores ``Range`` and drops at the same byte every
time fails the fetch (exit 3) after a few attempts instead of looping.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import os
import queue
import re
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO
from urllib.parse import urlsplit

from policy_operator import __version__
from policy_operator.runtime.checkpoint.errors import FetchError, SourceError, VerificationError, redact_url
from policy_operator.runtime.checkpoint.progress_meter import Progress
from policy_operator.runtime.checkpoint.staging import create_new, has_other_names, open_own

USER_AGENT = f"policyserver-fetch/{__version__}"
CHUNK = 4 << 20
TIMEOUT_S = 60.0  # connect, and the wait for a response's headers
STALL_TIMEOUT_S = 60.0  # the default of --stall-timeout-s
_CONTENT_RANGE = re.compile(r"bytes (\d+)-(\d+)/(\d+|\*)")


class _RangeNotSatisfiable(Exception):
    pass


@dataclass(frozen=True)
class Patience:
    """How long one file's download keeps trying, so that every fetch ends.

    A body that delivers less than ``min_bytes_per_s`` on average over
    ``stall_timeout_s`` (nothing at all, or a trickle) is dropped and resumed.
    ``attempts_without_progress`` attempts in a row that do not grow the file
    past the most it ever held, or ``max_attempts`` in all, end the download
    with a SourceError (exit 3): the source is not delivering, a retry of the
    Job may find it back.
    """

    stall_timeout_s: float = STALL_TIMEOUT_S
    min_bytes_per_s: int = 1024
    attempts_without_progress: int = 5
    max_attempts: int = 100

    def backoff_s(self, without_progress: int) -> float:
        """Pause before the next attempt: short after progress, growing (1, 2, 4, 8 s) without."""
        return min(2.0 ** (without_progress - 1), 8.0) if without_progress else 0.2


DEFAULT_PATIENCE = Patience()


class _Stalled(OSError):
    """The body delivered less than ``Patience`` allows over its stall window."""


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme, (parts.hostname or ""), parts.port


class _TokenRedirects(urllib.request.HTTPRedirectHandler):
    """Keep the bearer token on same-origin redirects and drop it on any other.

    The token is an *unredirected* header, so urllib never copies it; we put it
    back only when the redirect stays on the origin it was meant for (a CDN or a
    signed-URL store must never see it).
    """

    def __init__(self, token: str | None) -> None:
        self._token = token

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and self._token and _origin(req.full_url) == _origin(newurl):
            new.add_unredirected_header("Authorization", f"Bearer {self._token}")
        return new


def open_url(
    url: str,
    *,
    token: str | None = None,
    headers: dict[str, str] | None = None,
    method: str = "GET",
    timeout: float = TIMEOUT_S,
) -> http.client.HTTPResponse:
    """Open ``url``; every failure becomes a SourceError naming the (redacted) URL."""
    req = urllib.request.Request(url, method=method, headers={"User-Agent": USER_AGENT, **(headers or {})})
    req.add_header("Accept-Encoding", "identity")
    if token:
        req.add_unredirected_header("Authorization", f"Bearer {token}")
    opener = urllib.request.build_opener(_TokenRedirects(token))
    shown = redact_url(url)
    try:
        return opener.open(req, timeout=timeout)
    except urllib.error.HTTPError as exc:
        exc.close()
        if exc.code == 416:
            raise _RangeNotSatisfiable() from None
        if exc.code in (401, 403):
            hint = "a token is required" if not token else "the token was refused"
            raise SourceError(f"{shown}: HTTP {exc.code} {exc.reason} ({hint})") from None
        if exc.code == 404:
            raise SourceError(f"{shown}: HTTP 404 not found") from None
        raise SourceError(
            f"{shown}: HTTP {exc.code} {exc.reason}", retryable=exc.code >= 500 or exc.code == 429
        ) from None
    except urllib.error.URLError as exc:
        raise SourceError(f"cannot reach {shown}: {exc.reason}", retryable=True) from None
    except (OSError, http.client.HTTPException) as exc:
        raise SourceError(f"cannot reach {shown}: {exc}", retryable=True) from None


def fetch_small(url: str, *, token: str | None = None, limit: int = 64 << 20) -> bytes:
    """A small document (manifest.json) read whole into memory."""
    with open_url(url, token=token) as resp:
        data = resp.read(limit + 1)
    if len(data) > limit:
        raise SourceError(f"{redact_url(url)}: larger than {limit} bytes, not a manifest")
    return data


def head_size(url: str, *, token: str | None = None) -> int | None:
    """Content-Length from a HEAD request, or None where the server will not say."""
    try:
        with open_url(url, token=token, method="HEAD") as resp:
            length = resp.headers.get("Content-Length")
    except SourceError as exc:
        if " 405 " in str(exc) or " 501 " in str(exc):
            return None
        raise
    return int(length) if length and length.isdigit() else None


class _HashingWriter:
    """Write chunks to a file while a second thread hashes them.

    hashlib and file writes both release the GIL, so on two cores hashing
    overlaps the socket reads instead of adding to them.  Buffers cycle through
    a small pool so no chunk is copied.  A third thread ``fdatasync``s every
    ``SYNC_EVERY`` bytes, so the disk writes back while the network is still
    delivering and the final fsync (needed before the marker may claim the file)
    finds little left to do.
    """

    SYNC_EVERY = 64 << 20

    def __init__(self, f: BinaryIO, hasher: hashlib._Hash, *, buffers: int = 4) -> None:
        self._f = f
        self._hasher = hasher
        self._free: queue.Queue[bytearray] = queue.Queue()
        for _ in range(buffers):
            self._free.put(bytearray(CHUNK))
        self._full: queue.Queue[tuple[bytearray, int] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._unsynced = 0
        self._sync_wanted = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="fetch-hash", daemon=True)
        self._thread.start()
        self._syncer = threading.Thread(target=self._sync, name="fetch-sync", daemon=True)
        self._syncer.start()

    def _sync(self) -> None:
        while True:
            self._sync_wanted.wait()
            self._sync_wanted.clear()
            if self._closing:
                return
            try:
                os.fdatasync(self._f.fileno())
            except OSError:
                pass  # the final fsync reports it

    def _run(self) -> None:
        while (item := self._full.get()) is not None:
            buf, n = item
            try:
                self._hasher.update(memoryview(buf)[:n])
            except BaseException as exc:  # noqa: BLE001 - re-raised by close()
                self._error = exc
            self._free.put(buf)

    def buffer(self) -> bytearray:
        return self._free.get()

    def commit(self, buf: bytearray, n: int) -> None:
        self._f.write(memoryview(buf)[:n])
        self._full.put((buf, n))
        self._unsynced += n
        if self._unsynced >= self.SYNC_EVERY:
            self._unsynced = 0
            self._f.flush()
            self._sync_wanted.set()

    def release(self, buf: bytearray) -> None:
        self._free.put(buf)

    def close(self) -> None:
        self._full.put(None)
        self._thread.join()
        self._closing = True
        self._sync_wanted.set()
        self._syncer.join()
        if self._error is not None:
            raise self._error


def _fill(
    resp: http.client.HTTPResponse, buf: bytearray, max_wait_s: float = 0.5
) -> tuple[int, OSError | http.client.HTTPException | None]:
    """Read into ``buf`` until it is full, the body ends, the connection fails, or ``max_wait_s`` passed.

    Returns the bytes read *and* the error that ended the read, if any: the
    bytes that arrived before a reset or a read timeout are as good as any and
    must be written, not thrown away with the exception.  ``readinto`` would
    block until the whole buffer is full; on a slow link that freezes both the
    progress line and what a killed run leaves on disk.
    """
    view = memoryview(buf)
    filled = 0
    deadline = time.monotonic() + max_wait_s
    try:
        while filled < len(buf):
            data = resp.read1(len(buf) - filled)
            if not data:
                break
            view[filled : filled + len(data)] = data
            filled += len(data)
            if time.monotonic() > deadline:
                break
    except (OSError, http.client.HTTPException) as exc:
        return filled, exc
    return filled, None


class _SpeedWindow:
    """Fails a body that averages less than ``min_bytes_per_s`` over each ``window_s``."""

    def __init__(self, patience: Patience) -> None:
        self._window_s = patience.stall_timeout_s
        self._need = patience.min_bytes_per_s * patience.stall_timeout_s
        self._start = time.monotonic()
        self._bytes = 0

    def check(self, n: int) -> None:
        self._bytes += n
        elapsed = time.monotonic() - self._start
        if elapsed < self._window_s:
            return
        if self._bytes < self._need:
            raise _Stalled(f"{self._bytes} bytes in {elapsed:.0f}s")
        self._start, self._bytes = time.monotonic(), 0


def _hash_prefix(path: Path, hasher: hashlib._Hash) -> int:
    n = 0
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK):
            hasher.update(chunk)
            n += len(chunk)
    return n


def _validator(resp: http.client.HTTPResponse) -> str | None:
    etag = resp.headers.get("ETag")
    if etag and not etag.startswith("W/"):
        return etag
    return resp.headers.get("Last-Modified")


def _resume_point(
    part: Path, meta: Path, size: int | None, progress: Progress
) -> tuple[int, str | None, hashlib._Hash]:
    """Where an earlier run's ``.part`` lets this one start: (offset, its validator, the hash of its bytes).

    A part is resumed only with the validator its server gave (If-Range proves it is the same file) and never
    past the listed size; a hard link to a file elsewhere is never resumed, written or published.
    """
    for planted in (part, meta):
        if has_other_names(planted):
            planted.unlink()
    offset = part.stat().st_size if part.exists() else 0
    validator: str | None = None
    if offset and meta.exists():
        try:
            validator = json.loads(meta.read_text()).get("validator")
        except (OSError, ValueError):
            validator = None
    if offset and (size is not None and offset > size or not validator):
        part.unlink()  # longer than the file, or no way to know it is the same file
        progress.advance(-offset)
        offset = 0
    hasher = hashlib.sha256()
    if offset:
        _hash_prefix(part, hasher)
    return offset, validator, hasher


def _copy_body(
    resp: http.client.HTTPResponse, f: BinaryIO, hasher: hashlib._Hash, patience: Patience, progress: Progress
) -> tuple[int, BaseException | None]:
    """Copy one response's body into ``f`` (hashed, fsynced): (bytes received, why it ended early or None).

    What arrived before a drop or a stall is kept, so the next attempt resumes after it.
    """
    received = 0
    dropped: BaseException | None = None
    sink = _HashingWriter(f, hasher)
    speed = _SpeedWindow(patience)
    try:
        while dropped is None:
            buf = sink.buffer()
            n, dropped = _fill(resp, buf)
            if not n:
                sink.release(buf)
                break
            sink.commit(buf, n)
            received += n
            progress.advance(n)
            if dropped is None:
                speed.check(n)
    except _Stalled as exc:
        dropped = exc
    finally:
        sink.close()
        f.flush()
        os.fsync(f.fileno())
    return received, dropped


def download_file(
    url: str,
    target: Path,
    *,
    size: int | None,
    token: str | None,
    progress: Progress,
    patience: Patience = DEFAULT_PATIENCE,
) -> str:
    """Download ``url`` to ``target`` (resuming ``target.part``); returns the sha256 hex digest.

    ``target`` appears only once all bytes are on disk and fsynced; a failed or
    killed run leaves just the ``.part`` for the next run to continue.  A size
    that disagrees with ``size`` (the listing's) is a VerificationError.
    """
    return _Download(url, target, size=size, token=token, progress=progress, patience=patience).run()


class _Download:
    """One file's download across its attempts: where it stands (offset, validator, hash so far) and how much
    patience is left (attempts, attempts without progress).  Each step of an attempt is a method of its own:
    opening with ``Range``, checking where the server starts, copying the body, counting progress."""

    def __init__(
        self, url: str, target: Path, *, size: int | None, token: str | None, progress: Progress, patience: Patience
    ) -> None:
        self.url, self.target, self.size, self.token = url, target, size, token
        self.progress, self.patience = progress, patience
        self.part = target.with_name(target.name + ".part")
        self.meta = target.with_name(target.name + ".part.json")
        self.shown = redact_url(url)
        target.parent.mkdir(parents=True, exist_ok=True)
        self.offset, self.validator, self.hasher = _resume_point(self.part, self.meta, size, progress)
        self.most = self.offset  # the most this file ever held: growing past it is progress, anything else is not
        self.without_progress = self.attempts = 0
        self.why = "no attempt made"

    def run(self) -> str:
        while not self._attempt():
            pass
        if self.size is not None and self.offset != self.size:
            raise self._wrong_size(f"{self.shown}: got {self.offset} bytes, the listing says {self.size}")
        os.replace(self.part, self.target)
        self.meta.unlink(missing_ok=True)
        return self.hasher.hexdigest()

    def _attempt(self) -> bool:
        """One request for the bytes still missing; True once every byte is there."""
        self.attempts += 1
        if self.attempts > self.patience.max_attempts:
            raise SourceError(
                f"{self.shown}: gave up after {self.patience.max_attempts} attempts at byte {self.offset} ({self.why})"
            )
        try:
            resp = open_url(
                self.url,
                token=self.token,
                headers=self._range_headers(),
                timeout=min(TIMEOUT_S, self.patience.stall_timeout_s),
            )
        except _RangeNotSatisfiable:
            return self._range_past_the_end()
        except SourceError as exc:
            self._not_opened(exc)
            return False
        with resp:
            return self._receive(resp)

    def _range_headers(self) -> dict[str, str]:
        headers = {}
        if self.offset:
            headers["Range"] = f"bytes={self.offset}-"
            if self.validator:
                headers["If-Range"] = self.validator
        return headers

    def _range_past_the_end(self) -> bool:
        """416: every byte was already there, or the part is not this file's: start over."""
        if self.size is not None and self.offset == self.size:
            return True
        self.part.unlink(missing_ok=True)
        self._restart()
        return False

    def _restart(self) -> None:
        self.progress.advance(-self.offset)
        self.offset, self.hasher = 0, hashlib.sha256()

    def _not_opened(self, exc: SourceError) -> None:
        """A request that failed before any body: retried (with a pause) while it is worth it."""
        self.without_progress += 1
        if not exc.retryable or self.without_progress >= self.patience.attempts_without_progress:
            raise exc
        self.why = str(exc)
        time.sleep(self.patience.backoff_s(self.without_progress))

    def _receive(self, resp: http.client.HTTPResponse) -> bool:
        """Append one response's body to the part; True once every byte is there."""
        restarted = self._check_start(resp)
        self._record_validator(resp)
        expected_end = self._expected_end(resp)
        opened = create_new(self.part) if self.offset == 0 else open_own(self.part)
        if opened is None:
            raise FetchError(
                f"{self.part} was replaced while downloading (a link planted?); the next run starts it afresh"
            )
        with opened as f:
            received, dropped = _copy_body(resp, f, self.hasher, self.patience, self.progress)
            self.offset += received
        end = expected_end if expected_end is not None else self.size
        if end is None or self.offset >= end:
            return True
        self._count_progress(end, restarted, dropped)
        return False

    def _check_start(self, resp: http.client.HTTPResponse) -> bool:
        """Whether the server starts over (200 to a Range: validator changed or Range ignored); a 206 must start
        where the part ends."""
        restarted = bool(self.offset) and resp.status == 200
        if restarted:
            self._restart()
        elif resp.status == 206:
            match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
            if not match or int(match.group(1)) != self.offset:
                raise SourceError(
                    f"{self.shown}: server answered Range {self.offset}- with "
                    f"Content-Range {resp.headers.get('Content-Range')!r}"
                )
        return restarted

    def _record_validator(self, resp: http.client.HTTPResponse) -> None:
        """The server's validator next to the part, so that the next run may resume it (If-Range)."""
        self.validator = _validator(resp)
        with create_new(self.meta) as m:
            m.write(json.dumps({"url": self.shown, "validator": self.validator}).encode())

    def _expected_end(self, resp: http.client.HTTPResponse) -> int | None:
        """Where the body ends by its Content-Length; a file of another size than the listing's is refused."""
        length = resp.headers.get("Content-Length")
        expected_end = self.offset + int(length) if length and length.isdigit() else None
        if self.size is not None and expected_end is not None and expected_end != self.size:
            raise self._wrong_size(f"{self.shown}: the server says {expected_end} bytes, the listing says {self.size}")
        return expected_end

    def _count_progress(self, end: int, restarted: bool, dropped: BaseException | None) -> None:
        """A body that ended early: progress only past the most the part ever held; give up after too many
        attempts without, else pause before the next."""
        if self.offset > self.most:
            self.most, self.without_progress = self.offset, 0
        else:
            self.without_progress += 1
        ignored = " (the server ignores Range: every attempt starts at byte 0)" if restarted else ""
        self.why = (
            f"connection {'stalled' if isinstance(dropped, (_Stalled, TimeoutError)) else 'dropped'} "
            f"at byte {self.offset} of {end}{ignored}"
        )
        if self.without_progress >= self.patience.attempts_without_progress:
            raise SourceError(f"{self.shown}: no progress in {self.without_progress} attempts: {self.why}")
        time.sleep(self.patience.backoff_s(self.without_progress))

    def _wrong_size(self, message: str) -> VerificationError:
        self.part.unlink(missing_ok=True)  # bytes of another size than promised: nothing worth resuming
        self.meta.unlink(missing_ok=True)
        return VerificationError(f"verification failed: {message}")
