"""What crosses between the front-end process and the model process (``--frontend process``), and how.

Two channels, each for what it is good at:

* **Control messages** (requests' ids, seeds, sessions, tensor specs; replies; readiness snapshots; drain
  commands) are small dataclasses, pickled over one Unix socket pair (``Channel``: length-prefixed frames,
  read and written on each side's event loop without ever blocking it).
* **Tensor bytes** never go through the socket: the front-end writes each prepared sample (or, for a policy
  without a ``Preprocessor``, the decoded observation's arrays, as pickle's out-of-band buffers) into a slot
  of a ring of shared memory (``SlotRing``, one ``memfd`` both processes map) and sends the slot and the
  tensors' specs (the observation's small pickle); the model process copies them out
  at once (one ``numpy`` copy each) and hands the slot back (``Freed``), so a slot is held for
  microseconds, not for the request's life, and a few slots serve any number of sessions.

A slot is ``--max-message-bytes`` (the arrays of any frame the server admits fit); a prepared sample larger
than a slot is refused with ``bad_frame``, never written past its slot.  The ring has at most ``MAX_SLOTS`` slots and at
most ``--max-buffered-bytes`` in all; memory-backed pages cost only once written.

Between the front-end processes themselves (``--frontend-processes``), one more piece of shared memory: each
one's open sessions (``SessionCounts``, a memfd rank 0 hands every front-end over its socket), so
``--max-connections`` bounds the pod's sessions, not each front-end's.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import mmap
import os
import pickle
import socket
import struct
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from policy_operator.layout import ParallelLayout
from policy_operator.readyz import Readiness
from policy_operator.runtime.engine_api import AdmissionSpec, PreparedRequest
from policy_operator.runtime.errors import WireError
from policy_operator.runtime.policy.interface import Sample
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcRequest

log = logging.getLogger(__name__)

MAX_SLOTS = 8  # slots are held only until the model process copied them out: a few cover many sessions
ALIGN = 64  # each tensor starts on a cache line


# --- messages, front-end -> model process ----------------------------------------------------------
@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # torch dtype name without "torch."
    shape: tuple[int, ...]
    offset: int
    nbytes: int


@dataclass(frozen=True)
class BufferSpec:
    offset: int
    nbytes: int


@dataclass(frozen=True)
class Request:
    """One admitted request (``engine_api.PreparedRequest``) whose bytes are in ``slot``: a prepared sample's
    tensors, or (a policy without a ``Preprocessor``) the decoded observation as a pickle whose buffers are in
    the slot."""

    id: int
    slot: int
    tensors: tuple[TensorSpec, ...] | None  # a prepared sample; None: ``observation``
    observation: tuple[bytes, tuple[BufferSpec, ...]] | None  # the observation's pickle, its buffers' places
    meta: dict[str, Any]
    seed: int | None
    session: str | None
    rtc: RtcRequest | None
    decode_ms: float
    prepare_ms: float
    frame_bytes: int
    recent_sessions: int  # the front-end's recent sessions (the lanes' batch window waits for them)


@dataclass(frozen=True)
class Listening:
    port: int


@dataclass(frozen=True)
class RecentSessions:
    """The front-end's recent sessions, when they changed without a request (a session closed or went
    quiet): with several front-ends, the batch window sums every one's latest count."""

    sessions: int


@dataclass(frozen=True)
class Drained:
    drained: bool  # every request answered within the grace period


# --- messages, model process -> front-end ----------------------------------------------------------
@dataclass(frozen=True)
class FrontendConfig:
    """Everything the front-end needs to start serving the port (sent first)."""

    server: Any  # serving.server.ServerConfig
    layout: ParallelLayout
    heartbeat_s: float
    request_timeout_s: float
    event_loop: str
    gil_switch_ms: float
    log_level: str
    index: int = 0  # of --frontend-processes: its log lines say which, and which slot of SessionCounts it writes
    processes: int = 1  # --frontend-processes

    @property
    def slots(self) -> int:
        """Slots of this front-end's ring: from its own bounds (its share of them), ``ring_geometry``."""
        return ring_geometry(self.server.max_message_bytes, self.server.max_buffered_bytes)[0]

    @property
    def slot_bytes(self) -> int:
        return ring_geometry(self.server.max_message_bytes, self.server.max_buffered_bytes)[1]


@dataclass(frozen=True)
class Attached:
    """The model is loaded: how the front-end admits requests (metadata, Preprocessor, ``rtc`` checks)."""

    admission: AdmissionSpec


