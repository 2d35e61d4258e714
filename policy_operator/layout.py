"""The parallel layout of one pod: ``cfgp`` x ``dp`` ranks, dp outermost.

One definition shared by the operator (which refuses a bad PolicyServer before
creating anything) and the runtime (which refuses a bad launch before any
download or model load), so both sides reject exactly the same shapes with the
same words.  The degrees are validated up front, like torchtitan's
``ParallelDims``; rank arithmetic lives here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass, field

SUPPORTED_CFGP = (1, 2)


class LayoutError(ValueError):
    """A parallel layout that cannot run; ``str()`` is one readable line."""


@dataclass(frozen=True)
class ParallelLayout:
    """``world_size == cfgp * dp``; ``rank = dp_index * cfgp + cfg_index``.

    Each dp replica is a contiguous block of ``cfgp`` ranks whose first rank is
    the replica's driver and output rank; cfg index 0 computes the conditional
    branch and cfg index 1 (when ``cfgp == 2``) the unconditional one.
    """

    cfgp: int = 1
    dp: int = 1
    world_size: int = field(default=0)

    def __post_init__(self) -> None:
        for name in ("cfgp", "dp", "world_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int):
                raise LayoutError(f"{name} must be an integer, got {value!r}")
        if self.cfgp not in SUPPORTED_CFGP:
            raise LayoutError(
                f"cfgp={self.cfgp} is not supported: classifier-free guidance has two branches, "
                f"so cfgp must be 1 (both branches on one rank) or 2 (one branch per rank)"
            )
        if self.dp < 1:
            raise LayoutError(f"dp={self.dp} is not supported: dp must be >= 1")
        if self.world_size == 0:
            object.__setattr__(self, "world_size", self.cfgp * self.dp)
        if self.world_size != self.cfgp * self.dp:
            raise LayoutError(
                f"world size {self.world_size} does not match cfgp x dp = "
                f"{self.cfgp} x {self.dp} = {self.cfgp * self.dp}; launch with "
                f"--nproc-per-node={self.cfgp * self.dp}"
            )

    def check_guidance(self, guidance: float) -> None:
        """cfgp=2 only pays off when CFG runs: at guidance 1.0 the second GPU idles."""
        if self.cfgp == 2 and float(guidance) == 1.0:
            raise LayoutError(
                "cfgp=2 needs classifier-free guidance: with guidance 1.0 the unconditional "
                "branch is never used and the second GPU of every replica would idle; "
                "use cfgp=1 or a guidance other than 1.0"
            )

    # --- rank arithmetic -------------------------------------------------------
    def rank_of(self, dp_index: int, cfg_index: int) -> int:
        if not (0 <= dp_index < self.dp and 0 <= cfg_index < self.cfgp):
            raise IndexError(f"(dp_index={dp_index}, cfg_index={cfg_index}) outside {self}")
        return dp_index * self.cfgp + cfg_index

    def coords(self, rank: int) -> tuple[int, int]:
        """(dp_index, cfg_index) of a global rank."""
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside world size {self.world_size}")
        return divmod(rank, self.cfgp)

    def replica_ranks(self, dp_index: int) -> list[int]:
        return [self.rank_of(dp_index, c) for c in range(self.cfgp)]

    def driver_rank(self, dp_index: int) -> int:
        return self.rank_of(dp_index, 0)

    @property
    def label(self) -> str:
        return f"cfgp={self.cfgp},dp={self.dp}"

    def as_dict(self) -> dict[str, int]:
        return {"cfgp": self.cfgp, "dp": self.dp, "world_size": self.world_size}
