"""Reading a bearer token from a mounted Secret file, for every command that takes one.

One helper so every ``--*token-file`` flag fails the same way: one line naming
the flag and the file, never the token.
"""

from __future__ import annotations

from pathlib import Path


def read_token_file(path: str, flag: str) -> str:
    """The stripped token; ValueError (one line, no secret) when unreadable or empty."""
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise ValueError(f"{flag} {path}: cannot read it ({exc.strerror or exc})") from None
    if not token:
        raise ValueError(f"{flag} {path}: the file is empty")
    return token