@dataclass(frozen=True)
class Snapshot:
    """The model process's readiness, pushed on change and several times per heartbeat period."""

    readiness: Readiness
    accepting: bool
    # the pod's requests in flight that did not come over this link (the LeRobot gRPC port's, the other
    # front-ends'): the front-end adds its own, which it counts fresher than a snapshot
    elsewhere: int = 0


@dataclass(frozen=True)
class Answer:
    id: int
    result: Result  # actions, or the error (the front-end unwraps it)


@dataclass(frozen=True)
class Freed:
    slots: tuple[int, ...]


@dataclass(frozen=True)
class BatchRan:
    replica: int
    size: int


@dataclass(frozen=True)
class Gauges:
    """Engine-side gauges of ``/metrics`` (each None when unchanged)."""

    load_s: float | None = None
    warmup_s: float | None = None
    buckets: dict[int, float] | None = None  # batch size -> measured seconds, every replica
    download: tuple[int, int] | None = None  # bytes done, total (0: unknown)


@dataclass(frozen=True)
class Drain:
    grace_s: float
    heartbeat_s: float


# --- the socket --------------------------------------------------------------------------------------
_HEADER = struct.Struct("!Q")  # each message: its pickled length, then the pickle


_READ_CHUNK = 1 << 20


class Channel:
    """Pickled messages over one end of a socket pair.

    Before ``listen`` it is blocking (the configuration goes first).  After, it belongs to one event loop and
    never blocks it: reads are buffered until a message is whole, and a send the socket cannot take now is
    queued and written when it becomes writable -- so two processes each sending a large message (a
    256 x 256 action chunk, a long ``rtc`` tail) while the other sends too can never wait on each other.
    """

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._sock.setblocking(True)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._in = bytearray()
        self._out: deque[memoryview] = deque()
        self._closed = False
        self._on_closed: Callable[[], None] = lambda: None

    def fileno(self) -> int:
        return self._sock.fileno()

    def send(self, message: object) -> None:
        """``message`` as one frame of the stream (its pickle's length, then the pickle): at once before ``listen``,
        else queued and written with whatever else this loop iteration sends."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        data = _HEADER.pack(len(data)) + data
        if self._loop is None:
            self._sock.sendall(data)
            return
        if self._closed:
            raise ConnectionError("the other process is gone")
        self._out.append(memoryview(data))
        if len(self._out) == 1:
            self._loop.call_soon(self._flush)  # what else this loop iteration sends goes in the same write

    def _flush(self) -> None:
        assert self._loop is not None
        if len(self._out) > 1:  # one write for all of them
            self._out = deque([memoryview(b"".join(self._out))])
        try:
            while self._out:
                sent = self._sock.send(self._out[0])
                if sent == len(self._out[0]):
                    self._out.popleft()
                else:
                    self._out[0] = self._out[0][sent:]
        except BlockingIOError:
            pass
        except OSError:
            self._close()
            return
        if self._out:
            self._loop.add_writer(self._sock.fileno(), self._flush)
        else:
            self._loop.remove_writer(self._sock.fileno())

    def finish(self) -> None:
        """Write what is still queued, blocking (the process is about to exit)."""
        if self._closed:
            return
        try:
            self._sock.setblocking(True)
            while self._out:
                self._sock.sendall(self._out.popleft())
        except OSError:
            pass

    def send_fd(self, fd: int) -> None:
        """Hand the other process a copy of descriptor ``fd`` (SCM_RIGHTS), blocking (before ``listen`` only)."""
        assert self._loop is None
        socket.send_fds(self._sock, [b"\0"], [fd])

    def recv_fd(self) -> int:
        """The descriptor the other process handed over with ``send_fd``, blocking (before ``listen`` only)."""
        data, fds, _, _ = socket.recv_fds(self._sock, 1, 1)
        if not data:
            raise EOFError("the other process closed the channel")
        if len(fds) != 1:
            raise ConnectionError(f"expected a descriptor from the other process, got {len(fds)}")
        return fds[0]

    def recv(self) -> Any:
        """One message, blocking (before ``listen`` only)."""
        header = self._recv_exactly(_HEADER.size)
        return pickle.loads(self._recv_exactly(_HEADER.unpack(header)[0]))

    def _recv_exactly(self, n: int) -> bytes:
        chunks = bytearray()
        while len(chunks) < n:
            chunk = self._sock.recv(n - len(chunks))
            if not chunk:
                raise EOFError("the other process closed the channel")
            chunks += chunk
        return bytes(chunks)

    def listen(
        self, loop: asyncio.AbstractEventLoop, on_message: Callable[[Any], None], on_closed: Callable[[], None]
    ) -> None:
        """From now on: ``on_message`` for every message, on ``loop``; ``on_closed`` once when the other end is gone."""
        self._loop = loop
        self._on_closed = on_closed
        self._sock.setblocking(False)

        def readable() -> None:
            try:
                data = self._sock.recv(_READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                data = b""
            if not data:
                self._close()
                return
            self._in += data
            while len(self._in) >= _HEADER.size:
                (size,) = _HEADER.unpack_from(self._in)
                if len(self._in) < _HEADER.size + size:
                    break
                message = pickle.loads(memoryview(self._in)[_HEADER.size : _HEADER.size + size])
                del self._in[: _HEADER.size + size]
                on_message(message)

        loop.add_reader(self.fileno(), readable)

    def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._loop is not None:
            self._loop.remove_reader(self.fileno())
            self._loop.remove_writer(self.fileno())
        self._on_closed()


# --- the shared memory ---------------------------------------------------------------------------------
def ring_geometry(max_message_bytes: int, max_buffered_bytes: int) -> tuple[int, int]:
    """(slots, bytes per slot): a slot holds any admitted frame, the ring at most ``max_buffered_bytes``."""
    slot = -(-max_message_bytes // ALIGN) * ALIGN
    return max(1, min(MAX_SLOTS, max_buffered_bytes // slot)), slot


def _shared_file(name: str, size: int) -> int:
    """An anonymous shared-memory file of ``size`` zero bytes (nothing to unlink: it goes with its last user)."""
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    os.ftruncate(fd, size)
    return fd


def create_ring_fd(slots: int, slot_bytes: int) -> int:
    """The ring's shared memory."""
    return _shared_file("policy-frontend-ring", slots * slot_bytes)


