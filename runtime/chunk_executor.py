"""Asynchronous action-chunk execution for a robot loop, with real-time chunking over the wire.

A robot loop calls ``ChunkExecutor.act(observation)`` once per control tick
and executes the action it returns.  The executor plays the current chunk and,
``execution_horizon`` actions before it would switch, asks the server for the
next one in the background while the robot keeps executing.  The reply is
aligned with the tick its request was sent at: when it arrives d ticks later,
the robot switches to its action d.  With ``rtc`` the request carries the
current chunk's unexecuted tail and the expected delay (the largest recent
delay, measured in ticks), so the server freezes the new chunk's first d
actions to what the robot executes meanwhile and guides the rest toward the
old chunk (docs/protocol.md); without it the new chunk is whatever the policy
samples, and the arm jumps at every switch.

``boundary_jumps`` records the largest change of any action dimension between
the last action executed from the old chunk and the first from the new one;
``switch_offsets`` the same between the first new action and the action the
old chunk had for that tick -- what the switch itself adds to the motion (the
jump also holds the policy's own step between consecutive actions, which for
a random-weight model is as large as any switch).
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

Infer = Callable[[dict[str, Any]], np.ndarray]


def boundary_jump(last_old: np.ndarray, first_new: np.ndarray) -> float:
    """Largest absolute change over the action dimensions between two consecutive executed actions."""
    return float(np.max(np.abs(np.asarray(first_new, np.float64) - np.asarray(last_old, np.float64))))


@dataclass
class ExecutorStats:
    boundary_jumps: list[float] = field(default_factory=list)  # one per switch to a new chunk
    switch_offsets: list[float] = field(default_factory=list)  # first new action vs the old chunk's for that tick
    step_sizes: list[float] = field(default_factory=list)  # the same measure between actions of one chunk
    delays: list[int] = field(default_factory=list)  # ticks from a request to the switch to its chunk
    sent_delays: list[int | None] = field(default_factory=list)  # the inference_delay each switch's request sent
    latencies_s: list[float] = field(default_factory=list)
    starved_ticks: int = 0  # ticks that repeated the last action: the chunk ran out before the next arrived


class ChunkExecutor:
    """Plays action chunks at a control rate, fetching each next chunk while the current one runs.

    ``infer`` sends one observation and returns the chunk (it runs on a thread of the executor's own, so
    a blocking WebSocket client is fine).  ``execution_horizon``: how many actions of a chunk are executed
    before the next one is used (the request leaves ``execution_horizon - delay`` actions in).
    ``max_delay`` caps the delay sent to the server (its metadata's ``rtc.max_inference_delay``).
    ``short_form``: send ``{"executed": n}`` and let the server take the tail from the chunk it sent last.
    ``control_hz``: the loop's rate, if known: the first chunk's latency then seeds the delay estimate.
    A switch whose reply came within the delay it announced starts exactly on the old chunk's action.
    """

    def __init__(
        self,
        infer: Infer,
        *,
        execution_horizon: int,
        rtc: bool = True,
        max_delay: int | None = None,
        short_form: bool = True,
        delay_window: int = 5,
        control_hz: float | None = None,
    ) -> None:
        if execution_horizon < 1:
            raise ValueError(f"execution_horizon must be >= 1, got {execution_horizon}")
        self._infer = infer
        self.execution_horizon = execution_horizon
        self.rtc = rtc
        self.max_delay = max_delay
        self.short_form = short_form
        self.control_hz = control_hz
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="chunk-request")
        self._chunk: np.ndarray | None = None
        self._start = 0  # the tick the current chunk's action 0 belongs to
        self._tick = 0
        # (reply, tick sent, monotonic time sent, inference_delay sent or None)
        self._pending: tuple[Future[np.ndarray], int, float, int | None] | None = None
        self._recent = deque([1], maxlen=delay_window)  # recent delays in ticks, for the next estimate
        self._last: np.ndarray | None = None
        self._switched_now = False  # this tick's action is the first of a new chunk: a boundary, not a step
        self.stats = ExecutorStats()

    @property
    def in_flight(self) -> Future[np.ndarray] | None:
        """The next chunk's request while it is on its way, None otherwise: a caller that must not tick past
        the reply (a test, a replay at a fixed delay) waits on it."""
        return self._pending[0] if self._pending is not None else None

    def expected_delay(self, remaining: int) -> int:
        """Ticks the next reply will likely take: the largest recent delay, within what the server and the
        chunk allow (at most ``remaining - 1`` so the new chunk starts inside the old one's tail)."""
        d = max(self._recent)
        if self.max_delay is not None:
            d = min(d, self.max_delay)
        return max(0, min(d, remaining - 1))

    def act(self, observation: dict[str, Any]) -> np.ndarray:
        """The action to execute at this tick (the first call blocks for the first chunk)."""
        if self._chunk is None:
            started = time.monotonic()
            self._chunk, self._start = self._infer(dict(observation)), self._tick
            self.stats.latencies_s.append(time.monotonic() - started)
            if self.control_hz:
                self._recent.append(max(1, math.ceil(self.stats.latencies_s[-1] * self.control_hz)))
        self._maybe_switch()
        index = self._tick - self._start
        if self._pending is None and index >= max(0, self.execution_horizon - max(self._recent)):
            self._request(observation, index)
        chunk = self._chunk
        if index >= len(chunk):
            self.stats.starved_ticks += 1
        action = chunk[min(index, len(chunk) - 1)]
        if self._last is not None and not self._switched_now:
            self.stats.step_sizes.append(boundary_jump(self._last, action))
        self._last = action
        self._tick += 1
        return action

    def _request(self, observation: dict[str, Any], index: int) -> None:
        assert self._chunk is not None
        obs = dict(observation)
        remaining = len(self._chunk) - index
        delay: int | None = None
        if self.rtc and remaining >= 1:
            delay = self.expected_delay(remaining)
            if self.short_form:
                obs["rtc"] = {"executed": index, "inference_delay": delay}
            else:
                obs["rtc"] = {
                    "prev_actions": np.ascontiguousarray(self._chunk[index:], dtype=np.float32),
                    "inference_delay": delay,
                }
        self._pending = (self._pool.submit(self._infer, obs), self._tick, time.monotonic(), delay)

    def _maybe_switch(self) -> None:
        self._switched_now = False
        if self._pending is None or not self._pending[0].done():
            return
        future, sent, started, sent_delay = self._pending
        self._pending = None
        new = future.result()  # a failed request raises here, in the robot loop: the caller decides
        self.stats.latencies_s.append(time.monotonic() - started)
        delay = self._tick - sent
        self._recent.append(max(delay, 1))
        if delay >= len(new):
            return  # stale before it was used: keep the current chunk (the next request is sent at once)
        self.stats.delays.append(delay)
        self.stats.sent_delays.append(sent_delay)
        if self._last is not None and self._chunk is not None:
            self.stats.boundary_jumps.append(boundary_jump(self._last, new[delay]))
            old = self._chunk[min(self._tick - self._start, len(self._chunk) - 1)]
            self.stats.switch_offsets.append(boundary_jump(old, new[delay]))
        self._chunk, self._start, self._switched_now = new, sent, True

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def run_robot(
    executor: ChunkExecutor, observe: Callable[[int], dict[str, Any]], *, control_hz: float, ticks: int
) -> ExecutorStats:
    """Drive ``executor`` in real time at ``control_hz`` for ``ticks`` ticks, as a robot's loop would."""
    period = 1.0 / control_hz
    next_tick = time.monotonic()
    for k in range(ticks):
        executor.act(observe(k))
        next_tick += period
        pause = next_tick - time.monotonic()
        if pause > 0:
            time.sleep(pause)
        elif pause < -period:  # far behind (a blocking first request): do not replay the missed ticks at once
            next_tick = time.monotonic()
    return executor.stats


def summarize(stats: ExecutorStats) -> dict[str, Any]:
    jumps, steps = stats.boundary_jumps, stats.step_sizes

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else math.nan

    return {
        "switches": len(jumps),
        "boundary_jump_mean": mean(jumps),
        "boundary_jump_max": max(jumps) if jumps else math.nan,
        "switch_offset_mean": mean(stats.switch_offsets),
        # switches whose reply came within the delay its request announced (RTC: they start on the old action)
        "on_time_offsets": [
            o
            for o, d, sd in zip(stats.switch_offsets, stats.delays, stats.sent_delays, strict=True)
            if sd is not None and d <= sd
        ],
        "step_size_mean": mean(steps),  # the same measure inside a chunk, for scale
        "delay_ticks_mean": mean([float(d) for d in stats.delays]),
        "latency_ms_p50": float(np.median(stats.latencies_s) * 1e3) if stats.latencies_s else math.nan,
        "starved_ticks": stats.starved_ticks,
    }


# --- a simulated robot against a server (policyserver client --rtc) ---------------------------------------
def simulate(
    url: str,
    *,
    control_hz: float,
    seconds: float,
    rtc: bool,
    execution_horizon: int | None = None,
    headers: dict[str, str] | None = None,
    timeout: float = 60.0,
    seed: int = 0,
) -> dict[str, Any]:
    """A robot at ``control_hz`` for ``seconds`` against ``url``, one connection, chunks fetched asynchronously.

    Every request carries its own seed (``seed + k``), so the policy samples a different chunk each time
    as a real robot's changing observation would make it; the camera frame and state stay fixed.
    """
    from websockets.sync.client import connect

    from policy_operator.runtime.robolab import robolab_observation
    from policy_operator.runtime.serving import wire

    with connect(url, additional_headers=headers, max_size=None, open_timeout=timeout, compression=None) as ws:
        meta = wire.unpackb(ws.recv(timeout=timeout))
        horizon = int(meta["action_horizon"])
        rtc_meta = meta.get("rtc") or {}
        if rtc and rtc_meta.get("mode", "off") == "off":
            raise RuntimeError(f"the server does not do real-time chunking: rtc={rtc_meta or 'not announced'}")
        requests = iter(range(1 << 62))

        def infer(obs: dict[str, Any]) -> np.ndarray:
            obs["seed"] = seed + next(requests)
            ws.send(wire.packb(obs))
            reply = ws.recv(timeout=timeout)
            if isinstance(reply, str):
                raise RuntimeError(f"server error: {reply}")
            msg = wire.unpackb(reply)
            if msg.get("type") == "error":
                raise RuntimeError(f"server error: {msg['error']['kind']}: {msg['error']['message']}")
            return np.asarray(msg["actions"])

        executor = ChunkExecutor(
            infer,
            execution_horizon=execution_horizon or max(1, horizon // 2),
            rtc=rtc,
            max_delay=rtc_meta.get("max_inference_delay"),
            control_hz=control_hz,
        )
        observation = robolab_observation(meta, seed)
        try:
            stats = run_robot(
                executor, lambda k: observation, control_hz=control_hz, ticks=max(1, round(seconds * control_hz))
            )
        finally:
            executor.close()
    summary = summarize(stats)
    summary.update(
        {
            "rtc": rtc,
            "rtc_mode": rtc_meta.get("mode", "off") if rtc else "off",
            "execution_horizon": executor.execution_horizon,
            "action_horizon": horizon,
        }
    )
    return summary


def format_comparison(rows: list[dict[str, Any]]) -> str:
    """One line per run: how large the jumps at chunk switches were, next to the steps inside a chunk."""
    lines = [
        f"  {'run':<16} {'switches':>8} {'jump mean':>10} {'jump max':>10} {'vs old plan':>11} {'step mean':>10} "
        f"{'delay':>6} {'p50 ms':>8} {'starved':>8}"
    ]
    for r in rows:
        name = f"rtc {r['rtc_mode']}" if r["rtc"] else "no rtc"
        lines.append(
            f"  {name:<16} {r['switches']:>8} {r['boundary_jump_mean']:>10.4f} {r['boundary_jump_max']:>10.4f} "
            f"{r['switch_offset_mean']:>11.4f} {r['step_size_mean']:>10.4f} {r['delay_ticks_mean']:>6.2f} "
            f"{r['latency_ms_p50']:>8.1f} {r['starved_ticks']:>8}"
        )
    lines += [
        "  jump: largest change of an action dimension from the last old action executed to the first new one;",
        "  vs old plan: the same from the old chunk's action for that tick (what the switch adds);",
        "  step: the same between consecutive actions of one chunk; delay: ticks from request to switch",
    ]
    return "\n".join(lines)
