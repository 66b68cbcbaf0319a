"""The planner counts the gradient all-reduce of tied parameters (``planner.ties``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import Tie, tie_seconds, with_tied_traffic


def test_a_ring_all_reduce_moves_twice_the_bytes_times_k_minus_1_over_k() -> None:
    assert tie_seconds(2, 1e6, 1e9) == pytest.approx(1e-3)
    assert tie_seconds(4, 1e6, 1e9) == pytest.approx(1.5e-3)
    assert tie_seconds(1, 1e6, 1e9) == 0.0


def test_the_plan_adds_each_ties_time_and_says_so() -> None:
    plan = replace(Plan.from_balance([2, 2], replicas=[2, 1]), slowest_stage_time=0.01)
    tie = Tie(("w", "v"), stages=(0, 1), stage_names=("0.w", "2.v"), stage_ranks=((0, 1), (2,)))
    counted = with_tied_traffic(plan, [replace(tie, nbytes=10**6)], 1e9)  # 3 ranks hold it
    assert counted.slowest_stage_time == pytest.approx(0.01 + 2 * 2 * 1e6 / (3 * 1e9))
    assert "stages [0, 1]" in counted.meta["tied"]
    assert "tied parameters" in counted.render()
    assert with_tied_traffic(plan, [], 1e9) == plan


def test_a_tie_names_the_parameter_on_each_holding_rank_and_describes_itself() -> None:
    tie = Tie(
        ("wte.weight", "head.weight"),
        stages=(0, 2),
        stage_names=("0.wte.weight", "3.weight"),
        stage_ranks=((0, 1), (3,)),
    )
    assert tie.ranks == (0, 1, 3)
    assert [tie.name_on(rank) for rank in range(4)] == [
        "0.wte.weight",
        "0.wte.weight",
        None,
        "3.weight",
    ]
    assert [tie.name_in(stage) for stage in range(3)] == ["0.wte.weight", None, "3.weight"]
    assert tie.describe() == "wte.weight = head.weight on stages [0, 2]"


def test_a_tie_needs_a_name_and_ranks_per_holding_stage() -> None:
    with pytest.raises(ValueError, match=r"one stage name and rank list per holding stage"):
        Tie(("w",), stages=(0, 2), stage_names=("0.w",), stage_ranks=((0,), (2,)))
