"""Why a fetch failed, as an exit code the operator's Job status can act on.

The fetch Job's exit code is the only thing the operator sees without reading
logs, so each failure class maps to one ``FetchExit`` code (``policy_operator/exit_codes.py``):
a retry is worth it for an unreachable source and never for a hash mismatch or a full volume.
Messages are scrubbed of secrets here, in the one place every error passes.
"""

from __future__ import annotations

import errno
from urllib.parse import SplitResult, urlsplit

from policy_operator.exit_codes import FetchExit

_REDACTED = "***"


class FetchError(RuntimeError):
    """A fetch that cannot complete; ``str()`` is one line fit for a Job's log."""

    exit_code = FetchExit.ERROR


class UsageError(FetchError):
    """The request itself is wrong (bad source, unknown scheme, bad --sha256)."""

    exit_code = FetchExit.USAGE


class SourceError(FetchError):
    """The source cannot be reached, refuses us (auth), or lacks what was asked for.

    ``retryable`` separates a dropped connection or a 5xx (worth another try in
    the same run) from a 401/404 (the same answer every time).
    """

    exit_code = FetchExit.SOURCE

    def __init__(self, message: str, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable


class NotFoundError(FetchError):
    """The hub says the repository or revision does not exist (or hides it from this token): a retry gets the
    same 404, so the Job fails at once instead of burning its retries as an unreachable source would."""

    exit_code = FetchExit.NOT_FOUND


class VerificationError(FetchError):
    """Downloaded bytes do not match the hash or size the source promised."""

    exit_code = FetchExit.VERIFY


class DiskFullError(FetchError):
    """The volume has no room for the checkpoint."""

    exit_code = FetchExit.DISK_FULL


def is_disk_full(exc: BaseException) -> bool:
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def redact_url(url: str) -> str:
    """A URL safe to log and to record in the marker: no password, no query values.

    Signed URLs carry their credential in the query string and basic-auth URLs in
    the userinfo; both are kept in shape (so the log still says which URL) but not
    in content.
    """
    try:
        parts = urlsplit(url)
    except ValueError:
        return url
    if not parts.scheme or parts.scheme == "file":
        return url
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, host = netloc.rsplit("@", 1)
        user = userinfo.split(":", 1)[0]
        netloc = f"{user}:{_REDACTED}@{host}" if ":" in userinfo else f"{_REDACTED}@{host}"
    query = parts.query
    if query:
        pairs = []
        for pair in query.split("&"):
            name, sep, _value = pair.partition("=")
            pairs.append(f"{name}={_REDACTED}" if sep else name)
        query = "&".join(pairs)
    return SplitResult(parts.scheme, netloc, parts.path, query, parts.fragment).geturl()


def scrub(text: str, secrets: list[str] | tuple[str, ...]) -> str:
    """Replace every secret (token) occurring in ``text``."""
    for secret in secrets:
        if secret and len(secret) >= 4:
            text = text.replace(secret, _REDACTED)
    return text
