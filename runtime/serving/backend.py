"""What the WebSocket server asks of whatever computes its requests: ``admission.FrontEnd`` in both modes.

``--frontend inline`` serves from the model process: the front-end's engine
client is the ``Engine`` itself, on the same event loop.  ``--frontend
process`` moves the server and admission into a child process
(``serving/frontend.py``) whose engine client, ``mp_client.MPClient``, ships
each admitted request to the model process and awaits its Result.  The server,
its sessions, auth, connection bounds and draining are the same code in both
modes because they only ever see this protocol.
"""

from __future__ import annotations

from typing import Any, Protocol

from policy_operator.readyz import Readiness
from policy_operator.runtime.errors import RequestError
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcSession


class Backend(Protocol):
    """The server's view of the model side: metadata, readiness, one request at a time, and draining."""

    @property
    def draining(self) -> bool: ...

    @property
    def accepting(self) -> bool:
        """Whether a new session or request is taken now (loaded, not draining, nothing failed)."""

    def begin_drain(self) -> None:
        """Take no new request or session from now on."""

    def metadata(self) -> dict[str, Any]:
        """The frame every session gets first (docs/protocol.md)."""

    def readiness(self) -> Readiness:
        """The ``/readyz`` document, as of now."""

    async def infer(self, message: bytes | str, connection: RtcSession | None = None) -> Result:
        """One frame in, its Result out (``actions`` set); any failure raises its ``RequestError``."""

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests and wait for those in flight; True when all were answered in time."""

    def give_up(self, error: RequestError) -> int:
        """Fail every request still waiting for its reply with ``error``; how many there were."""
