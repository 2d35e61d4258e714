"""What a connection may cost the server: the connection cap, unfinished frames, and clients that stop reading.

Each test drives a real ``policyserver serve`` on 127.0.0.1 the way a hostile or
broken client would, at the level of the wire: raw WebSocket frame headers
written straight to the socket, close codes and HTTP statuses read back, and the
counters of ``/metrics``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import websockets
from websockets.sync.client import ClientConnection, connect

from policy_operator.runtime.policy.reference import PolicyConfig, example_observation
from policy_operator.runtime.serving import wire
from tests.support.net import wait_for
from tests.support.servers import NO_DRAIN, PolicyServerProcess, serve_policy, session_checkpoint

CFG = PolicyConfig()
RECV_TIMEOUT_S = 60.0
MAX_MESSAGE = 1_000_000
MAX_BUFFERED = 1_500_000
FRAME_TIMEOUT_S = 3.0


def _frame_header(length: int) -> bytes:
    """A client's binary frame header (FIN, masked) declaring ``length`` payload bytes, 64-bit length form."""
    return bytes([0x82, 0x80 | 127]) + length.to_bytes(8, "big") + os.urandom(4)


def _session(server: PolicyServerProcess) -> ClientConnection:
    ws = connect(server.url, compression=None, max_size=None, open_timeout=30)
    wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))
    return ws


def _close_code(ws: ClientConnection, timeout: float) -> int | None:
    """The close code the server sent, once the connection is closed within ``timeout``."""
    with pytest.raises(websockets.ConnectionClosed) as closed:
        ws.recv(timeout=timeout)
    return closed.value.rcvd.code if closed.value.rcvd is not None else None


def _closed(server: PolicyServerProcess, reason: str) -> float:
    return server.metric("policy_connections_closed_total", reason=reason) or 0.0


@pytest.fixture(scope="module")
def limited(tiny_checkpoint: Path) -> Iterator[PolicyServerProcess]:
    with serve_policy(
        tiny_checkpoint,
        "--steps",
        "1",
        "--threads",
        "1",
        "--max-connections",
        "3",
        "--max-message-bytes",
        str(MAX_MESSAGE),
        "--max-buffered-bytes",
        str(MAX_BUFFERED),
        "--frame-read-timeout-s",
        str(FRAME_TIMEOUT_S),
        "--error-format",
        "dict",
        *NO_DRAIN,
    ) as s:
        yield s


def _no_sessions(server: PolicyServerProcess) -> None:
    wait_for(lambda: server.metric("policy_connections") == 0, timeout=30, what="every session closed")


def test_unfinished_frames_are_bounded_in_bytes_and_in_time(limited: PolicyServerProcess) -> None:
    """Two clients each send 800 kB of a 900 kB frame and pause.  The second would take the buffered bytes past
    --max-buffered-bytes: closed at once with 1009.  The first holds its bytes until --frame-read-timeout-s:
    then closed with 1008.  Before these bounds both held their bytes for as long as they liked."""
    s = limited
    _no_sessions(s)
    full, late = _closed(s, "buffer_full"), _closed(s, "frame_timeout")
    first, second = _session(s), _session(s)
    try:
        started = time.monotonic()
        first.socket.sendall(_frame_header(900_000) + bytes(800_000))
        wait_for(
            lambda: (s.metric("policy_buffered_bytes") or 0) >= 800_000,
            timeout=10,
            what="the first frame's bytes buffered",
        )
        second.socket.sendall(_frame_header(900_000) + bytes(800_000))
        assert _close_code(second, RECV_TIMEOUT_S) == 1009
        assert s.get("/healthz").status == 200
        assert _close_code(first, RECV_TIMEOUT_S) == 1008
        assert time.monotonic() - started >= FRAME_TIMEOUT_S * 0.9, "closed by the read deadline, not before"
    finally:
        first.close()
        second.close()
    wait_for(lambda: s.metric("policy_buffered_bytes") == 0, timeout=10, what="the buffered bytes released")
    assert (_closed(s, "buffer_full"), _closed(s, "frame_timeout")) == (full + 1, late + 1)
    with _session(s) as ws:  # the server still serves
        ws.send(wire.packb(example_observation(CFG, 1)))
        assert "actions" in wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))


