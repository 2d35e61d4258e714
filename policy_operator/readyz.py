"""The ``/readyz`` document: written by rank 0 of every server pod, read by the operator.

A kubelet readiness probe gives one bit per pod, but a pod of ``cfgp x dp``
ranks can be half alive (a replica wedged, a cfg rank still loading), so the
body lists every rank.  The runtime builds this model from its heartbeat board
and serves ``model_dump_json``; the operator validates the answer against the
same model, so a field renamed on one side fails the operator's tests instead
of silently reading as "not ready".  Unknown fields are ignored, so an older
operator still reads a newer runtime's document.  torch-free.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from pydantic import BaseModel, ConfigDict, Field, ValidationError


class RankState(str, Enum):
    """Where one rank is; the first five are published by the rank itself, the last two concluded by the reader."""

    LOADING = "loading"
    WARM = "warm"
    SERVING = "serving"
    STOPPING = "stopping"
    FAILED = "failed"
    UNKNOWN = "unknown"  # no heartbeat yet, or the store could not be read
    STALE = "stale"  # the last heartbeat is older than the staleness bound: dead or frozen

    @property
    def takes_requests(self) -> bool:
        return self in (RankState.WARM, RankState.SERVING)


class LayoutDoc(BaseModel):
    """``ParallelLayout.as_dict()``."""

    cfgp: int = Field(ge=1)
    dp: int = Field(ge=1)
    world_size: int = Field(ge=1)


class RankReadiness(BaseModel):
    """One rank, as its last heartbeat says; ``ready`` = fresh and warm or serving."""

    model_config = ConfigDict(frozen=True)

    rank: int = Field(ge=0)
    dp_index: int = Field(ge=0)
    cfg_index: int = Field(ge=0)
    state: RankState
    age_s: float | None  # seconds since the last heartbeat; None before the first one
    ready: bool
    detail: str = ""  # why, in words (never a path: anyone may read /readyz)


class Readiness(BaseModel):
    """The whole body; served with 200 when ``ready``, else 503."""

    ready: bool
    layout: LayoutDoc | None = None
    world_size: int = Field(ge=1)
    ranks_ready: int = Field(ge=0)
    ranks: list[RankReadiness]
    in_flight: int = Field(default=0, ge=0)
    draining: bool = False
    error: str | None = None  # why loading the policy failed; the pod restarts
    # the batch size the lanes form at most: --max-batch, or less under --latency-budget-ms; None while loading
    max_batch: int | None = Field(default=None, ge=1)
    # under --latency-budget-ms: warm-up's measured time of one batch of each bucket size, in ms (JSON keys are
    # strings); None without a budget
    batch_buckets_ms: dict[int, float] | None = None
    # every --max-connections slot is taken: a new robot gets 503 until a session ends (or idles out); the
    # server still serves the sessions it has, so this is a signal, not unreadiness
    connections_full: bool = False

    def to_json(self) -> bytes:
        """The body as served: the optional fields only when set."""
        unset = {name for name in ("error", "max_batch", "batch_buckets_ms") if getattr(self, name) is None}
        return self.model_dump_json(exclude=unset or None).encode()

    @classmethod
    def parse(cls, body: bytes | str) -> Readiness:
        """The document in a ``/readyz`` answer; ValueError with a one-line reason when it is not one."""
        try:
            return cls.model_validate_json(body)
        except ValidationError as exc:
            errors = exc.errors()
            first = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in errors[:3])
            raise ValueError(first + (f" (+{len(errors) - 3} more)" if len(errors) > 3 else "")) from None


def all_ranks_ready(ranks: Iterable[RankReadiness], world_size: int) -> bool:
    """Ready only when every rank of every replica reported, fresh and warm."""
    seen = {r.rank: r for r in ranks}
    return len(seen) == world_size and all(r.ready for r in seen.values())
