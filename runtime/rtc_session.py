"""The ``rtc`` entry of an observation: checked at admission, resolved against the connection's memory, mapped by the engine.

Two forms (docs/protocol.md):

* ``{"prev_actions": float[h, A], "inference_delay": d, "execution_horizon": s}``: the unexecuted tail of
  the previous chunk, in the action space the server returned;
* ``{"executed": n, "inference_delay": d, "execution_horizon": s}``: the same, taken from the last chunk
  this connection received (``RtcSession``): ``prev_actions = last[n:]``.

``execution_horizon`` is optional (default h).  Every check raises an ``InvalidRtc`` (or
``RtcNoPreviousChunk``/``RtcUnsupported``) that names the field, so a bad entry fails its request only and
never reaches a rank.  The session memory lives with the connection: a chunk goes to the robot that
received it, whichever replica computed it.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from policy_operator.runtime.errors import InvalidRtc, RtcNoPreviousChunk, RtcUnsupported
from policy_operator.runtime.policy.interface import Policy
from policy_operator.runtime.policy.rtc import RtcConstraint, rtc_unsupported

RTC_KEY: Final = "rtc"
PREV_ACTIONS: Final = "prev_actions"
EXECUTED: Final = "executed"
DELAY: Final = "inference_delay"
HORIZON: Final = "execution_horizon"
FIELDS: Final = (PREV_ACTIONS, EXECUTED, DELAY, HORIZON)


@dataclass(frozen=True)
class RtcRequest:
    """A checked ``rtc`` entry, in the returned action space."""

    prev_actions: np.ndarray  # [h, A] float32, finite; 1 <= h <= action horizon
    delay: int  # 0 <= delay <= min(h, max delay), < action horizon
    horizon: int  # delay <= horizon <= h

    def frozen(self, actions: np.ndarray) -> np.ndarray:
        """The reply's actions with the first ``delay`` set to ``prev_actions[:delay]`` bit for bit: the sampler
        made them equal in the model's space, and postprocessing the inverse map is exact only up to rounding."""
        if self.delay == 0:
            return actions
        out = np.array(actions, dtype=np.float32, copy=True)
        out[: self.delay] = self.prev_actions[: self.delay]
        return out


_connections = itertools.count()


def scoped_session(connection: str, session_id: str | None) -> str | None:
    """The key of a session's state (history, replica stickiness): its connection and the id the client chose.

    A session belongs to the connection that names it: another connection sending the same ``session_id``
    gets a session of its own, never the first one's history.  A reconnect is a new connection, so its
    session starts afresh (docs/protocol.md, "Sessions")."""
    return None if session_id is None else f"{connection}\x00{session_id}"


class RtcSession:
    """A connection's own state: what its short-form requests refer to (the last chunk it received, None before
    the first), and the number that scopes its sessions (``scoped_session``): unique in its process
    for the process's life, so two connections never share a session's state."""

    def __init__(self) -> None:
        self.last: np.ndarray | None = None  # set by the front-end with every chunk the connection receives
        self.connection = next(_connections)


def _integer(entry: Mapping[str, Any], key: str) -> int | None:
    if key not in entry or entry[key] is None:
        return None
    value = entry[key]
    if isinstance(value, np.ndarray) and value.shape == ():
        value = value.item()
    if isinstance(value, np.integer):
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRtc(f"rtc.{key} must be an integer number of control steps, got {type(value).__name__}")
    return value


def _prev_actions(value: Any, action_shape: tuple[int, int]) -> np.ndarray:
    horizon, action_dim = action_shape
    if isinstance(value, (list, tuple)):
        try:
            value = np.asarray(value, dtype=np.float64)
        except (ValueError, TypeError) as exc:
            raise InvalidRtc(f"rtc.{PREV_ACTIONS} must be a float array [h, {action_dim}]: {exc}") from None
    if not isinstance(value, np.ndarray):
        raise InvalidRtc(f"rtc.{PREV_ACTIONS} must be a float array [h, {action_dim}], got {type(value).__name__}")
    if value.dtype.kind not in "fiu" or value.dtype == np.bool_:
        raise InvalidRtc(f"rtc.{PREV_ACTIONS} must be a float array, got dtype {value.dtype.str}")
    if value.ndim != 2 or value.shape[1] != action_dim or not 1 <= value.shape[0] <= horizon:
        raise InvalidRtc(
            f"rtc.{PREV_ACTIONS} must have shape (h, {action_dim}) with 1 <= h <= {horizon} (the "
            f"action horizon), got {value.shape}"
        )
    with np.errstate(over="ignore"):  # a float64 beyond float32's range becomes inf, refused below
        actions = value.astype(np.float32)
    if not np.isfinite(actions).all():
        raise InvalidRtc(f"rtc.{PREV_ACTIONS} contains NaN or inf (or values beyond float32)")
    return actions


