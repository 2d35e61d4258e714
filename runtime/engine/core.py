"""The engine of a pod: prepare where the front-end could not, route, and hand each request to a replica's lane.

Lives on global rank 0; the front-end (``serving/``) reaches it through
``engine_api.EngineClient``: in this process (``--frontend inline``: this
``Engine`` is that client) or from the front-end process over the ring and
channel (``engine/link.py``).  ``submit`` takes a ``PreparedRequest`` --
decoded, its ``rtc`` entry checked, prepared by the policy's ``Preprocessor``
where it has one -- and answers with a future of its ``Result``, built here
once.  A policy without a ``Preprocessor`` is prepared here (``prepare``: the
one call of ``Policy.prepare`` for a request), on the event loop for a small
frame and on the prepare thread for one above ``INLINE_MAX_BYTES``, so invalid
input never reaches a replica.  The router picks a replica and the request
goes down that replica's lane (``parallel/dispatch.py``): replica 0's lane is
the model thread of this process (build, warm-up and inference on one thread,
as OpenMP wants), replica k's hands the request to replica k's driver over
their gloo dispatch group.

Each lane batches the requests queued for its replica (``--max-batch``).  A
lane with room waits up to ``--batch-window-ms`` while requests are *expected*:
recent sessions (``recent_sessions``, from the front-end) that have no request
routed yet -- robots between their reply and their next request -- or requests
still being prepared here.  A lone robot is never expected by anyone but
itself, so it never waits.

Whether a replica may take work comes from the heartbeat board (under
torchrun its copy, ``BoardWatcher``: never the store on the event loop): a replica with a
rank that is not fresh and warm gets no new request, and a request whose
replica stops heartbeating fails with ``replica_unavailable`` once that has
lasted the request timeout (``--pg-timeout-s``), however long the replica's
lane stays blocked.  A replica that reports ``replica_failed`` (a broken
communicator) is out of service for good and the pod goes down
(``on_replica_failed``).  Time is the ``clock`` it is given (the event loop's
monotonic clock; tests drive their own).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from policy_operator import __version__
from policy_operator.layout import ParallelLayout
from policy_operator.readyz import LayoutDoc, RankReadiness, Readiness, all_ranks_ready
from policy_operator.runtime.engine.history import SessionHistory
from policy_operator.runtime.engine.router import Router
from policy_operator.runtime.engine_api import INLINE_MAX_BYTES, AdmissionSpec, PreparedRequest
from policy_operator.runtime.errors import ErrorKind, NotReady, ReplicaUnavailable, RequestError
from policy_operator.runtime.parallel.dispatch import InferenceRequest, Lane, Ran
from policy_operator.runtime.parallel.heartbeat import Board, BoardWatcher
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.sampler import SamplerSettings
from policy_operator.runtime.result import Result
from policy_operator.runtime.rtc_session import RtcIngress

log = logging.getLogger(__name__)

# Requests are routed by a board snapshot at most this old: reading every rank's beat and building its row
# per request cost the event loop as much as prepare.  /readyz always reads afresh (and refreshes it), and
# a rank's beat is only stale after 1.5 heartbeat periods, so routing sees what a probe would.
ROUTING_SNAPSHOT_S = 0.05


def _log_failure(index: int, reason: str) -> None:
    """A failed replica where nobody takes the pod down (an engine outside ``serve``)."""
    log.error("replica %d failed: %s", index, reason)


@dataclass(frozen=True, slots=True)
class _Routed:
    """A request its lane has not answered: the caller's future, where it went, when, and what it was."""

    answer: asyncio.Future[Result]
    replica: int
    routed_at: float
    request: PreparedRequest
    prepare_ms: float  # ``Engine.prepare``'s, for a policy without a Preprocessor


