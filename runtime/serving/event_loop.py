"""The event loop a server runs on: uvloop when installed (``--event-loop auto``), else asyncio's own.

Torch-free, so ``preflight`` refuses ``--event-loop uvloop`` without uvloop before any rank loads, and both
the inline server (rank 0) and the front-end process (``--frontend process``) pick their loop the same way.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable


def event_loop_factory(choice: str) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop for ``auto`` when it is installed (fewer microseconds per wake-up on every request's
    hops between the loop and the lane threads), else asyncio's own loop (None)."""
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        if choice == "uvloop":
            raise ValueError("--event-loop uvloop: uvloop is not installed") from None
        return None
    return uvloop.new_event_loop
