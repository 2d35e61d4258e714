"""What connections may hold of the server's memory: bytes of unfinished frames, and for how long.

A frame is buffered until its last byte arrives; websockets bounds one frame
(``--max-message-bytes``) but not how many connections hold one half-sent, nor
for how long.  ``ReadBudget`` accounts the unfinished bytes of every
connection, read off each connection's parser after every chunk the socket
delivers: a chunk that takes the total past ``--max-buffered-bytes`` closes its
connection with 1009 (message too big: the server cannot buffer it now), and a
frame still unfinished ``--frame-read-timeout-s`` after its first byte closes
its connection with 1008 (policy violation).  Both are counted in
``policy_connections_closed{reason}``.

Complete frames a handler has not read yet are bounded by ``MAX_QUEUED_FRAMES``
per connection: past it websockets stops reading the socket, so the rest waits
in the kernel's buffers under TCP flow control, not in this process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection

log = logging.getLogger(__name__)

MESSAGE_TOO_BIG = 1009
POLICY_VIOLATION = 1008
MAX_QUEUED_FRAMES = 4  # openpi is request/reply: a client has one frame in flight, a few at most


class ReadBudget:
    """Unfinished-frame bytes per connection and in total, and since when each connection's frame is unfinished."""

    def __init__(
        self, max_bytes: int, frame_timeout_s: float, on_close: Callable[[str], None] = lambda reason: None
    ) -> None:
        self.max_bytes = max_bytes
        self.frame_timeout_s = frame_timeout_s
        self.total = 0
        self._on_close = on_close
        self._held: dict[BoundedConnection, tuple[int, float]] = {}  # bytes, monotonic time the frame began

    def update(self, conn: BoundedConnection, buffered: int) -> None:
        """``conn`` now holds ``buffered`` bytes of an unfinished frame; closes it if that breaks the budget."""
        before, since = self._held.pop(conn, (0, 0.0))
        self.total -= before
        if buffered <= 0:
            return
        if before == 0 or buffered < before:  # a new frame began (the last one finished): its clock starts now
            since = time.monotonic()
        if self.total + buffered > self.max_bytes:
            log.warning(
                "closing a connection: its unfinished frame would take buffered bytes past %d (--max-buffered-bytes)",
                self.max_bytes,
            )
            self._close(conn, MESSAGE_TOO_BIG, "server buffer full; retry", "buffer_full")
            return
        self._held[conn] = (buffered, since)
        self.total += buffered

    def forget(self, conn: BoundedConnection) -> None:
        before, _ = self._held.pop(conn, (0, 0.0))
        self.total -= before

    def expire(self) -> int:
        """Close every connection whose frame is unfinished past the timeout; how many were closed."""
        limit = time.monotonic() - self.frame_timeout_s
        late = [conn for conn, (_, since) in self._held.items() if since < limit]
        for conn in late:
            log.warning(
                "closing a connection: a frame unfinished after %gs (--frame-read-timeout-s)", self.frame_timeout_s
            )
            self.forget(conn)
            self._close(conn, POLICY_VIOLATION, "frame not received in time", "frame_timeout")
        return len(late)

    def _close(self, conn: BoundedConnection, code: int, reason: str, label: str) -> None:
        self._on_close(label)
        conn.abandon(code, reason)


class BoundedConnection(ServerConnection):
    """A server connection that reports its unfinished frame to a ``ReadBudget`` after every chunk read."""

    budget: ReadBudget  # set by ``bounded_connection``

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self.budget.update(self, len(self.protocol.reader.buffer))

    def connection_lost(self, exc: Exception | None) -> None:
        self.budget.forget(self)
        super().connection_lost(exc)

    def abandon(self, code: int, reason: str) -> None:
        """Fail the connection with ``code``, as websockets does for a frame over ``max_size``: the close frame
        and EOF go out, whatever the client still sends is discarded unbuffered, and the socket is dropped
        once the client closes its side or ``close_timeout`` has passed."""
        self.protocol.fail(code, reason)
        self.send_data()
        self.loop.call_later(self.close_timeout or 10.0, self.transport.abort)


def bounded_connection(budget: ReadBudget) -> type[BoundedConnection]:
    """The connection class ``serve(create_connection=...)`` instantiates, reporting to ``budget``."""
    return type("BoundedConnection", (BoundedConnection,), {"budget": budget})