class Engine:
    """History, routing, lanes and readiness behind ``submit``: the in-process ``EngineClient``."""

    def __init__(
        self,
        layout: ParallelLayout,
        settings: SamplerSettings,
        board: Board | BoardWatcher,
        *,
        request_timeout_s: float,
        poll_s: float = 0.25,
        recent_sessions: Callable[[], int] = lambda: 0,
        on_replica_failed: Callable[[int, str], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``recent_sessions``: the front-end's count of sessions that may send soon (the batch window waits for
        them); ``on_replica_failed``: the worker takes the pod down, or says the shutdown ended the replica (None:
        an error in the log); ``clock``: monotonic seconds."""
        self.layout = layout
        self.settings = settings
        self.board = board
        self.request_timeout_s = request_timeout_s
        self.clock = clock
        self._poll_s = poll_s
        self._recent_sessions = recent_sessions
        self._on_replica_failed = on_replica_failed or _log_failure
        self.router = Router(layout.dp)
        self._members = [frozenset(layout.replica_ranks(k)) for k in range(layout.dp)]  # each replica's ranks
        self.lanes: list[Lane] = []
        self.policy: Policy | None = None
        self.rtc = RtcIngress.off()  # what ``rtc`` entries get: refused until the policy is attached
        self.history = SessionHistory(None)  # each session's past observations (Policy.history), set by attach
        self.load_error: str | None = None
        # what else this pod serves, for every session's first frame (the LeRobot gRPC port); set before attach
        self.extra_metadata: dict[str, Any] = {}
        self.bucket_ms: dict[int, float] | None = None  # set by attach under --latency-budget-ms
        self.admission: AdmissionSpec | None = None  # set by attach: how the front-end admits requests
        self.draining = False  # set by begin_drain / drain only
        self.failed: dict[int, str] = {}  # replica -> why its communicator failed; out of service for good
        self._preparing = 0  # requests in ``prepare`` off the loop: not routed yet
        # routed requests whose lane has not answered, by the lane's future
        self._pending: dict[asyncio.Future[Ran], _Routed] = {}
        self._unready_since: dict[int, float] = {}  # replica -> when the watch first saw it not ready
        self._watch_timer: asyncio.TimerHandle | None = None
        self._prepare_pool: ThreadPoolExecutor | None = None  # made for the first large frame
        self._preparations: set[asyncio.Task[None]] = set()
        self._snapshot: tuple[float, list[RankReadiness]] | None = None  # (clock time, ranks)
        self._problems: tuple[tuple[float, int], list[str | None]] | None = None  # of that snapshot
        # Request ids for the logs, unique across pods; seeds of requests without one.  Neither is a secret,
        # and os.urandom per request (uuid4, secrets) cost the event loop two system calls.
        self._id_prefix = secrets.token_hex(4)
        self._ids = itertools.count()
        self._seeds = random.Random(secrets.randbits(128))

    def attach(self, policy: Policy, lanes: list[Lane], bucket_ms: dict[int, float] | None = None) -> None:
        """The model is loaded: its lanes (built with ``expected=self.expected``) take requests; from now on the
        front-end admits sessions.  ``bucket_ms``: warm-up's batch times under ``--latency-budget-ms``
        (readiness shows them next to the lanes' max batch)."""
        self.policy = policy
        self.history = SessionHistory(policy, cfgp=self.layout.cfgp)
        self.lanes = lanes
        self.bucket_ms = {size: round(ms, 3) for size, ms in bucket_ms.items()} if bucket_ms else None
        self.rtc = RtcIngress.of(policy, self.settings.rtc, self.settings.rtc_max_delay)
        self.admission = AdmissionSpec(self.metadata(), policy.preprocessor(), self.rtc.support, policy.action_shape)

    def load_failed(self, reason: str) -> None:
        """The model did not load: /readyz says why, and no session is admitted."""
        self.load_error = reason

    def expected(self) -> int:
        """Requests likely to arrive within a batch window: recent sessions with nothing routed, or in prepare."""
        return max(self._preparing, self._recent_sessions() - sum(self.router.in_flight))

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
                **self.history.metadata(),  # a world model's session continuation (LingBot-VA), else nothing
                **self.extra_metadata,
            }
        )
        return meta

    def readiness(self) -> Readiness:
        ranks = self.board.snapshot()
        self._snapshot = (self.clock(), ranks)  # the routing snapshot too: it is the freshest there is
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

        Of the routing snapshot (the board, read at most ``ROUTING_SNAPSHOT_S`` ago), computed once per snapshot
        (and per failure).
        """
        now = self.clock()
        if self._snapshot is None or now - self._snapshot[0] > ROUTING_SNAPSHOT_S:
            self._snapshot = (now, self.board.snapshot())
        taken, ranks = self._snapshot
        key = (taken, len(self.failed))
        if self._problems is not None and self._problems[0] == key:
            return self._problems[1]
        problems: list[str | None] = []
        for k in range(self.layout.dp):
            if k in self.failed:
                problems.append(f"replica {k} failed")
                continue
            waiting = [f"rank {r.rank} {r.state.value}" for r in ranks if r.rank in self._members[k] and not r.ready]
            problems.append(f"replica {k}: {', '.join(waiting)}" if waiting else None)
        self._problems = (key, problems)
        return problems

    def _replica_failed(self, index: int, reason: str) -> None:
        if index not in self.failed:  # the worker says why (an error, or the shutdown's own end of the replica)
            self.failed[index] = reason
            self._on_replica_failed(index, reason)

    # --- the request path --------------------------------------------------------------
    def submit(self, request: PreparedRequest) -> asyncio.Future[Result]:
        """Prepare (where admission could not), route and queue ``request``; the future of its Result, which
        holds the failure when there is one: ``NotReady`` at once when no replica may take it,
        ``ReplicaUnavailable`` once its replica has not been ready for the request timeout while it held it.

        A future, not a task: the model process of ``--frontend process`` answers its requests from the
        future's callback, with no task per request."""
        answer: asyncio.Future[Result] = asyncio.get_running_loop().create_future()
        if not self.accepting:
            answer.set_result(
                Result.failed(NotReady("server is shutting down" if self.draining else "server is not ready yet"))
            )
            return answer
        if request.sample is not None:
            self._route(request, request.sample, 0.0, answer)
        elif request.frame_bytes <= INLINE_MAX_BYTES:
            started = time.perf_counter()
            try:
                sample = self.prepare(request)
            except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
                self._fail(answer, exc)
                return answer
            self._route(request, sample, (time.perf_counter() - started) * 1e3, answer)
        else:
            task = asyncio.ensure_future(self._prepare_off_loop(request, answer))
            self._preparations.add(task)
            task.add_done_callback(self._preparations.discard)
        return answer

    def prepare(self, request: PreparedRequest) -> Sample:
        """The request's observation prepared by the policy: the one call of ``Policy.prepare`` for a request
        (a policy with a ``Preprocessor`` was prepared at admission, ``serving/admission.py``)."""
        assert self.policy is not None and request.observation is not None
        return self.policy.prepare(request.observation)

    async def _prepare_off_loop(self, request: PreparedRequest, answer: asyncio.Future[Result]) -> None:
        """``prepare`` on the prepare thread: a large frame's, never on the loop that answers the probes."""
        if self._prepare_pool is None:
            self._prepare_pool = ThreadPoolExecutor(1, thread_name_prefix="prepare")
        started = time.perf_counter()
        self._preparing += 1
        try:
            sample = await asyncio.get_running_loop().run_in_executor(self._prepare_pool, self.prepare, request)
        except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
            self._fail(answer, exc)
            return
        finally:
            self._preparing -= 1
        if answer.done():  # given up on (a drain's deadline) while it was prepared
            self.kick()
            return
        self._route(request, sample, (time.perf_counter() - started) * 1e3, answer)

    def _fail(self, answer: asyncio.Future[Result], exc: BaseException) -> None:
        """``answer`` fails with ``exc`` before routing; a window that waited for this request ends."""
        if not isinstance(exc, RequestError):
            log.error("request failed", exc_info=exc)
        if not answer.done():
            answer.set_result(Result.failed(exc))
        self.kick()

    def kick(self) -> None:
        """A request was queued, or one a lane's window may be waiting for went elsewhere: every lane looks."""
        for lane in self.lanes:
            lane.kick()

    def _route(
        self, request: PreparedRequest, sample: Sample, prepare_ms: float, answer: asyncio.Future[Result]
    ) -> None:
        """Queue the request at the lane of the replica the router picks; its outcome resolves ``answer``."""
        try:
            rtc = self.rtc.constraint(request.rtc) if request.rtc is not None else None
            # on the loop: histories change on one thread; a continuation's keyframes are prepared here
            sample = self.history.extend(request.session, sample, request.observation)
            inference = InferenceRequest(
                f"{self._id_prefix}-{next(self._ids)}",
                sample,
                self._seeds.getrandbits(63) if request.seed is None else request.seed,
                rtc,
            )
            problems = self.replica_problems()
            if all(problems):
                raise NotReady("no replica can take a request: " + "; ".join(p for p in problems if p))
            index = self.router.acquire(request.session, usable=[p is None for p in problems])
            # The replica stays counted in flight until its lane is really free, even when this request
            # gave up on it: a lane blocked on a frozen replica must not be handed more work.
            task = self.lanes[index].submit(inference)  # its lane looks at once
        except Exception as exc:  # noqa: BLE001 - one request fails, the server carries on
            self._fail(answer, exc)
            return
        for k, lane in enumerate(self.lanes):  # a window another lane keeps for this request's session ends
            if k != index:
                lane.kick()
        self._pending[task] = _Routed(answer, index, self.clock(), request, prepare_ms)
        task.add_done_callback(self._lane_answered)
        if self._watch_timer is None:
            self._watch_timer = task.get_loop().call_later(self._poll_s, self._watch)

    def _lane_answered(self, task: asyncio.Future[Ran]) -> None:
        """The lane is done with a request (or the drain gave up on it): free the replica, note a failed one, and
        answer unless the caller has stopped waiting."""
        routed = self._pending.pop(task)
        answer = routed.answer
        self.router.release(routed.replica)
        if task.cancelled():
            if not answer.done():
                answer.cancel()
            return
        if (exc := task.exception()) is not None:
            if not answer.done():
                answer.set_result(Result.failed(exc))
            return
        ran = task.result()
        outcome = ran.outcome
        # here, not in the caller: the outcome may come after the request gave up (replica_unavailable)
        if outcome.error_kind is ErrorKind.REPLICA_FAILED:
            self._replica_failed(routed.replica, outcome.error)
        if answer.done():
            return
        actions, rtc = outcome.actions, routed.request.rtc
        if actions is not None and outcome.error_kind is None and rtc is not None:
            actions = rtc.frozen(actions)
        if self.history.state is not None and outcome.error_kind is None:  # a world model's session continues
            self.history.answered(routed.request.session, actions)  # from a chunk its robot received only
        answer.set_result(
            Result(
                actions,
                outcome.error_kind,
                outcome.error,
                outcome.infer_ms,
                ran.queue_ms,
                ran.batch_size,
                ran.replica,
                routed.request.decode_ms,
                routed.request.prepare_ms + routed.prepare_ms,
                outcome.stages,
            )
        )

    def _watch(self) -> None:
        """Every ``poll_s`` while requests are routed: one whose replica has not been ready (the board, a
        failure) for ``request_timeout_s`` since it was routed fails with ``ReplicaUnavailable``, however long
        the replica's lane stays blocked.  One timer for all requests instead of a wait with a timeout each."""
        self._watch_timer = None
        if not self._pending:
            self._unready_since.clear()
            return
        self.check_unready()
        self._watch_timer = asyncio.get_running_loop().call_later(self._poll_s, self._watch)

    def check_unready(self) -> None:
        """One look of the watch, as of ``clock()``: requests held by a replica unready for the request timeout
        fail with ``ReplicaUnavailable``."""
        now = self.clock()
        problems = self.replica_problems()
        for index, problem in enumerate(problems):
            if problem is None:
                self._unready_since.pop(index, None)
            else:
                self._unready_since.setdefault(index, now)
        for routed in list(self._pending.values()):
            problem = problems[routed.replica]
            if problem is None or routed.answer.done():
                continue
            if now - max(self._unready_since[routed.replica], routed.routed_at) >= self.request_timeout_s:
                routed.answer.set_result(
                    Result.failed(
                        ReplicaUnavailable(
                            f"{problem} for {self.request_timeout_s:g}s (--pg-timeout-s) while it held "
                            "this request; it gets no new requests until it is ready again"
                        )
                    )
                )

    def give_up(self, error: RequestError) -> int:
        """Answer every routed request still waiting for its replica with ``error``; how many there were.

        The drain's deadline: each request's session gets ``error`` at once, however long its batch still
        computes (the replica's late answer is dropped).
        """
        waiting = [(task, routed.answer) for task, routed in self._pending.items() if not routed.answer.done()]
        for task, answer in waiting:
            answer.set_result(Result.failed(error))
            if not task.done():
                task.set_exception(error)  # the lane skips it if it has not started
        return len(waiting)

    def begin_drain(self) -> None:
        self.draining = True

    async def drain(self, grace_s: float) -> bool:
        """Take no new request and wait for in-flight ones; True when all finished in time."""
        self.draining = True
        deadline = self.clock() + grace_s
        while self.router.total_in_flight() and self.clock() < deadline:
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
