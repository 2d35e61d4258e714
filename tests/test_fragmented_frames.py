"""Fragmented WebSocket messages are held to the same bounds as whole frames, in both front-end modes.

A client can send a message as many fragments and never the final one, answering pings meanwhile.  Each
fragment is a complete frame, so the parser's buffer is empty between them; the fragments wait in websockets'
assembler.  Their bytes count against ``--max-buffered-bytes`` (one connection and all together), show in
``policy_buffered_bytes``, the ``--frame-read-timeout-s`` deadline runs from the message's first byte to its
last, and both the accounted bytes and the process's resident memory come back once such connections close.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from websockets.exceptions import ConnectionClosed, InvalidState
from websockets.sync.client import ClientConnection, connect

from tests.support.servers import PolicyServerProcess, descendants, serve_policy

pytestmark = [
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager:DeprecationWarning"),
]

MIB = 1 << 20
BUDGET = 24 * MIB  # --max-buffered-bytes
MESSAGE = 16 * MIB  # --max-message-bytes: one message may be larger than a third of the budget
TIMEOUT_S = 3.0  # --frame-read-timeout-s


@pytest.fixture(scope="module", params=["inline", "process"])
def server(request: pytest.FixtureRequest, tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    args = ["--steps", "2", "--frontend", request.param, "--drain-grace-s", "0"]
    args += ["--max-buffered-bytes", str(BUDGET), "--max-message-bytes", str(MESSAGE)]
    args += ["--frame-read-timeout-s", str(TIMEOUT_S)]
    with serve_policy(tiny_checkpoint, *args) as s:
        yield s


def closed(server: PolicyServerProcess, reason: str) -> float:
    return server.metric("policy_connections_closed_total", reason=reason) or 0.0


def buffered(server: PolicyServerProcess) -> float:
    return server.metric("policy_buffered_bytes") or 0.0


def session(server: PolicyServerProcess) -> ClientConnection:
    ws = connect(server.url, compression=None, max_size=None, open_timeout=30)
    ws.recv(timeout=30)  # the metadata
    return ws


def send_fragment(ws: ClientConnection, data: bytes, first: bool) -> bool:
    """One non-final fragment of a binary message, written now (websockets' own framing and masking); False once
    the server has closed the connection."""
    try:
        with ws.protocol_mutex:
            if first:
                ws.protocol.send_binary(data, fin=False)
            else:
                ws.protocol.send_continuation(data, fin=False)
            ws.send_data()
    except (ConnectionClosed, InvalidState, OSError):
        return False
    return True


def fragments(ws: ClientConnection, count: int, size: int = MIB) -> None:
    for i in range(count):
        if not send_fragment(ws, bytes(size), first=i == 0):
            return


def close_code(ws: ClientConnection, timeout: float) -> int | None:
    """The close code the server sent, waiting up to ``timeout`` for it."""
    with contextlib.suppress(ConnectionClosed, TimeoutError):
        ws.recv(timeout=timeout)
    return ws.protocol.close_rcvd.code if ws.protocol.close_rcvd is not None else None


def server_rss(server: PolicyServerProcess) -> int:
    """Resident bytes of the process that holds the sessions: the front-end process in process mode."""
    pids = [server.pid]
    for pid in descendants(server.pid):
        with contextlib.suppress(OSError):
            if b"runtime.serving.frontend" in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids = [pid]
    for line in Path(f"/proc/{pids[0]}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_fragments_count_against_the_budget(server: PolicyServerProcess) -> None:
    full = closed(server, "buffer_full")
    holder = session(server)
    try:
        fragments(holder, 14)  # 14 MiB of an unfinished message, within its own 16 MiB bound
        server.wait_until(lambda: buffered(server) >= 14 * MIB, 10, "policy_buffered_bytes >= 14 MiB")
        second = session(server)
        try:
            fragments(second, 12)  # would take the total to 26 MiB, past the 24 MiB budget
            assert close_code(second, 10) == 1009
        finally:
            second.close()
        assert closed(server, "buffer_full") == full + 1
        assert close_code(holder, 0.1) is None  # the first one keeps its message
    finally:
        holder.close()
    server.wait_until(lambda: buffered(server) == 0, 10, "policy_buffered_bytes back to 0")


def test_the_read_deadline_covers_every_fragment(server: PolicyServerProcess) -> None:
    late = closed(server, "frame_timeout")
    ws = session(server)
    try:
        started = time.monotonic()
        for i in range(int(4 * TIMEOUT_S / 0.25)):  # a fragment every 0.25 s: the message never ends
            if not send_fragment(ws, bytes(1024), first=i == 0) or ws.protocol.close_rcvd is not None:
                break
            time.sleep(0.25)  # the client's pace, not a synchronisation
        code = close_code(ws, 5)
        elapsed = time.monotonic() - started
    finally:
        ws.close()
    assert code == 1008
    assert TIMEOUT_S <= elapsed < 3 * TIMEOUT_S  # the sweep runs every quarter of the timeout; a busy machine
    assert closed(server, "frame_timeout") == late + 1


def test_memory_returns_after_fragmenting_connections_close(server: PolicyServerProcess) -> None:
    """Waves of connections that each try to hold 4 MiB of fragments, twice the budget in all: the server holds
    at most the budget (the rest are closed for buffer_full) and gives the memory back once they close."""
    server.wait_until(lambda: buffered(server) == 0, 10, "no buffered bytes")
    before = server_rss(server)
    full = closed(server, "buffer_full")
    for _ in range(3):
        wave = [session(server) for _ in range(12)]
        try:
            for ws in wave:
                fragments(ws, 4)
            server.wait_until(lambda: buffered(server) >= BUDGET - 4 * MIB, 10, "the budget nearly full")
            assert buffered(server) <= BUDGET
            assert server_rss(server) <= before + BUDGET + 16 * MIB
        finally:
            for ws in wave:
                ws.close()
        server.wait_until(lambda: buffered(server) == 0, 10, "policy_buffered_bytes back to 0")
    assert closed(server, "buffer_full") >= full + 3 * 6  # at most 6 of each wave's 12 fit in 24 MiB
    server.wait_until(
        lambda: server_rss(server) <= before + 8 * MIB, 15, f"resident memory back within 8 MiB of {before}"
    )
