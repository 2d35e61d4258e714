"""How a request travels between the ranks of a pod: the whole protocol, both ends, in one module.

::

    rank 0 (engine)                     driver of replica k (cfg index 0)        cfg peer (cfg index 1)
    Lane k --Batch------------------->  Replica.serve_driver  (k >= 1 only)
                                        Replica.execute --Batch------------->  Replica.serve_peer
                                          both: sample_actions, one all_gather per step
    Lane k <---------Outcome per row--  postprocess (driver only)
    Lane k --Shutdown---------------->  --Shutdown-------------------------->  (loops end)

Replica 0's driver is global rank 0 itself: its lane calls ``Replica.answer``
on rank 0's model thread instead of sending.  Replica k >= 1 is reached over
the gloo dispatch group {0, driver_k}.  Inside a replica the driver wakes
its peer with one byte on the replica's gloo control group (year-long
timeout: an idle peer waits there), then broadcasts the message on the cfg
group, whose timeout is ``--pg-timeout-s``: a peer frozen before it took the
message fails the replica after that long instead of holding the driver for
ever, and a driver that froze after the wake-up fails its peer the same way.
Messages are typed dataclasses, pickled
by ``torch.distributed``'s object collectives.  Every loop handles one request
in try/except and carries on: a failed request is an ``Outcome`` with an error,
never the end of a rank -- except when a collective itself failed
(``ReplicaFailed``: a peer died or froze past ``--pg-timeout-s``).  A failed
communicator is never used again: the rank publishes ``failed``, its loop
ends and the rank exits non-zero, so torchrun stops the pod and it restarts
(NCCL's watchdog does the same on a GPU; docs/runtime.md).  Actions with NaN
or inf are never sent: the driver fails that request with
``non_finite_actions``.  ``Shutdown`` ends every loop, so no rank is left
holding a GPU when rank 0 goes.

Each lane is one single-thread executor: D replicas run D batches at once
while each replica stays serial, which keeps every replica's collectives in
the same order on all of its ranks.  A lane batches: the requests that
queued for it while its replica was busy (and, for up to ``window_s``, those
expected soon) go down as one ``Batch`` of at most ``max_batch``
requests of one shape (``Sample.group_key``); each gets its own ``Outcome``.
A failure of the batched computation fails exactly the requests of that
batch; actions with NaN or inf fail only their own request.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from policy_operator.readyz import RankState
from policy_operator.runtime.errors import (
    ErrorKind,
    NonFiniteActions,
    ReplicaFailed,
    RequestError,
)
from policy_operator.runtime.parallel.groups import Groups
from policy_operator.runtime.parallel.heartbeat import Heartbeat
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.rtc import RtcConstraint
from policy_operator.runtime.policy.sampler import CfgGroup, CfgMode, SamplerSettings, bucket_of, sample_actions

log = logging.getLogger(__name__)


# --- messages --------------------------------------------------------------------------------
@dataclass(frozen=True)
class InferenceRequest:
    """One validated request (``Policy.prepare`` already ran on rank 0), ready for any rank."""

    request_id: str
    sample: Sample
    seed: int
    rtc: RtcConstraint | None = None  # real-time chunking: the previous chunk's tail, in the model's space


@dataclass(frozen=True, slots=True)
class Outcome:
    """What a replica's driver computed for one request of a batch: the actions, or why there are none, and the
    batch's compute time.  Crosses from a replica's driver to rank 0; the engine makes the request's ``Result``
    of it (``runtime/result.py``) once the lane adds where and how long it waited (``Ran``)."""

    request_id: str
    infer_ms: float
    actions: np.ndarray | None = None
    error_kind: ErrorKind | None = None
    error: str = ""
    stages: tuple[tuple[str, float], ...] = ()  # the batch's compute by stage, seconds (Policy.stage_seconds)


@dataclass(frozen=True, slots=True)
class Ran:
    """A request's outcome as its lane hands it back: the replica's ``Outcome``, the wait for the replica (the
    queue and the batch window), the batch it ran in, and the replica."""

    outcome: Outcome
    queue_ms: float
    batch_size: int
    replica: int


@dataclass(frozen=True)
class Batch:
    """Requests a replica runs as one sampler call (one shape); answered with one Outcome per request, in order."""

    requests: tuple[InferenceRequest, ...]


@dataclass(frozen=True)
class Shutdown:
    """Ends the receiving loop (and, from a driver, its peer's)."""


Message = Batch | Shutdown


def _send(message: Message | list[Outcome], dst: int, group: dist.ProcessGroup) -> None:
    dist.send_object_list([message], dst=dst, group=group)


def _recv(src: int, group: dist.ProcessGroup) -> Any:
    box: list[Any] = [None]
    dist.recv_object_list(box, src=src, group=group)
    return box[0]


def _broadcast(message: Message | None, src: int, group: dist.ProcessGroup | None) -> Message:
    # None would mean the default (world) group: every replica's ranks, not this replica's two
    assert group is not None, "only a cfgp=2 replica broadcasts to its peer"
    box = [message]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]  # type: ignore[return-value]


