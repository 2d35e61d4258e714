"""What connections may hold of the server's memory: bytes of unfinished frames, and for how long.

A message is buffered until its last byte arrives; websockets bounds one
message (``--max-message-bytes``, its fragments together) but not how many
connections hold one half-sent, nor for how long.  ``ReadBudget`` accounts the
unfinished message of every connection after every chunk the socket delivers:
the bytes of the frame being parsed (the parser's buffer) plus those of the
fragments of a fragmented message already received (websockets' own
``current_size``; they wait in its assembler until the final fragment).  A
chunk that takes the total past ``--max-buffered-bytes`` closes its connection
with 1009 (message too big: the server cannot buffer it now), and a message
still unfinished ``--frame-read-timeout-s`` after its first byte (however many
fragments and pings it spans) closes its connection with 1008 (policy
violation).  Both are counted in ``policy_connections_closed{reason}``.

Freed buffers go back to the allocator, which keeps them: after 100 connections
that each held 15 MiB closed, 1 GiB stayed resident.  ``MemoryReturn`` hands
the freed heap back to the system (glibc's ``malloc_trim``) once the bytes
buffered fall to a quarter of a high mark of at least ``TRIM_AFTER_BYTES``.

Complete frames a handler has not read yet are bounded by ``MAX_QUEUED_FRAMES``
per connection: past it websockets stops reading the socket, so the rest waits
in the kernel's buffers under TCP flow control, not in this process.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

from websockets.asyncio.server import ServerConnection
from websockets.frames import DATA_OPCODES, Frame
from websockets.protocol import Event

log = logging.getLogger(__name__)

TRIM_AFTER_BYTES = 8 << 20  # buffered bytes worth giving back once freed (a trim costs a few ms at most)
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

    def update(self, conn: BoundedConnection, buffered: int, completed: bool = False) -> None:
        """``conn`` now holds ``buffered`` bytes of an unfinished message; closes it if that breaks the budget.

        ``completed``: a message finished in the chunk just read, so what is buffered now (if anything) began
        since, and its clock starts now.  Otherwise the clock runs from the first byte of the message, however
        its bytes move between the parser's buffer and its fragments."""
        before, since = self._held.pop(conn, (0, 0.0))
        self.total -= before
        if buffered <= 0:
            return
        if before == 0 or completed:  # a new message began: its clock starts now
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


def _malloc_trim() -> Callable[[], object] | None:
    """glibc's ``malloc_trim(0)``, or None where there is none (musl, macOS): memory then stays with the process."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return lambda: trim(0)


class MemoryReturn:
    """Gives freed buffer memory back to the system after buffered bytes were high and fell.

    ``observe`` runs every sweep: once the total is at most a quarter of a high mark of at least
    ``TRIM_AFTER_BYTES``, the heap is trimmed on two sweeps in a row (a closed connection's buffers are freed
    when its handler ends, which may be a sweep after its bytes left the budget), then the mark starts over.
    """

    def __init__(self, trim: Callable[[], object] | None = None) -> None:
        self._trim = trim if trim is not None else _malloc_trim()
        self.high = 0
        self._trims = 0
        self.trimmed = 0  # how many times, for tests and logs

    def observe(self, total: int) -> None:
        self.high = max(self.high, total)
        if self._trim is None or self.high < TRIM_AFTER_BYTES or total > self.high // 4:
            self._trims = 0
            return
        self._trim()
        self.trimmed += 1
        self._trims += 1
        if self._trims >= 2:
            self.high, self._trims = total, 0


class BoundedConnection(ServerConnection):
    """A server connection that reports its unfinished message to a ``ReadBudget`` after every chunk read."""

    budget: ReadBudget  # set by ``bounded_connection``
    _completed = False  # a data frame with FIN (a whole message) arrived in the chunk being processed
    _reported = 0  # the bytes last told to the budget

    def data_received(self, data: bytes) -> None:
        """The chunk parsed, then the budget told the bytes of the message being received: the fragments already
        parsed (websockets counts them for its own ``max_size``; None between messages) and the partial frame in
        the parser's buffer.  A chunk that leaves nothing unfinished, after one that left nothing either (a
        whole frame in one read, the usual request), has nothing to account."""
        self._completed = False
        super().data_received(data)
        unfinished = (self.protocol.current_size or 0) + len(self.protocol.reader.buffer)
        if unfinished or self._reported:
            self._reported = unfinished
            self.budget.update(self, unfinished, self._completed)

    def process_event(self, event: Event) -> None:
        if isinstance(event, Frame) and event.fin and event.opcode in DATA_OPCODES:
            self._completed = True
        super().process_event(event)

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
