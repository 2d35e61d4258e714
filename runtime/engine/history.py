"""Each session's last observations, for policies that read more than the latest one.

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
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict, deque

from policy_operator.runtime.policy.interface import Policy, Sample

MAX_SESSIONS = 1024


class SessionHistory:
    def __init__(self, policy: Policy | None, *, max_sessions: int = MAX_SESSIONS) -> None:
        """``policy`` None (not loaded yet): every request passes as it is."""
        if policy is not None and policy.history < 1:
            raise ValueError(f"policy {policy.name} declares a history of {policy.history}; it must be >= 1")
        self.policy = policy
        self.length = policy.history if policy is not None else 1
        self.max_sessions = max_sessions
        self._sessions: OrderedDict[bytes, deque[Sample]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._sessions)

    def extend(self, session: str | None, sample: Sample) -> Sample:
        """The request for ``sample``, the session's latest observation: it and the ones before it."""
        if self.length == 1 or self.policy is None:
            return sample
        if session is None:
            past: deque[Sample] = deque([sample], maxlen=self.length)
        else:
            key = hashlib.blake2b(session.encode("utf-8", "surrogatepass"), digest_size=16).digest()
            past = self._sessions.pop(key) if key in self._sessions else deque(maxlen=self.length)
            if past and past[-1].group_key() != sample.group_key():
                past.clear()
            past.append(sample)
            self._sessions[key] = past
            while len(self._sessions) > self.max_sessions:
                self._sessions.popitem(last=False)
        samples = [past[0]] * (self.length - len(past)) + list(past)
        return self.policy.stack_history(samples)
