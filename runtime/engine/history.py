"""Each session's past at the ingress: its last observations, and the ledger of a world model's session state.

Diffusion Policy conditions on its last ``n_obs_steps`` observations; LeRobot
keeps them in per-robot queues.  Here the ingress keeps, per ``session_id``,
the last ``Policy.history`` prepared samples and hands the policy all of them
(``Policy.stack_history``) as one request.  It lives on rank 0 with the
ingress, before routing, so it needs nothing from the replicas (sessions stick
to one anyway).  A session's first requests are padded with the oldest
observation, as LeRobot fills an empty queue; a request without a
``session_id`` has no past; an observation whose shapes differ from the
session's earlier ones (another camera size) starts the session's history
afresh instead of failing.  The sessions kept are bounded (least recently used
go first), as the router's are.

A policy whose model keeps memory across calls (``session_state.SessionState``:
LingBot-VA's KV cache of every frame seen) keeps that memory on its replica's
ranks; here only its ledger lives: per session, the chunks routed and the last
answer (``answered``, from the engine: cfgp=2's unconditional rank feeds it
back, as it never sees a chunk's end).  A
request without ``keyframes`` is a first chunk (it starts, or restarts, the
session's episode, as LeRobot's ``reset()``); one with them continues the
session: its keyframes are prepared as observations and stacked before the
request's own (the latest), and the sample is tagged with the session's key and
chunk index (``SESSION_TAG``) so the ranks find the state the ledger expects.
A continuation that cannot continue -- no session id, a session never started
here, evicted (``max_sessions``), of a closed connection (a reconnect is a new
session: runtime/rtc_session.py), whose last chunk failed or is unanswered, or
a layout the policy cannot continue on (``cfgp2_unsupported``) -- fails alone
with ``no_session_state``; a wrong number of keyframes with
``invalid_observation``.  The ledger is bounded as the ranks' states are
(the policy's ``max_sessions``), so a session it still knows is one its
replica still holds.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from policy_operator.runtime.errors import InvalidObservation, NoSessionState
from policy_operator.runtime.policy.interface import Policy, Sample
from policy_operator.runtime.policy.session_state import (
    KEYFRAMES,
    SESSION_ACTIONS,
    SESSION_TAG,
    SessionState,
    session_state_of,
)

MAX_SESSIONS = 1024


def _key(session: str) -> bytes:
    return hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()


class SessionHistory:
    def __init__(self, policy: Policy | None, *, max_sessions: int = MAX_SESSIONS, cfgp: int = 1) -> None:
        """``policy`` None (not loaded yet): every request passes as it is.  ``cfgp``: the layout's (a policy may
        keep its session state on one rank only: ``SessionState.cfgp2_unsupported``)."""
        if policy is not None and policy.history < 1:
            raise ValueError(f"policy {policy.name} declares a history of {policy.history}; it must be >= 1")
        self.policy = policy
        self.length = policy.history if policy is not None else 1
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, deque[Sample]] = OrderedDict()
        self.state: SessionState | None = session_state_of(policy) if policy is not None else None
        self.state_unsupported = self.state.cfgp2_unsupported if self.state is not None and cfgp > 1 else None
        # session -> (the next chunk's index, the last chunk's answer: None until it came)
        self._chunks: OrderedDict[bytes, tuple[int, np.ndarray | None]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions) + len(self._chunks)

    def extend(self, session: str | None, sample: Sample, observation: Mapping[str, Any] | None = None) -> Sample:
        """The request for ``sample``, the session's latest observation: it and the ones before it (a policy with
        a history), or it tagged with its session's state (a policy with ``SessionState``).  ``observation``: the
        decoded frame, where its ``keyframes`` are."""
        frames = observation.get(KEYFRAMES) if observation is not None else None
        if self.state is not None:
            return self._state(session, sample, frames)
        if frames is not None:
            name = self.policy.name if self.policy is not None else "this policy"
            raise InvalidObservation(
                f"{KEYFRAMES!r} continue a session of a world model; {name} keeps no session state"
            )
        if self.length == 1 or self.policy is None:
            return sample
        if session is None:
            past: deque[Sample] = deque([sample], maxlen=self.length)
        else:
            key = _key(session)
            past = self._sessions.pop(key) if key in self._sessions else deque(maxlen=self.length)
            if past and past[-1].group_key() != sample.group_key():
                past.clear()
            past.append(sample)
            self._sessions[key] = past
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        samples = [past[0]] * (self.length - len(past)) + list(past)
        return self.policy.stack_history(samples)

    def _state(self, session: str | None, sample: Sample, frames: Any) -> Sample:
        assert self.state is not None and self.policy is not None
        if frames is None:  # a first chunk: the session's episode starts (again) here
            if session is None or self.state_unsupported is not None:
                return sample
            key = _key(session)
            self._chunks.pop(key, None)
            self._chunks[key] = (1, None)
            while len(self._chunks) > min(self.max_sessions, self.state.max_sessions):
                self._chunks.popitem(last=False)
            return _tagged(sample, key, 0)
        if self.state_unsupported is not None:
            raise NoSessionState(self.state_unsupported)
        if session is None:
            raise NoSessionState(
                f"{KEYFRAMES!r} continue a session: send them with the session's 'session_id' (its first chunk, "
                "without keyframes, starts it)"
            )
        key = _key(session)
        chunk, last = self._chunks.get(key, (0, None))
        if last is None:
            raise NoSessionState(
                f"this session has no state to continue: its first chunk was not answered on this connection, it "
                f"was evicted (at most {self.state.max_sessions} sessions keep state), or its last chunk failed or is "
                f"still running; send a first chunk (the latest observation without {KEYFRAMES!r})"
            )
        want = self.state.keyframes(chunk) - 1
        if not isinstance(frames, list | tuple) or len(frames) != want:
            got = f"{len(frames)}" if isinstance(frames, list | tuple) else type(frames).__name__
            raise InvalidObservation(
                f"{KEYFRAMES!r} of chunk {chunk} must be a list of the {want} observations recorded while the last "
                f"chunk ran (the request's own observation is the latest of {want + 1}), got {got}"
            )
        samples = [self.policy.prepare(frame) for frame in frames] + [sample]
        if any(s.group_key() != sample.group_key() for s in samples):
            raise InvalidObservation(f"every one of {KEYFRAMES!r} must have the request's keys and shapes")
        self._chunks[key] = (chunk + 1, None)
        self._chunks.move_to_end(key)
        return _tagged(self.policy.stack_history(samples), key, chunk, last)

    def metadata(self) -> dict[str, Any]:
        """The metadata frame's ``session_state`` (docs/protocol.md, "Session continuation"): what a robot needs
        to continue its sessions; nothing for a policy that keeps no state."""
        if self.state is None:
            return {}
        return {
            "session_state": {
                "keyframes": {
                    "after_first_chunk": self.state.keyframes(1) - 1,
                    "after_later": self.state.keyframes(2) - 1,
                },
                "max_sessions": min(self.max_sessions, self.state.max_sessions),
                "continues": self.state_unsupported is None,
                "reason": self.state_unsupported,
            }
        }

    def answered(self, session: str | None, actions: np.ndarray | None) -> None:
        """A request of ``session`` was answered with ``actions`` (None: it failed, and the session cannot continue
        from a chunk its ranks may hold half-written: its next continuation is refused until a first chunk)."""
        if self.state is None or session is None:
            return
        key = _key(session)
        if key not in self._chunks:
            return
        if actions is None:
            del self._chunks[key]
        else:
            self._chunks[key] = (self._chunks[key][0], actions)


def _tagged(sample: Sample, key: bytes, chunk: int, last: np.ndarray | None = None) -> Sample:
    """``sample`` with ``SESSION_TAG`` (its session's key, 64 bits of its digest, and chunk index) and, for a
    continuation, ``SESSION_ACTIONS`` (the last chunk's answer)."""
    tensors = dict(sample.tensors)
    tensors[SESSION_TAG] = torch.tensor([[int.from_bytes(key[:8], "little", signed=True), chunk]], dtype=torch.long)
    if last is not None:
        tensors[SESSION_ACTIONS] = torch.from_numpy(np.asarray(last, dtype=np.float32))[None]
    return Sample(tensors, dict(sample.meta))