def _collective_failed(what: str, exc: Exception) -> ReplicaFailed:
    first = str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__
    return ReplicaFailed(f"cfg collective failed ({what}): {first}")


def _to_peer(message: Message, groups: Groups) -> None:
    """Driver: wake the peer on the control group, then hand it ``message`` within the PG timeout.

    ``ReplicaFailed`` when the peer did not take it in time (frozen or gone): the groups are broken for good.
    """
    wake = dist.broadcast(torch.zeros(1, dtype=torch.uint8), groups.driver, group=groups.replica_ctrl, async_op=True)
    try:
        _broadcast(message, groups.driver, groups.cfg)
    except Exception as exc:  # noqa: BLE001 - gloo: timeout or closed pair; NCCL's watchdog ends the rank itself
        raise _collective_failed("handing a request to the peer", exc) from exc
    assert wake is not None
    wake.wait()  # the peer took the message, so it took the wake-up before it


def _from_driver(groups: Groups) -> Message:
    """Peer: wait (idle, for ever) for the driver's wake-up, then take its message within the PG timeout."""
    dist.broadcast(torch.zeros(1, dtype=torch.uint8), groups.driver, group=groups.replica_ctrl)
    try:
        return _broadcast(None, groups.driver, groups.cfg)
    except Exception as exc:  # noqa: BLE001 - the driver froze or died between the wake-up and the message
        raise _collective_failed("taking a request from the driver", exc) from exc


