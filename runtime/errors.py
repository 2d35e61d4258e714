"""Why one request failed: one ``RequestError`` base, with a ``kind`` the client and the metrics see.

A request can fail at every stage it passes -- the frame (``WireError``), the
observation (``InvalidObservation``, raised by ``Policy.prepare`` before any
other rank sees the data), the server's state (``NotReady``), a cfg rank
(``PeerFailed``), or the replica as a whole (``RequestFailed``, rebuilt on
rank 0 from the replica's reply).  Each fails that request only; the server
answers with ``kind`` and the message (docs/protocol.md) and counts it in
``policy_request_errors{kind}``.  Anything else that escapes is a bug and is
reported as ``internal``.
"""

from __future__ import annotations

from enum import Enum


class ErrorKind(str, Enum):
    """The ``kind`` of an error reply and of the ``policy_request_errors`` metric."""

    BAD_FRAME = "bad_frame"
    INVALID_OBSERVATION = "invalid_observation"
    INVALID_RTC = "invalid_rtc"  # the observation's ``rtc`` entry is unusable (shape, delay, NaN/inf...)
    RTC_NO_PREVIOUS_CHUNK = "rtc_no_previous_chunk"  # ``executed`` on a session that received no chunk yet
    RTC_UNSUPPORTED = "rtc_unsupported"  # ``rtc`` sent to a server with --rtc off, or whose policy cannot take it
    NO_SESSION_STATE = "no_session_state"  # ``keyframes`` for a session the server keeps no model state of
    UNAVAILABLE = "unavailable"
    INFERENCE_FAILED = "inference_failed"
    NON_FINITE_ACTIONS = "non_finite_actions"  # NaN or inf in the actions: never sent to a robot
    REPLICA_FAILED = "replica_failed"  # a collective of the replica failed or timed out: the replica is gone
    REPLICA_UNAVAILABLE = "replica_unavailable"  # the replica stopped answering while it held the request
    UNAUTHORIZED = "unauthorized"  # refused before the WebSocket upgrade
    DRAIN_TIMEOUT = "drain_timeout"  # still computing when the drain's grace period ended: retry on another pod
    INTERNAL = "internal"

    def __str__(self) -> str:
        return self.value


class RequestError(Exception):
    """One request failed; the message goes back to the client verbatim."""

    kind: ErrorKind = ErrorKind.INTERNAL

    def __init__(self, message: str, kind: ErrorKind | None = None) -> None:
        super().__init__(message)
        if kind is not None:
            self.kind = kind


class WireError(RequestError, ValueError):
    """A frame that is not a valid openpi message."""

    kind = ErrorKind.BAD_FRAME


class InvalidObservation(RequestError, ValueError):
    """The observation is unusable (a missing key, a wrong shape...); raised by ``Policy.prepare``."""

    kind = ErrorKind.INVALID_OBSERVATION


class InvalidRtc(RequestError, ValueError):
    """The ``rtc`` entry of an observation is unusable; checked on the ingress, before any rank sees it."""

    kind = ErrorKind.INVALID_RTC


class RtcNoPreviousChunk(InvalidRtc):
    """``{"executed": n}`` refers to the last chunk this session received, and it received none."""

    kind = ErrorKind.RTC_NO_PREVIOUS_CHUNK


class RtcUnsupported(InvalidRtc):
    """Real-time chunking is off on this server (``--rtc off``) or its policy cannot take previous actions."""

    kind = ErrorKind.RTC_UNSUPPORTED


class NoSessionState(RequestError, ValueError):
    """A continuation (``keyframes``) the server cannot continue: no session id, no state kept for the session
    (never started here, evicted, or its connection gone), or a layout that keeps none; the robot sends a first
    chunk (docs/protocol.md, "Session continuation")."""

    kind = ErrorKind.NO_SESSION_STATE


class NotReady(RequestError):
    """Not loaded yet, or draining: the connection is closed with 1001 so the client reconnects elsewhere."""

    kind = ErrorKind.UNAVAILABLE


class PeerFailed(RequestError):
    """The request failed on a cfg rank; every rank of the replica raises it together."""

    kind = ErrorKind.INFERENCE_FAILED


class NonFiniteActions(RequestError):
    """The policy's actions hold NaN or inf (e.g. an input far outside what it was trained on)."""

    kind = ErrorKind.NON_FINITE_ACTIONS


class ReplicaFailed(RequestError):
    """A collective of the replica failed or timed out: its communicator is never used again.

    The rank that saw it publishes ``failed`` and exits non-zero, so torchrun
    stops the pod and Kubernetes restarts it (docs/runtime.md).
    """

    kind = ErrorKind.REPLICA_FAILED


class ReplicaUnavailable(RequestError):
    """The replica holding the request stopped heartbeating for longer than the request timeout."""

    kind = ErrorKind.REPLICA_UNAVAILABLE


class DrainTimeout(RequestError):
    """The server is shutting down and this request was still running when ``--drain-grace-s`` ended.

    Nothing is wrong with the request: the client retries it on another pod
    (the session is closed with 1001 right after the error).
    """

    kind = ErrorKind.DRAIN_TIMEOUT


class RequestFailed(RequestError):
    """The replica reported a failure; ``kind`` is the one the replica's driver saw."""

    kind = ErrorKind.INFERENCE_FAILED


_BY_KIND: dict[ErrorKind, type[RequestError]] = {
    ErrorKind.BAD_FRAME: WireError,
    ErrorKind.INVALID_OBSERVATION: InvalidObservation,
    ErrorKind.INVALID_RTC: InvalidRtc,
    ErrorKind.RTC_NO_PREVIOUS_CHUNK: RtcNoPreviousChunk,
    ErrorKind.RTC_UNSUPPORTED: RtcUnsupported,
    ErrorKind.NO_SESSION_STATE: NoSessionState,
    ErrorKind.UNAVAILABLE: NotReady,
    ErrorKind.NON_FINITE_ACTIONS: NonFiniteActions,
    ErrorKind.REPLICA_FAILED: ReplicaFailed,
    ErrorKind.REPLICA_UNAVAILABLE: ReplicaUnavailable,
    ErrorKind.DRAIN_TIMEOUT: DrainTimeout,
}


def error_of(kind: ErrorKind, message: str) -> RequestError:
    """The ``RequestError`` a ``Result`` of ``kind`` raises on the front-end: its own class where one has the
    kind (``NotReady`` closes the session with 1001), else ``RequestFailed`` with that kind."""
    cls = _BY_KIND.get(kind)
    return cls(message) if cls is not None else RequestFailed(message, kind)
