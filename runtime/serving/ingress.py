"""The ingress of a pod: prepare, route, and hand each request to a replica's lane.

Lives on global rank 0 next to the WebSocket server.  Decoding and ``prepare``
(validation and preprocessing) run here, before routing, so invalid input never
reaches a replica; frames above ``INLINE_MAX_BYTES`` are decoded and prepared on
the prepare thread, never on the event loop that answers the probes.  The router picks a replica and the request goes down that replica's
lane (``parallel/dispatch.py``): replica 0's lane is the model thread of this
process (build, warm-up and inference on one thread, as OpenMP wants), replica
k's hands the request to replica k's driver over their gloo dispatch group.

Each lane batches the requests queued for its replica (``--max-batch``).  A
lane with room waits up to ``--batch-window-ms`` while requests are *expected*:
recently active sessions (``recent_sessions``, from the server) that have no
request routed yet -- robots between their reply and their next request, or
whose request is still in ``prepare``.  A lone robot is never expected by
anyone but itself, so it never waits.

Whether a replica may take work comes from the heartbeat board (under
torchrun its copy, ``BoardWatcher``: never the store on the event loop): a replica with a
rank that is not fresh and warm gets no new request, and a request whose
replica stops heartbeating fails with ``replica_unavailable`` once that has
lasted the request timeout (``--pg-timeout-s``), however long the replica's
lane stays blocked.  A replica that reports ``replica_failed`` (a broken
communicator) is out of service for good and the pod goes down
(``on_replica_failed``).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from policy_operator import __version__
from policy_operator.layout import ParallelLayout
from policy_operator.readyz import LayoutDoc, RankReadiness, Readiness, all_ranks_ready
from policy_operator.runtime.errors import ErrorKind, NotReady, ReplicaUnavailable, RequestError
from policy_operator.runtime.parallel.dispatch import InferenceRequest, Lane, Reply
from policy_operator.runtime.parallel.heartbeat import Board, BoardWatcher
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.observation import parse_seed, parse_session
from policy_operator.runtime.policy.rtc import RtcConstraint
from policy_operator.runtime.policy.sampler import SamplerSettings
from policy_operator.runtime.serving import wire
from policy_operator.runtime.serving.history import SessionHistory
from policy_operator.runtime.serving.router import Router
from policy_operator.runtime.serving.rtc_session import RTC_KEY, RtcIngress, RtcPrepared, RtcSession

log = logging.getLogger(__name__)

# A frame of at most this many bytes is decoded and prepared on the event loop itself: a 224x224 camera frame
# costs ~0.05 ms to decode and ~0.1 ms to prepare, less than the two thread switches of handing it to the
# prepare thread and back.  Larger frames are decoded and prepared on that thread, so one robot's 4K image or
# a hostile frame (bounded by wire.py's structural limits) never holds the loop that answers every other
# session and /healthz, /readyz for longer than one GIL switch interval.
INLINE_MAX_BYTES = 1 << 19

# Requests are routed by a board snapshot at most this old: reading every rank's beat and building its row
# per request cost the event loop as much as prepare.  /readyz always reads afresh (and refreshes it), and
# a rank's beat is only stale after 1.5 heartbeat periods, so routing sees what a probe would.
ROUTING_SNAPSHOT_S = 0.05


class Ingress:
    """What the server needs: metadata, readiness, ``infer``, drain."""

    def __init__(
        self,
        layout: ParallelLayout,
        settings: SamplerSettings,
        board: Board | BoardWatcher,
        *,
        request_timeout_s: float,
        poll_s: float = 0.25,
        recent_sessions: Callable[[], int] = lambda: 0,
        on_replica_failed: Callable[[int, str], None] = lambda index, reason: None,
    ) -> None:
        """``recent_sessions``: the server's count of sessions that may send soon (the batch window waits for
        them); ``on_replica_failed``: the worker takes the pod down."""
        self.layout = layout
        self.settings = settings
        self.board = board
        self.request_timeout_s = request_timeout_s
        self._poll_s = poll_s
        self._recent_sessions = recent_sessions
        self._on_replica_failed = on_replica_failed
        self.router = Router(layout.dp)
        self.lanes: list[Lane] = []
        self.policy: Policy | None = None
        self.rtc = RtcIngress.off()  # what ``rtc`` entries get: refused until the policy is attached
        self.history = SessionHistory(None)  # each session's past observations (Policy.history), set by attach
        self.load_error: str | None = None
        self.bucket_ms: dict[int, float] | None = None  # set by attach under --latency-budget-ms
        self.draining = False
        self.failed: dict[int, str] = {}  # replica -> why its communicator failed; out of service for good
        self.preparing = 0  # requests in decode or prepare: not routed yet
        # routed requests whose lane has not answered: lane future -> (the caller's future, replica, routed at)
        self._pending: dict[asyncio.Future[Reply], tuple[asyncio.Future[Reply], int, float]] = {}
        self._unready_since: dict[int, float] = {}  # replica -> when the watch first saw it not ready
        self._watch_timer: asyncio.TimerHandle | None = None
        self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        self._snapshot: tuple[float, list[RankReadiness]] | None = None  # (monotonic time, ranks)
        self._problems: tuple[tuple[float, int], list[str | None]] | None = None  # of that snapshot
        # Request ids for the logs, unique across pods; seeds of requests without one.  Neither is a secret,
        # and os.urandom per request (uuid4, secrets) cost the event loop two system calls.
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._seeds = random.Random(secrets.randbits(128))

    def attach(self, policy: Policy, lanes: list[Lane], bucket_ms: dict[int, float] | None = None) -> None:
        """The model is loaded: its policy prepares requests, its lanes (built with ``arriving=self.expected``)
        take them; from now on the server accepts sessions.  ``bucket_ms``: warm-up's batch times under
        ``--latency-budget-ms`` (readiness shows them next to the lanes' max batch)."""
        self.policy = policy
        self.history = SessionHistory(policy)
        self.lanes = lanes
        self.bucket_ms = {size: round(ms, 3) for size, ms in bucket_ms.items()} if bucket_ms else None
        self.rtc = RtcIngress.of(policy, self.settings.rtc, self.settings.rtc_max_delay)

    def expected(self) -> int:
        """Requests likely to arrive within a batch window: recent sessions with nothing routed, or in prepare."""
        return max(self.preparing, self._recent_sessions() - self.router.total_in_flight())

    @property
    def accepting(self) -> bool:
        return self.policy is not None and not self.draining and self.load_error is None and not self.failed

    def metadata(self) -> dict[str, Any]:
        assert self.policy is not None
        meta = dict(self.policy.metadata())
        settings = self.settings.for_policy(self.policy, self.layout.cfgp)  # the policy's own where flags are unset
        meta.update(
            {
                "server": "policy-operator",
                "server_version": __version__,
                "layout": self.layout.as_dict(),
                "steps": settings.steps,
                "guidance": settings.guidance,
                "action_shape": list(self.policy.action_shape),
                "rtc": self.rtc.support.metadata(),
            }
        )
        return meta

    def _ranks(self, fresh: bool = False) -> list[RankReadiness]:
        """The board, read at most ``ROUTING_SNAPSHOT_S`` ago (``fresh``: now)."""
        now = time.monotonic()
        if fresh or self._snapshot is None or now - self._snapshot[0] > ROUTING_SNAPSHOT_S:
            self._snapshot = (now, self.board.snapshot())
        return self._snapshot[1]

    def readiness(self) -> Readiness:
        ranks = self._ranks(fresh=True)
        failed = "; ".join(f"replica {k} failed: {why}" for k, why in sorted(self.failed.items()))
        return Readiness(
            ready=all_ranks_ready(ranks, self.layout.world_size) and self.accepting,
            layout=LayoutDoc(**self.layout.as_dict()),
            world_size=self.layout.world_size,
            ranks_ready=sum(1 for r in ranks if r.ready),
            ranks=ranks,
            in_flight=self.router.total_in_flight(),
            draining=self.draining,
            error=self.load_error or failed or None,
            max_batch=self.lanes[0].max_batch if self.lanes else None,
            batch_buckets_ms=self.bucket_ms,
        )

    def replica_problems(self) -> list[str | None]:
        """Per replica, why it may not take a request now (a failure, a rank not fresh and warm), or None.

        Of the routing snapshot, computed once per snapshot (and per failure).
        """
        ranks = self._ranks()
        assert self._snapshot is not None
        key = (self._snapshot[0], len(self.failed))
        if self._problems is None or self._problems[0] != key:
            self._problems = (key, self._problems_of(ranks))
        return self._problems[1]

    def _problems_of(self, ranks: Sequence[RankReadiness]) -> list[str | None]:
        problems: list[str | None] = []
        for k in range(self.layout.dp):
            if k in self.failed:
                problems.append(f"replica {k} failed")
                continue
            members = set(self.layout.replica_ranks(k))
            waiting = [f"rank {r.rank} {r.state.value}" for r in ranks if r.rank in members and not r.ready]
            problems.append(f"replica {k}: {', '.join(waiting)}" if waiting else None)
        return problems

    def _replica_failed(self, index: int, reason: str) -> None:
        if index not in self.failed:
            self.failed[index] = reason
            log.error("replica %d failed, the pod goes down: %s", index, reason)
            self._on_replica_failed(index, reason)

    # --- the request path --------------------------------------------------------------
    def _decode_and_prepare(
        self, message: bytes | str, rtc_session: RtcSession | None = None
    ) -> tuple[Sample, int | None, str | None, float, float, RtcPrepared | None]:
        """The frame's prepared sample, its seed and session, the milliseconds decode and prepare took, and its
        checked ``rtc`` entry (None without one)."""
        assert self.policy is not None
        t0 = time.perf_counter()
        obs = wire.decode_observation(message)
        t1 = time.perf_counter()
        seed, session = parse_seed(obs), parse_session(obs)
        sample = self.policy.prepare(obs)
        rtc = self.rtc.parse(obs, rtc_session, self.policy.action_shape) if RTC_KEY in obs else None
        return sample, seed, session, (t1 - t0) * 1e3, (time.perf_counter() - t1) * 1e3, rtc

    async def off_loop[T](self, fn: Callable[[], T]) -> T:
        """``fn()`` on the prepare thread: a large frame's decode and prepare, never on the loop that answers
        the probes."""
        return await asyncio.get_running_loop().run_in_executor(self._prepare_pool, fn)

    async def infer(self, message: bytes | str, rtc_session: RtcSession | None = None) -> Reply:
        """One frame in, its reply out (``actions`` set); any failure raises its ``RequestError``.

        ``rtc_session``: the connection's memory of the last chunk it received, which the short ``rtc`` form
        refers to; updated here with this reply's actions."""
        if not self.accepting:
            raise NotReady("server is shutting down" if self.draining else "server is not ready yet")
        self.preparing += 1
        try:
            if len(message) <= INLINE_MAX_BYTES:
                sample, seed, session, decode_ms, prepare_ms, rtc = self._decode_and_prepare(message, rtc_session)
            else:
                sample, seed, session, decode_ms, prepare_ms, rtc = await self.off_loop(
                    lambda: self._decode_and_prepare(message, rtc_session)
                )
        except BaseException:
            self.preparing -= 1
            self.kick()
            raise
        self.preparing -= 1  # dispatch kicks the lanes once it is queued
        reply = await self.dispatch(sample, seed, session, rtc.constraint if rtc is not None else None)
        actions = reply.unwrap()
        if rtc is not None:
            actions = rtc.request.frozen(actions)
        if rtc_session is not None:
            rtc_session.received(actions)
        return replace(reply, actions=actions, decode_ms=decode_ms, prepare_ms=prepare_ms)

    async def submit(
        self, sample: Sample, seed: int | None, session: str | None, rtc: RtcConstraint | None = None
    ) -> Reply:
        """A request prepared elsewhere: routed, batched and answered as ``infer``'s.

        The reply holds the replica's outcome as it is (an error too: the caller unwraps it)."""
        return await self.dispatch(sample, seed, session, rtc)

    def kick(self) -> None:
        """A request was queued, or one a lane's window may be waiting for went elsewhere: every lane looks."""
        for lane in self.lanes:
            lane.kick()

    def dispatch(
        self, sample: Sample, seed: int | None, session: str | None, rtc: RtcConstraint | None = None
    ) -> asyncio.Future[Reply]:
        """Queue the request at the lane of the replica the router picks; the future of its Reply (``replica``
        set by the lane), or ``ReplicaUnavailable`` once that replica has not been ready for the request timeout
        while it held the request.  Raises ``NotReady`` at once when no replica may take it.

        A future, not a task: the model process of ``--frontend process`` answers its requests from the
        future's callback, with no task per request."""
        try:
            sample = self.history.extend(session, sample)  # on the loop: sessions' histories change on one thread
            request = InferenceRequest(
                f"{self._id_prefix}-{next(self._ids)}",
                sample,
                self._seeds.getrandbits(63) if seed is None else seed,
                rtc,
            )
            problems = self.replica_problems()
            if all(problems):
                raise NotReady("no replica can take a request: " + "; ".join(p for p in problems if p))
            index = self.router.acquire(session, usable=[p is None for p in problems])
            # The replica stays counted in flight until its lane is really free, even when this request
            # gave up on it: a lane blocked on a frozen replica must not be handed more work.
            task = self.lanes[index].submit(request)  # its lane looks at once
        except BaseException:
            self.kick()
            raise
        for k, lane in enumerate(self.lanes):  # a window another lane keeps for this request's session ends
            if k != index:
                lane.kick()
        loop = task.get_loop()
        answer: asyncio.Future[Reply] = loop.create_future()
        self._pending[task] = (answer, index, time.monotonic())
        task.add_done_callback(self._lane_answered)
        if self._watch_timer is None:
            self._watch_timer = loop.call_later(self._poll_s, self._watch)
        return answer

    def _lane_answered(self, task: asyncio.Future[Reply]) -> None:
        """The lane is done with a request (or the drain gave up on it): free the replica, note a failed one, and
        pass the outcome on unless the caller has stopped waiting."""
        answer, index, _ = self._pending.pop(task)
        self.router.release(index)
        if task.cancelled():
            if not answer.done():
                answer.cancel()
            return
        if (exc := task.exception()) is not None:
            if not answer.done():
                answer.set_exception(exc)
            return
        # here, not in the caller: the reply may come after the request gave up (replica_unavailable)
        if (reply := task.result()).error_kind is ErrorKind.REPLICA_FAILED:
            self._replica_failed(index, reply.error)
        if not answer.done():
            answer.set_result(reply)

    def _watch(self) -> None:
        """Every ``poll_s`` while requests are routed: one whose replica has not been ready (the board, a
        failure) for ``request_timeout_s`` since it was routed fails with ``ReplicaUnavailable``, however long
        the replica's lane stays blocked.  One timer for all requests instead of a wait with a timeout each."""
        self._watch_timer = None
        if not self._pending:
            self._unready_since.clear()
            return
        now = time.monotonic()
        problems = self.replica_problems()
        for index, problem in enumerate(problems):
            if problem is None:
                self._unready_since.pop(index, None)
            else:
                self._unready_since.setdefault(index, now)
        for answer, index, routed in list(self._pending.values()):
            problem = problems[index]
            if problem is None or answer.done():
                continue
            if now - max(self._unready_since[index], routed) >= self.request_timeout_s:
                answer.set_exception(
                    ReplicaUnavailable(
                        f"{problem} for {self.request_timeout_s:g}s (--pg-timeout-s) while it held "
                        "this request; it gets no new requests until it is ready again"
                    )
                )
        self._watch_timer = asyncio.get_running_loop().call_later(self._poll_s, self._watch)

    def give_up(self, error: RequestError) -> int:
        """Fail every routed request still waiting for its replica with ``error``; how many there were.

        The drain's deadline: each request's session gets ``error`` at once, however long its batch still
        computes (the replica's late answer is dropped).
        """
        waiting = [(task, answer) for task, (answer, _, _) in self._pending.items() if not answer.done()]
        for task, answer in waiting:
            answer.set_exception(error)
            if not task.done():
                task.set_exception(error)  # the lane skips it if it has not started
        return len(waiting)

    async def drain(self, grace_s: float) -> bool:
        """Stop taking requests and wait for in-flight ones; True when all finished in time."""
        self.draining = True
        deadline = time.monotonic() + grace_s
        while self.router.total_in_flight() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.router.total_in_flight() == 0

    def stop_lanes(self) -> None:
        """Send Shutdown down every lane but failed ones, queued behind anything still running."""
        futures = [lane.stop() for lane in self.lanes if lane.index not in self.failed]
        for f in futures:
            try:
                f.result(timeout=30)
            except Exception as exc:  # noqa: BLE001 - a dead replica needs no Shutdown
                log.warning("shutdown not delivered: %s", exc)