@functools.cache
def _numpy_dtype(dtype: torch.dtype) -> np.dtype[Any] | None:
    """numpy's dtype of the same bytes, or None where numpy has none (bfloat16, the float8s)."""
    try:
        return torch.empty(0, dtype=dtype).numpy().dtype
    except (TypeError, RuntimeError):
        return None


class SlotRing:
    """The ring as one process maps it; which slots are free is the front-end's business."""

    def __init__(self, fd: int, slots: int, slot_bytes: int) -> None:
        self.slots = slots
        self.slot_bytes = slot_bytes
        self._map = mmap.mmap(fd, slots * slot_bytes)
        self._view = memoryview(self._map)

    def write_request(self, id: int, slot: int, prepared: PreparedRequest, recent_sessions: int) -> Request:
        """``prepared``'s bytes written into ``slot`` (a sample's tensors, or the observation: ``write_object``) and
        its description for the socket; WireError (bad_frame) when they do not fit."""
        if prepared.sample is None:
            tensors, observation, meta = None, self.write_object(slot, prepared.observation), {}
        else:
            specs: list[TensorSpec] = []
            offset = 0
            flat: list[tuple[np.ndarray, int]] = []
            for name, tensor in prepared.sample.tensors.items():
                t = tensor.detach()
                if t.device.type != "cpu":
                    t = t.cpu()
                # its bytes as a flat numpy view: numpy's own calls where numpy has the dtype (each torch call
                # costs more than the copy into the slot), torch's byte view where it has not (bfloat16)
                if _numpy_dtype(t.dtype) is not None:
                    raw = np.ascontiguousarray(t.numpy()).reshape(-1).view(np.uint8)
                else:
                    raw = t.contiguous().reshape(-1).view(torch.uint8).numpy()
                specs.append(TensorSpec(name, str(t.dtype).removeprefix("torch."), tuple(t.shape), offset, raw.nbytes))
                flat.append((raw, offset))
                offset = -(-(offset + raw.nbytes) // ALIGN) * ALIGN
            if offset > self.slot_bytes:
                raise WireError(
                    f"the prepared observation takes {offset} bytes, more than the {self.slot_bytes} bytes "
                    "(--max-message-bytes) a request may hand to the model process"
                )
            base = slot * self.slot_bytes
            for raw, off in flat:
                if raw.nbytes:
                    self._view[base + off : base + off + raw.nbytes] = raw.data
            tensors, observation, meta = tuple(specs), None, prepared.sample.meta
        return Request(
            id,
            slot,
            tensors,
            observation,
            meta,
            prepared.seed,
            prepared.session,
            prepared.rtc,
            prepared.decode_ms,
            prepared.prepare_ms,
            prepared.frame_bytes,
            recent_sessions,
        )

    def write_object(self, slot: int, obj: object) -> tuple[bytes, tuple[BufferSpec, ...]]:
        """``obj`` (a decoded observation) pickled with its arrays' bytes out of band, into ``slot``: the small
        pickle for the message, and where each buffer is.  WireError (bad_frame) when they do not fit."""
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
        base = slot * self.slot_bytes
        specs: list[BufferSpec] = []
        offset = 0
        views = [b.raw() for b in buffers]
        for view in views:  # packed: each is copied out into its own bytearray, so alignment buys nothing
            specs.append(BufferSpec(offset, view.nbytes))
            offset += view.nbytes
        if offset > self.slot_bytes:
            raise WireError(
                f"the observation's arrays take {offset} bytes, more than the {self.slot_bytes} bytes "
                "(--max-message-bytes) a request may hand to the model process"
            )
        for view, spec in zip(views, specs, strict=True):
            self._view[base + spec.offset : base + spec.offset + spec.nbytes] = view
        return data, tuple(specs)

    def read_object(self, slot: int, data: bytes, specs: tuple[BufferSpec, ...]) -> Any:
        """What ``write_object`` wrote, its buffers copied out: the slot may be reused as soon as this returns."""
        base = slot * self.slot_bytes
        buffers = [bytearray(self._view[base + spec.offset : base + spec.offset + spec.nbytes]) for spec in specs]
        return pickle.loads(data, buffers=buffers)

    def read_request(self, request: Request) -> PreparedRequest:
        """The model process's ``PreparedRequest`` of ``request``, copied out of its slot: the slot may be reused
        as soon as this returns."""
        if request.tensors is None:
            assert request.observation is not None
            sample, observation = None, self.read_object(request.slot, *request.observation)
        else:
            base = request.slot * self.slot_bytes
            tensors = {}
            for spec in request.tensors:
                dtype = getattr(torch, spec.dtype)
                if spec.nbytes == 0:
                    tensors[spec.name] = torch.empty(spec.shape, dtype=dtype)
                    continue
                # numpy's copy is one memcpy on this thread; torch's ``clone`` of a frame this size is an intra-op
                # parallel copy that wakes (and leaves spinning) a team of as many threads as the host has cores,
                # on the event loop's thread, against the model thread: ~0.7 ms of CPU per 150 KB frame on 2
                # cores.  The dtype and shape are numpy's too where numpy has the dtype: each torch call (view,
                # reshape) costs the event loop more than the copy itself.
                start = base + spec.offset
                np_dtype = _numpy_dtype(dtype)
                if np_dtype is not None:
                    raw = np.frombuffer(self._map, dtype=np_dtype, count=spec.nbytes // np_dtype.itemsize, offset=start)
                    tensors[spec.name] = torch.from_numpy(raw.reshape(spec.shape).copy())
                    continue
                raw = np.frombuffer(self._map, dtype=np.uint8, count=spec.nbytes, offset=start).copy()
                tensors[spec.name] = torch.from_numpy(raw).view(dtype).reshape(spec.shape)
            sample, observation = Sample(tensors, request.meta), None
        return PreparedRequest(
            sample,
            observation,
            request.seed,
            request.session,
            request.rtc,
            request.decode_ms,
            request.prepare_ms,
            request.frame_bytes,
        )


# --- the pod's open sessions ---------------------------------------------------------------------------
_COUNT_BYTES = 8  # one int64 per front-end: aligned, so each is written in one store


def create_counts_fd(processes: int) -> int:
    """The pod's session counts: one per front-end process, all 0."""
    return _shared_file("policy-frontend-sessions", processes * _COUNT_BYTES)


class SessionCounts:
    """The open WebSocket sessions of every front-end process of the pod, for a pod-wide ``--max-connections``.

    One 8-byte slot per front-end in one memfd (``create_counts_fd``) that rank 0 hands to each of them
    (``Channel.send_fd``); each maps it, writes only its own slot (its ``len(sessions.open)``, on every session
    opened or closed) and reads the sum, so the limit counts the pod's sessions the way inline mode counts its
    own, with no lock: a slot has one writer, and an aligned 8-byte store is never seen half-written.

    The check and the count's rise are not one step, in one process or across several: a front-end admits an
    upgrade (``process_request``) and counts the session only once its handler starts, the window inline mode
    already has.  Across front-ends the same window means two that admit at the same instant each see the
    other's count before it rose: the pod may hold up to ``processes - 1`` sessions more than the limit from
    that race.
    """

    def __init__(self, fd: int, processes: int, index: int) -> None:
        self._map = mmap.mmap(fd, processes * _COUNT_BYTES)
        self._slots = memoryview(self._map).cast("q")
        self._index = index

    def set(self, open_here: int) -> None:
        """This front-end's open sessions."""
        self._slots[self._index] = open_here

    def total(self) -> int:
        """Every front-end's open sessions: the pod's."""
        return sum(self._slots)
