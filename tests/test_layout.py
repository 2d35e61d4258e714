"""ParallelLayout: the one definition of which (cfgp, dp) shapes run and how ranks map."""

from __future__ import annotations

import pytest

from policy_operator.layout import LayoutError, ParallelLayout


@pytest.mark.parametrize("cfgp,dp", [(1, 1), (2, 1), (1, 2), (2, 2), (2, 4)])
def test_dp_is_outermost(cfgp: int, dp: int) -> None:
    layout = ParallelLayout(cfgp, dp)
    assert layout.world_size == cfgp * dp
    ranks = [layout.rank_of(d, c) for d in range(dp) for c in range(cfgp)]
    assert ranks == list(range(cfgp * dp))  # replica blocks are contiguous
    for r in ranks:
        d, c = layout.coords(r)
        assert r == d * cfgp + c
    assert [layout.driver_rank(d) for d in range(dp)] == [d * cfgp for d in range(dp)]
    assert layout.replica_ranks(dp - 1) == list(range((dp - 1) * cfgp, dp * cfgp))


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        ({"cfgp": 3}, "cfgp=3 is not supported"),
        ({"cfgp": 0}, "cfgp=0 is not supported"),
        ({"dp": 0}, "dp=0 is not supported"),
        ({"cfgp": 2, "dp": 1, "world_size": 4}, "--nproc-per-node=2"),
        ({"cfgp": 1.5}, "must be an integer"),
        ({"dp": True}, "must be an integer"),
    ],
)
def test_rejected_layouts_have_one_line_reasons(kwargs: dict, needle: str) -> None:
    with pytest.raises(LayoutError) as info:
        ParallelLayout(**kwargs)
    assert needle in str(info.value)
    assert "\n" not in str(info.value)


def test_cfgp2_needs_guidance() -> None:
    ParallelLayout(1, 2).check_guidance(1.0)  # one rank per replica may skip CFG
    ParallelLayout(2, 1).check_guidance(3.0)
    with pytest.raises(LayoutError, match="second GPU"):
        ParallelLayout(2, 1).check_guidance(1.0)


def test_out_of_range_coordinates() -> None:
    layout = ParallelLayout(2, 2)
    with pytest.raises(IndexError):
        layout.coords(4)
    with pytest.raises(IndexError):
        layout.rank_of(2, 0)
    assert layout.label == "cfgp=2,dp=2"
    assert layout.as_dict() == {"cfgp": 2, "dp": 2, "world_size": 4}