def test_connections_past_the_cap_are_refused_before_the_upgrade(limited: PolicyServerProcess) -> None:
    s = limited
    _no_sessions(s)
    refused = _closed(s, "max_connections")
    assert s.metric("policy_max_connections") == 3
    sessions = [_session(s) for _ in range(3)]
    try:
        with pytest.raises(websockets.InvalidStatus) as info:
            _session(s)
        assert info.value.response.status_code == 503
        assert b"--max-connections" in info.value.response.body
        assert s.get("/healthz").status == 200 and s.readyz().status == 200, "probes are not connections"
        assert _closed(s, "max_connections") == refused + 1
    finally:
        for ws in sessions:
            ws.close()
    _no_sessions(s)
    with _session(s) as ws:
        ws.send(wire.packb(example_observation(CFG, 2)))
        assert "actions" in wire.unpackb(ws.recv(timeout=RECV_TIMEOUT_S))


@pytest.mark.slow  # its own server, then seconds until the stuck client's socket fills
def test_a_client_that_stopped_reading_does_not_hold_the_batch_window(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A client sends requests and never reads a reply: once its socket is full the server's send to it blocks.
    Such a session cannot send again, so a lone robot's request must not wait the batch window for it (before
    the fix every lone request waited the full window while the stuck session lived).  Replies of 256 kB (a
    256 x 256 action chunk) fill the socket buffers in a few requests."""
    checkpoint = session_checkpoint(tmp_path_factory, horizon=256, action_dim=256)
    with serve_policy(
        checkpoint,
        "--steps",
        "1",
        "--threads",
        "1",
        "--max-batch",
        "8",
        "--batch-window-ms",
        "1000",
        "--drain-grace-s",
        "1",
    ) as s:
        stuck = socket.socket()
        stuck.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: a small receive window
        stuck.connect((s.host, s.port))
        ws = connect(s.url, sock=stuck, compression=None, max_size=None, max_queue=1, open_timeout=30)
        frame = wire.packb(example_observation(CFG, 3, image_hw=(8, 8)))
        stop = threading.Event()

        def flood() -> None:  # sends until the server stops reading it (its handler is blocked in send), then
            while not stop.is_set():  # blocks in send itself until the test closes the socket
                try:
                    ws.send(frame)
                except (TimeoutError, OSError, websockets.ConnectionClosed):
                    return

        sender = threading.Thread(target=flood, daemon=True)
        sender.start()
        try:

            def answered() -> float:
                return s.metric("policy_requests_total", replica="0") or 0.0

            last = [answered(), time.monotonic()]

            def stalled() -> bool:  # no reply written for a second: the stuck session's send is blocked
                now = answered()
                if now != last[0]:
                    last[:] = [now, time.monotonic()]
                return now > 0 and time.monotonic() - last[1] > 1.0

            wait_for(stalled, timeout=120, interval=0.1, what="the server's send to the stuck client to block")
            with _session(s) as robot:
                waits = []
                for i in range(3):
                    robot.send(wire.packb(example_observation(CFG, 10 + i)))
                    waits.append(wire.unpackb(robot.recv(timeout=RECV_TIMEOUT_S))["server_timing"]["queue_ms"])
            assert max(waits) < 500, f"a lone request waited the 1 s window for a session that cannot send: {waits}"
        finally:
            stop.set()
            stuck.close()
            sender.join(10)


def test_memory_return_trims_after_buffered_bytes_fall() -> None:
    from policy_operator.runtime.serving.limits import TRIM_AFTER_BYTES, MemoryReturn

    trims: list[int] = []
    memory = MemoryReturn(trim=lambda: trims.append(1))
    for total in (0, TRIM_AFTER_BYTES // 2, 0):  # never much buffered: nothing to give back
        memory.observe(total)
    assert not trims
    for total in (TRIM_AFTER_BYTES * 4, TRIM_AFTER_BYTES * 2):  # high, then not yet a quarter of it
        memory.observe(total)
    assert not trims
    for _ in range(4):  # fallen: trimmed on two sweeps (buffers are freed when their handlers end), then quiet
        memory.observe(TRIM_AFTER_BYTES // 8)
    assert len(trims) == 2 and memory.trimmed == 2
