"""What the WebSocket server asks of whatever computes its requests: one seam, two sides of a process boundary.

``--frontend inline`` serves from the model process: the server calls the
``Ingress`` (decode, prepare, route, lanes) on its own event loop.
``--frontend process`` moves the server, decoding and ``prepare`` into a child
process (``serving/frontend.py``) so the interpreter that launches the model
spends no time on sockets or msgpack: there the server calls an
``EngineProxy``, which ships each prepared request to the model process
(``serving/engine_link.py``) and awaits its reply.  The server, its sessions,
auth, connection bounds and draining are the same code in both modes because
they only ever see this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

from policy_operator.readyz import Readiness
from policy_operator.runtime.errors import RequestError
from policy_operator.runtime.parallel.dispatch import Reply
from policy_operator.runtime.serving.rtc_session import RtcSession


class Backend(Protocol):
    """The server's view of the model side: metadata, readiness, one request at a time, and draining."""

    draining: bool

    @property
    def accepting(self) -> bool:
        """Whether a new session or request is taken now (loaded, not draining, nothing failed)."""

    def metadata(self) -> dict[str, Any]:
        """The frame every session gets first (docs/protocol.md)."""

    def readiness(self) -> Readiness:
        """The ``/readyz`` document, as of now."""

    async def infer(self, message: bytes | str, rtc_session: RtcSession | None = None) -> Reply:
        """One frame in, its reply out (``actions`` set); any failure raises its ``RequestError``."""

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests and wait for those in flight; True when all were answered in time."""

    def give_up(self, error: RequestError) -> int:
        """Fail every request still waiting for its reply with ``error``; how many there were."""