# --- the ranks of one replica --------------------------------------------------------------------
class Replica:
    """One rank's share of its replica: owns the policy and the replica's groups."""

    def __init__(self, policy: Policy, groups: Groups, settings: SamplerSettings, heartbeat: Heartbeat) -> None:
        self.policy = policy
        self.groups = groups
        self.settings = settings.for_policy(policy, groups.layout.cfgp)  # the policy's own steps and guidance
        self.integrator = policy.integrator(self.settings.steps)
        self.heartbeat = heartbeat
        self._cuda = policy.device.type == "cuda"
        # A plug-in written before ``postprocess_batch`` took the batch's sample keeps its one-argument form.
        self._postprocess_takes_sample = "sample" in inspect.signature(policy.postprocess_batch).parameters
        self.broken: str | None = None  # why a collective of this replica failed; set once, never cleared
        # the worker's: whether the pod is shutting down, when a peer leaving mid-collective is expected
        self.stopping: Callable[[], bool] = lambda: False
        self._cfg: CfgGroup | None = None
        if groups.layout.cfgp == 2:
            assert groups.cfg is not None, "a cfgp=2 replica has a cfg group"
            staging = self._cuda and dist.get_backend(groups.cfg) == "gloo"
            self._cfg = CfgGroup(groups.cfg, groups.cfg_index, staging)

    @contextmanager
    def _serving(self) -> Iterator[None]:
        """``serving`` in /readyz while this rank works on a request, ``warm`` again after (unless broken)."""
        self.heartbeat.set_state(RankState.SERVING)
        try:
            yield
        finally:
            if self.broken is None:
                self.heartbeat.set_state(RankState.WARM)

    def _sample(self, batch: Batch) -> tuple[torch.Tensor, Sample]:
        """Final x of the batch and the batch it was sampled from, padded to its bucket with copies of the last
        request (x's rows beyond are dropped; the sample keeps them)."""
        s = self.settings
        requests = list(batch.requests)
        requests += [requests[-1]] * (bucket_of(len(requests), s.buckets) - len(requests))
        sample = self.policy.collate([r.sample for r in requests])
        mode: CfgMode = "parallel" if self._cfg is not None else s.cfg_mode
        assert s.guidance is not None, "for_policy resolved it"
        x = sample_actions(
            self.policy,
            sample,
            [r.seed for r in requests],
            guidance=s.guidance,
            mode=mode,
            cfg_group=self._cfg,
            integrator=self.integrator,
            rtc_mode=s.rtc,
            rtc=[r.rtc for r in requests] if any(r.rtc is not None for r in requests) else None,
        )
        return x[: len(batch.requests)], sample

    # --- driver side (cfg index 0) ---------------------------------------------------------
    def execute(self, batch: Batch) -> tuple[list[np.ndarray], float]:
        """Run one batch on this replica (peer included); (actions per request, infer_ms), or the failure raised."""
        with self._serving():
            start = time.perf_counter()
            if self._cfg is not None:
                _to_peer(batch, self.groups)
            x, sample = self._sample(batch)
            actions = (
                self.policy.postprocess_batch(x, sample=sample)
                if self._postprocess_takes_sample
                else self.policy.postprocess_batch(x)
            )
            if self._cuda:  # a plug-in's postprocess_batch may leave work queued: infer_ms is the whole batch
                torch.cuda.synchronize(self.policy.device)
            return actions, (time.perf_counter() - start) * 1e3

    def answer(self, batch: Batch) -> list[Outcome]:
        """``execute`` as one Outcome per request: a failure is reported to its clients and this replica carries on.

        Unless a collective failed: then every Outcome says ``replica_failed`` and ``broken`` is set.
        """
        start = time.perf_counter()
        ids = [r.request_id for r in batch.requests]
        if self.broken is not None:
            return [Outcome(i, 0.0, error_kind=ErrorKind.REPLICA_FAILED, error=self.broken) for i in ids]
        try:
            actions, infer_ms = self.execute(batch)
            if len(actions) != len(ids):
                raise RuntimeError(f"postprocess_batch returned {len(actions)} action chunks for {len(ids)} requests")
        except Exception as exc:  # noqa: BLE001 - reported to the clients, the replica carries on
            kind = exc.kind if isinstance(exc, RequestError) else ErrorKind.INFERENCE_FAILED
            if isinstance(exc, ReplicaFailed):
                self.fail(str(exc))
            else:
                log.exception("batch of %d (%s) failed on replica %d", len(ids), ", ".join(ids), self.groups.dp_index)
            failed_ms = (time.perf_counter() - start) * 1e3
            return [Outcome(i, failed_ms, error_kind=kind, error=f"{type(exc).__name__}: {exc}") for i in ids]
        try:  # the policy's split of the batch it just ran: a timing, never a failure of the answer
            stages = tuple((str(k), float(v)) for k, v in self.policy.stage_seconds().items())
        except Exception:  # noqa: BLE001 - a timing, not an answer: the requests keep their actions
            log.warning("policy %s: stage_seconds failed", self.policy.name, exc_info=True)
            stages = ()
        outcomes: list[Outcome] = []
        for request_id, chunk in zip(ids, actions, strict=True):  # only a request whose actions hold NaN/inf fails
            bad = int(np.size(chunk) - np.count_nonzero(np.isfinite(chunk)))
            if not bad:
                outcomes.append(Outcome(request_id, infer_ms, chunk, stages=stages))
                continue
            error = NonFiniteActions(
                f"the policy produced {bad} NaN or inf values in its {np.shape(chunk)} actions; none were sent"
            )
            log.warning("request %s on replica %d: %s", request_id, self.groups.dp_index, error)
            outcomes.append(
                Outcome(request_id, infer_ms, error_kind=error.kind, error=f"{type(error).__name__}: {error}")
            )
        return outcomes

    def fail(self, reason: str) -> None:
        """Take this rank's replica out of service for good: ``failed`` in /readyz, loops end, the rank exits."""
        if self.broken is None:
            self.broken = reason
            # a drain whose grace period ended mid-request stops the ranks inside that request's collectives:
            # its failure is the shutdown's, no error (the request already got drain_timeout)
            (log.info if self.stopping() else log.error)(
                "rank %d: replica %d is out of service, its communicator is never used again%s: %s",
                self.groups.rank,
                self.groups.dp_index,
                " (the pod is shutting down)" if self.stopping() else "",
                reason,
            )
        self.heartbeat.set_state(RankState.FAILED, reason)

    def stop_peer(self) -> None:
        if self._cfg is not None and self.broken is None:  # a broken replica's groups are never used again
            try:
                _to_peer(Shutdown(), self.groups)
            except Exception as exc:  # noqa: BLE001 - a dead peer has nothing left to stop
                log.warning("could not send shutdown to the cfg peer: %s", exc)

    def serve_driver(self) -> None:
        """Driver of replica k >= 1: requests from rank 0 on the dispatch group until Shutdown."""
        group = self.groups.dispatch[self.groups.dp_index]
        while True:
            message = _recv(0, group)
            if isinstance(message, Shutdown):
                log.info("replica %d: shutdown", self.groups.dp_index)
                self.stop_peer()
                return
            _send(self.answer(message), 0, group)
            if self.broken is not None:
                return  # the worker exits non-zero; the peer saw the same failure

    # --- peer side (cfg index 1) -------------------------------------------------------------
    def serve_peer(self) -> None:
        """The unconditional branch of every request its driver broadcasts, until Shutdown."""
        while True:
            try:
                message = _from_driver(self.groups)
            except ReplicaFailed as exc:
                self.fail(str(exc))
                return  # the worker exits non-zero
            if isinstance(message, Shutdown):
                log.info("rank %d: shutdown", self.groups.rank)
                return
            with self._serving():
                try:
                    self._sample(message)  # the result is the driver's; this rank only contributes its branch
                except ReplicaFailed as exc:
                    self.fail(str(exc))
                except Exception:  # noqa: BLE001 - the driver fails the batch too; keep looping
                    log.exception("batch of %d failed on rank %d", len(message.requests), self.groups.rank)
            if self.broken is not None:
                return  # the worker exits non-zero


