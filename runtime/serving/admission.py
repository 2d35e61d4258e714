"""The front-end's one admission step, and the server's backend in both ``--frontend`` modes.

``admit`` turns a frame into an ``engine_api.PreparedRequest``: decode, seed,
session (scoped to its connection), the
policy's ``Preprocessor`` where it has one, and the ``rtc`` entry checked
against the connection's memory.  It is written once: inline the server calls
it on rank 0's event loop, with ``--frontend process`` in the front-end
process, and either way the request then goes to an ``EngineClient`` (the
``Engine`` itself, or ``mp_client.MPClient``).  A frame above
``INLINE_MAX_BYTES`` is admitted on the admission thread, never on the event
loop that answers the probes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from policy_operator.readyz import Readiness
from policy_operator.runtime.engine_api import INLINE_MAX_BYTES, AdmissionSpec, EngineClient, PreparedRequest
from policy_operator.runtime.errors import NotReady, RequestError
from policy_operator.runtime.policy.observation import parse_request_keys
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RTC_KEY, RtcSession, parse_rtc, scoped_session
from policy_operator.runtime.serving import wire


def admit(spec: AdmissionSpec, scope: str, message: bytes | str, connection: RtcSession) -> PreparedRequest:
    """``message`` decoded, checked and (with a ``Preprocessor``) prepared; raises its ``RequestError``.

    ``scope``: this front-end's share of the connection numbers (several front-end processes each count their
    own), ``connection``: the connection the frame came on, whose sessions are its own (``scoped_session``)."""
    t0 = time.perf_counter()
    obs = wire.decode_observation(message)
    t1 = time.perf_counter()
    seed, session = parse_request_keys(obs)
    sample = spec.preprocessor.prepare(obs) if spec.preprocessor is not None else None
    rtc = None
    if RTC_KEY in obs:
        spec.rtc.check()
        rtc = parse_rtc(obs[RTC_KEY], connection, action_shape=spec.action_shape, max_delay=spec.rtc.max_delay)
    return PreparedRequest(
        sample,
        obs if sample is None else None,
        seed,
        scoped_session(f"{scope}.{connection.connection}", session),
        rtc,
        (t1 - t0) * 1e3,
        (time.perf_counter() - t1) * 1e3,
        len(message),
    )


class FrontEnd:
    """What the WebSocket server (and any other front-end: ``--lerobot-grpc-port``) calls: ``infer`` one frame
    through admission and the engine; readiness, metadata and draining from the engine client."""

    def __init__(self, engine: EngineClient, *, scope: str = "0", thread_init: Callable[[], Any] | None = None) -> None:
        """``thread_init``: run once on the admission thread (the front-end process keeps it to one intra-op
        thread)."""
        self.engine = engine
        self.scope = scope
        self._thread_init = thread_init
        self._pool: ThreadPoolExecutor | None = None

    @property
    def draining(self) -> bool:
        return self.engine.draining

    @property
    def accepting(self) -> bool:
        return self.engine.accepting and self.engine.admission is not None

    def begin_drain(self) -> None:
        self.engine.begin_drain()

    def metadata(self) -> dict[str, Any]:
        spec = self.engine.admission
        assert spec is not None
        return spec.metadata

    def readiness(self) -> Readiness:
        return self.engine.readiness()

    async def infer(self, message: bytes | str, connection: RtcSession | None = None) -> Result:
        """One frame in, its Result out (``actions`` set); any failure raises its ``RequestError``.

        ``connection``: the connection's state (the last chunk it received, which the short ``rtc`` form refers
        to, updated here; the scope of its sessions).  None: a connection of its own for this one request.
        A frame above ``INLINE_MAX_BYTES`` is admitted on the admission thread."""
        spec = self.engine.admission
        if spec is None:
            raise NotReady("server is shutting down" if self.engine.draining else "server is not ready yet")
        connection = RtcSession() if connection is None else connection
        if len(message) <= INLINE_MAX_BYTES:
            prepared = admit(spec, self.scope, message, connection)
        else:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(
                    1,
                    thread_name_prefix="admit",
                    initializer=self._thread_init if self._thread_init is not None else (lambda: None),
                )
            prepared = await asyncio.get_running_loop().run_in_executor(
                self._pool, admit, spec, self.scope, message, connection
            )
        result = await self.engine.submit(prepared)  # the engine refuses it (NotReady) when it takes none now
        connection.last = result.unwrap()  # what its next short-form rtc entry refers to
        return result

    async def drain(self, grace_s: float) -> bool:
        return await self.engine.drain(grace_s)

    def give_up(self, error: RequestError) -> int:
        return self.engine.give_up(error)
