"""The one interface between the front-end (``serving/``) and the engine (``engine/``): submit, then a Result.

``EngineClient.submit`` takes a ``PreparedRequest`` and returns a future of its ``Result``.

vLLM's ``EngineCoreClient`` shape: the front-end code exists once for both
``--frontend`` modes because it only ever sees an ``EngineClient``.  Inline,
that is the ``engine.core.Engine`` itself, on the same event loop; with
``--frontend process`` it is ``serving.mp_client.MPClient``, which ships each
request over the ring and channel of ``ipc.py`` to the model process, whose
``engine.link.FrontendLink`` submits it to the same ``Engine``.

Admission (``serving/admission.py``) turns a frame into a ``PreparedRequest``
once: decode, seed, session (scoped to its connection), the ``rtc`` entry
checked, and the policy's ``Preprocessor`` where it has one.  A policy without
one (every LeRobot family) leaves ``sample`` None and hands the decoded
``observation`` on: the engine calls ``Policy.prepare`` (``Engine.prepare``,
the one place it is called for a request), in the model process, never
decoding the frame a second time.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from policy_operator.readyz import Readiness
from policy_operator.runtime.errors import RequestError
from policy_operator.runtime.policy.interface import Preprocessor, Sample
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcRequest, RtcSupport
from policy_operator.runtime.rtc_session import scoped_session as scoped_session  # a session's key, for callers

# A frame of at most this many bytes is decoded and prepared on the event loop itself: a 224x224 camera frame
# costs ~0.05 ms to decode and ~0.1 ms to prepare, less than the two thread switches of handing it to a
# prepare thread and back.  Larger frames are decoded (admission) and prepared (the engine, for a policy without
# a Preprocessor) on a thread, so one robot's 4K image or a hostile frame (bounded by wire.py's structural
# limits) never holds the loop that answers every other session and /healthz, /readyz for longer than one GIL
# switch interval.
INLINE_MAX_BYTES = 1 << 19


@dataclass(frozen=True, slots=True)
class PreparedRequest:
    """One admitted request: what the engine needs, and what admission cost."""

    sample: Sample | None  # prepared by the policy's Preprocessor; None: the engine prepares ``observation``
    observation: Mapping[str, Any] | None  # the decoded frame, for a policy without a Preprocessor
    seed: int | None
    session: str | None  # ``scoped_session``: connection and session id
    rtc: RtcRequest | None = None  # the checked ``rtc`` entry, in the returned action space
    decode_ms: float = 0.0
    prepare_ms: float = 0.0
    frame_bytes: int = 0  # the engine prepares a frame above INLINE_MAX_BYTES off its event loop


@dataclass(frozen=True)
class AdmissionSpec:
    """What the engine tells the front-end once the model is loaded: the metadata every session gets first, the
    policy's Preprocessor (None: the engine prepares), and how ``rtc`` entries are checked."""

    metadata: dict[str, Any]
    preprocessor: Preprocessor | None
    rtc: RtcSupport
    action_shape: tuple[int, int]


class EngineClient(Protocol):
    """The engine as the front-end sees it, in this process or behind the ring and channel."""

    @property
    def accepting(self) -> bool:
        """Whether a new session or request is taken now (loaded, not draining, nothing failed)."""

    draining: bool  # read-only for the front-end: begin_drain and drain set it
    admission: AdmissionSpec | None  # how requests are admitted; None until the model is loaded

    def readiness(self) -> Readiness:
        """The ``/readyz`` document, as of now."""

    def submit(self, request: PreparedRequest) -> asyncio.Future[Result]:
        """Route, batch and compute ``request``; the future always resolves to its Result (an error too), on
        the calling event loop."""

    def begin_drain(self) -> None:
        """Take no new request from now on."""

    async def drain(self, grace_s: float) -> bool:
        """Take no new request and wait for those in flight; True when all were answered in time."""

    def give_up(self, error: RequestError) -> int:
        """Answer every request still waiting with ``error``; how many there were."""