def parse_rtc(entry: Any, session: RtcSession | None, *, action_shape: tuple[int, int], max_delay: int) -> RtcRequest:
    """The request's constraint in the returned action space; raises an ``InvalidRtc`` kind on any problem."""
    if not isinstance(entry, Mapping):
        raise InvalidRtc(
            f"{RTC_KEY!r} must be a map with {PREV_ACTIONS!r} or {EXECUTED!r}, "
            f"{DELAY!r} and optionally {HORIZON!r}, got {type(entry).__name__}"
        )
    unknown = sorted(str(k) for k in entry if k not in FIELDS)
    if unknown:
        raise InvalidRtc(f"unknown rtc field(s) {', '.join(unknown)}; the fields are {', '.join(FIELDS)}")
    horizon_len = action_shape[0]
    delay = _integer(entry, DELAY)
    if delay is None:
        raise InvalidRtc(f"rtc.{DELAY} is required (control steps the robot executes while the server computes)")
    if not 0 <= delay < horizon_len:
        raise InvalidRtc(
            f"rtc.{DELAY} must be in 0..{horizon_len - 1} (below the action horizon {horizon_len}), got {delay}"
        )
    if delay > max_delay:
        raise InvalidRtc(f"rtc.{DELAY} {delay} exceeds this server's maximum, {max_delay} (--rtc-max-delay)")
    executed = _integer(entry, EXECUTED)
    if (PREV_ACTIONS in entry) == (executed is not None):
        raise InvalidRtc(f"rtc needs exactly one of {PREV_ACTIONS!r} and {EXECUTED!r}")
    if executed is not None:
        last = session.last if session is not None else None
        if last is None:
            raise RtcNoPreviousChunk(
                f"rtc.{EXECUTED} refers to the last chunk this connection received, and it "
                f"received none yet; send {PREV_ACTIONS!r} instead"
            )
        if not 0 <= executed < len(last):
            raise InvalidRtc(
                f"rtc.{EXECUTED} must be in 0..{len(last) - 1} (the last chunk has {len(last)} actions), got {executed}"
            )
        prev = last[executed:]
    else:
        prev = _prev_actions(entry[PREV_ACTIONS], action_shape)
    h = prev.shape[0]
    if delay > h:
        raise InvalidRtc(
            f"rtc.{DELAY} {delay} exceeds the {h} previous actions given: the robot runs out of "
            f"actions before the new chunk starts"
        )
    horizon = _integer(entry, HORIZON)
    horizon = h if horizon is None else horizon
    if not delay <= horizon <= h:
        raise InvalidRtc(
            f"rtc.{HORIZON} must be in {delay}..{h} (from the delay to the previous actions given), got {horizon}"
        )
    return RtcRequest(prev, delay, horizon)


@dataclass(frozen=True)
class RtcSupport:
    """What this server does with ``rtc`` entries: the ``--rtc`` mode its policy allows, and the limits."""

    mode: str  # off | inpaint | guided
    max_delay: int
    reason: str = ""  # why the mode is off although --rtc asked for one (the policy cannot take actions back)

    @classmethod
    def of(cls, requested: str, max_delay: int | None, action_horizon: int, unsupported: str | None) -> RtcSupport:
        """``--rtc`` and ``--rtc-max-delay`` (None: any delay the chunk allows) for a policy that cannot do RTC
        for the reason ``unsupported`` (None: it can)."""
        limit = action_horizon - 1 if max_delay is None else min(max_delay, action_horizon - 1)
        if requested != "off" and unsupported is not None:
            return cls("off", limit, unsupported)
        return cls(requested, limit)

    def check(self) -> None:
        """Refuse a request with an ``rtc`` entry when RTC is off."""
        if self.mode == "off":
            raise RtcUnsupported(
                self.reason
                or "real-time chunking is off on this server (--rtc off); send the observation without 'rtc'"
            )

    def metadata(self) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "mode": self.mode,
            "max_inference_delay": self.max_delay,
            "forms": [PREV_ACTIONS, EXECUTED] if self.mode != "off" else [],
        }
        if self.reason:
            meta["reason"] = self.reason
        return meta


@dataclass(frozen=True)
class RtcPrepared:
    """A request's checked entry and its constraint in the policy's model space, ready for the replica."""

    request: RtcRequest
    constraint: RtcConstraint


@dataclass(frozen=True)
class RtcIngress:
    """The engine's side of real-time chunking: what it announces, and each checked entry mapped to the model's space."""

    support: RtcSupport
    policy: Policy | None = None

    @classmethod
    def off(cls) -> RtcIngress:
        return cls(RtcSupport("off", 0, "the policy is not loaded yet"))

    @classmethod
    def of(cls, policy: Policy, mode: str, max_delay: int | None) -> RtcIngress:
        return cls(RtcSupport.of(mode, max_delay, policy.action_shape[0], rtc_unsupported(policy)), policy)

    def parse(self, obs: Mapping[str, Any], session: RtcSession | None, action_shape: tuple[int, int]) -> RtcPrepared:
        """The observation's ``rtc`` entry, checked against the session's memory and mapped to the model's space."""
        self.support.check()
        request = parse_rtc(obs[RTC_KEY], session, action_shape=action_shape, max_delay=self.support.max_delay)
        return RtcPrepared(request, self.constraint(request))

    def constraint(self, request: RtcRequest) -> RtcConstraint:
        """A checked entry in the policy's model space, for the replica."""
        assert self.policy is not None, "check() refuses before a policy is attached"
        target = self.policy.actions_to_model(request.prev_actions).float()
        return RtcConstraint(target, request.delay, request.horizon)