# --- rank 0's end: one lane per replica ------------------------------------------------------------
@dataclass
class _Queued:
    request: InferenceRequest
    key: Hashable
    future: asyncio.Future[Ran]
    enqueued: float


class Lane:
    """A serial, batching path from the engine to one replica; ``call`` and ``stop`` run on the lane's thread.

    Driven by events on the event loop, with no task of its own: ``submit``,
    ``kick``, the window's timer and the end of a batch each call ``_pump``,
    which starts a batch when the replica is free -- the oldest request and
    every queued one of its shape, up to ``max_batch``.  When the batch has
    room and ``expected()`` says requests are expected soon (the engine's
    count), it waits for them, up to ``window_s`` after the latest one that
    joined; with none expected it never waits, so a lone client's request goes
    to the replica within the ``submit`` call.  The replica's thread hands the
    replies back with one callback that resolves every request of the batch:
    each hop between the threads costs the request a scheduler wake-up.

    While a batch runs, a *full* batch (``max_batch`` requests of one shape)
    that queued behind it goes to the replica's thread at once and waits there:
    the thread starts it the moment the running one ends, without a round trip
    through the event loop, which may be busy sending the finished batch's
    replies and decoding the next frames.  A batch with room is formed only when
    the replica is free, so it can still grow.
    """

    def __init__(
        self,
        index: int,
        executor: ThreadPoolExecutor,
        call: Callable[[Batch], list[Outcome]],
        stop: Callable[[], None],
        *,
        max_batch: int = 1,
        window_s: float = 0.0,
        expected: Callable[[], int] = lambda: 0,
        on_batch: Callable[[int, int], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """``expected``: requests likely to arrive within a window (the engine's count); ``clock``: the
        window's time, in the event loop's units (tests drive it)."""
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.index = index
        self.executor = executor
        self.max_batch = max_batch
        self.window_s = window_s
        self.expected = expected
        self.clock = clock
        self.on_batch = on_batch  # (replica, batch size) of every batch it starts, on the event loop
        self._call = call
        self._stop = stop
        self._queue: deque[_Queued] = deque()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._running = 0  # batches with the replica's thread: the one it runs, and at most one full one queued
        # while the oldest request waits for others: (its shape, how many of it were queued, window end)
        self._window: tuple[Hashable, int, float] | None = None
        self._timer: asyncio.TimerHandle | None = None

    def submit(self, request: InferenceRequest) -> asyncio.Future[Ran]:
        """Queue ``request`` now (on the event loop thread); the future resolves once its batch has run."""
        self._loop = loop = asyncio.get_running_loop()
        item = _Queued(request, request.sample.group_key(), loop.create_future(), time.perf_counter())
        self._queue.append(item)
        self._pump()
        return item.future

    def kick(self) -> None:
        """Look again: a request was queued, or one the window may be waiting for went elsewhere."""
        self._pump()

    def _head(self) -> tuple[Hashable, int] | None:
        """The oldest queued request's shape and how many queued requests share it; None when none is queued."""
        while self._queue and self._queue[0].future.done():
            self._queue.popleft()  # its caller gave up before it ran
        if not self._queue:
            return None
        key = self._queue[0].key
        return key, sum(1 for item in self._queue if item.key == key and not item.future.done())

    def _pump(self) -> None:
        """Start the next batch if the replica is free and the batch need not wait, or queue a full one behind
        the running batch (any number of calls is fine)."""
        if self._running > 1 or self._loop is None:
            return
        head = self._head()
        if head is not None and self._running:
            if head[1] >= self.max_batch:
                self._start(head[0])
            return
        if head is not None and head[1] < self.max_batch and self.window_s > 0 and self.expected() > 0:
            # The window runs from the latest arrival: robots answered together come back one after the
            # other, each behind the others' decode and prepare on this one loop, so their spread grows
            # with their number.  Each extension needs a request, so the wait stays below max_batch windows.
            key, queued = head
            now = self.clock()
            if self._window is None or self._window[0] != key or queued > self._window[1]:
                self._window = (key, queued, now + self.window_s)
            remaining = self._window[2] - now
            if remaining > 0:
                if self._timer is not None:
                    self._timer.cancel()
                self._timer = self._loop.call_later(remaining, self._pump)
                return
        # the window ends: nothing is queued, or the batch starts now (with a batch running, none is open)
        self._window = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if head is not None:
            self._start(head[0])

    def _start(self, key: Hashable) -> None:
        """Take up to ``max_batch`` queued requests of shape ``key``, oldest first (others stay), and hand them to
        the replica's thread as one batch."""
        assert self._loop is not None
        items: list[_Queued] = []
        kept: deque[_Queued] = deque()
        while self._queue:
            item = self._queue.popleft()
            if item.future.done():  # its caller gave up before it ran
                continue
            if len(items) < self.max_batch and item.key == key:
                items.append(item)
            else:
                kept.append(item)
        self._queue = kept
        loop, batch = self._loop, Batch(tuple(item.request for item in items))
        if self.on_batch is not None:
            try:
                self.on_batch(self.index, len(items))
            except Exception:  # noqa: BLE001 - a metrics hook must never stop the lane
                log.exception("on_batch hook failed")

        def run() -> None:  # on the lane's thread
            started = time.perf_counter()
            waits = [(started - item.enqueued) * 1e3 for item in items]
            outcome: list[Outcome] | BaseException
            try:
                outcome = self._call(batch)
            except BaseException as exc:  # noqa: BLE001 - the lane's transport failed: every request of the batch
                outcome = exc
            try:
                loop.call_soon_threadsafe(self._finish, items, outcome, waits)
            except RuntimeError:  # the loop is closed: nobody waits for these any more
                pass

        self._running += 1
        try:
            self.executor.submit(run)
        except RuntimeError as exc:  # the executor is shut down
            self._finish(items, exc, [0.0] * len(items))

    def _finish(self, items: list[_Queued], outcome: list[Outcome] | BaseException, waits: list[float]) -> None:
        """On the event loop: every request of the batch gets its reply (or the failure), then the next batch."""
        self._running -= 1
        if not isinstance(outcome, BaseException) and len(outcome) != len(items):
            outcome = RuntimeError(f"replica {self.index} answered {len(outcome)} of {len(items)} requests")
        for k, item in enumerate(items):
            if item.future.done():
                continue
            if isinstance(outcome, BaseException):
                item.future.set_exception(outcome)
            else:
                item.future.set_result(Ran(outcome[k], waits[k], len(items), self.index))
        assert self._loop is not None
        head = self._head()
        if head is not None and head[1] >= self.max_batch:
            # full already: off to the replica before the loop resumes this batch's sessions, so the device
            # does not idle while the event loop sends their replies
            self._pump()
        else:
            # after the callbacks the replies just scheduled: they release this batch's requests, so
            # ``expected`` counts those sessions as coming back instead of still in flight
            self._loop.call_soon(self._pump)

    def stop(self) -> Future[None]:
        """Send Shutdown down the lane, queued behind anything still running on it."""
        return self.executor.submit(self._stop)


def local_lane(replica: Replica, executor: ThreadPoolExecutor, **batching: Any) -> Lane:
    """Replica 0: rank 0 is its driver, so the lane runs it on rank 0's model thread."""
    return Lane(0, executor, replica.answer, replica.stop_peer, **batching)


def remote_lane(
    index: int, driver: int, group: dist.ProcessGroup, executor: ThreadPoolExecutor, **batching: Any
) -> Lane:
    """Replica ``index`` >= 1: hand the batch to its driver over their dispatch group, wait for the Replies."""

    def call(batch: Batch) -> list[Outcome]:
        _send(batch, driver, group)
        return _recv(driver, group)

    return Lane(index, executor, call, lambda: _send(Shutdown(), driver, group), **batching)
