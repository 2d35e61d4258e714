"""Loopback helpers shared by the multi-process tests: free ports and bounded waits."""

from __future__ import annotations

import socket
import time
from collections.abc import Callable


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def wait_for[T](predicate: Callable[[], T | None], timeout: float, interval: float = 0.1, what: str = "condition") -> T:
    """Poll ``predicate`` until it returns a truthy value; bounded, never an endless loop."""
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # noqa: BLE001 - the predicate may fail until the thing is up
            last_exc = exc
        time.sleep(interval)
    raise TimeoutError(
        f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc!r})" if last_exc else "")
    )
