"""A policy whose model keeps memory across a session's requests (LingBot-VA's world model): what the ingress needs.

Diffusion Policy's past observations are small and live with the ingress
(engine/history.py).  An autoregressive world model's memory is the
transformer's KV cache of every frame it has seen -- hundreds of MB per
session at the published size -- so it lives on the ranks that compute it,
next to the weights, and the ingress only keeps the ledger: which sessions
have a state, how many chunks each has answered, and how many observed frames
the next chunk needs.  The ingress tags each request of such a session with
its key and its chunk index (``SESSION_TAG``), so the ranks find the state
and check it is the one the ingress expects.

A request continues its session by carrying ``KEYFRAMES``: the observations
the robot recorded while it executed the previous chunk (docs/protocol.md,
"Session continuation").  A request without them is a session's first chunk
and starts it afresh.
"""

from __future__ import annotations

from typing import Any, Final, Protocol, runtime_checkable

#: The wire key of a continuation: the observations recorded while the last chunk ran, oldest first, the
#: request's own observation (the latest) not among them.
KEYFRAMES: Final = "keyframes"
#: A tagged request's tensor: int64 ``[rows, 2]``, each row's session key and its chunk index (0: a first chunk).
SESSION_TAG: Final = "session.tag"
#: A continuation's tensor: float32 ``[rows, h, action_dim]``, the actions the session's last chunk answered (what
#: a rank that never saw that chunk's end feeds back: cfgp=2's unconditional rank).
SESSION_ACTIONS: Final = "session.actions"


@runtime_checkable
class SessionState(Protocol):
    """What a policy (or a LeRobot family) with per-session model state declares."""

    #: Session states a replica keeps at most (least recently used go first); their device memory bounds it.
    max_sessions: int
    #: Why a session cannot continue with cfgp=2, or None when it can.
    cfgp2_unsupported: str | None

    def keyframes(self, chunk: int) -> int:
        """Observations (the request's own included) the continuation answering chunk ``chunk`` (>= 1) carries."""
        ...


def session_state_of(policy: Any) -> SessionState | None:
    """The policy's per-session state declaration: its own, or its LeRobot family's; None when it keeps none."""
    for owner in (policy, getattr(policy, "family", None)):
        if owner is not None and isinstance(owner, SessionState):
            return owner
    return None
