"""A request's answer, from the engine to the WebSocket session: the one type both front-end modes see.

Built once, by the engine, when everything about the request is known (the
replica's outcome, the lane's queue time and batch, the front-end's decode and
prepare times); never rebuilt along the way.  An error is a ``Result`` too
(``error_kind`` and the message), so a failure crosses the front-end process's
socket the way an answer does; ``unwrap`` raises it as its ``RequestError`` on
the front-end.  Torch-free: the front-end process reads it without the rank code.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from policy_operator.runtime.errors import ErrorKind, RequestError, error_of


@dataclass(frozen=True, slots=True)
class Result:
    actions: np.ndarray | None = None
    error_kind: ErrorKind | None = None
    error: str = ""
    infer_ms: float = 0.0
    queue_ms: float = 0.0  # waited for its replica: the queue and the batch window
    batch_size: int = 1  # requests of the batch it ran in
    replica: int = 0
    decode_ms: float = 0.0
    prepare_ms: float = 0.0
    stages: tuple[tuple[str, float], ...] = ()  # its batch's compute by stage, seconds (Policy.stage_seconds)

    @classmethod
    def failed(cls, exc: BaseException) -> Result:
        """The Result of a request that failed with ``exc`` before or after its replica (a ``RequestError``'s
        kind, ``internal`` for anything else)."""
        if isinstance(exc, RequestError):
            return cls(error_kind=exc.kind, error=str(exc))
        return cls(error_kind=ErrorKind.INTERNAL, error=f"{type(exc).__name__}: {exc}")

    def unwrap(self) -> np.ndarray:
        """The actions; the request's ``RequestError`` (``errors.error_of``) when it failed."""
        if self.error_kind is not None or self.actions is None:
            raise error_of(self.error_kind or ErrorKind.INFERENCE_FAILED, self.error)
        return self.actions
