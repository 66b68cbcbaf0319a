"""The planner counts the gradient all-reduce of tied parameters (``planner.ties``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import tie_seconds, with_tied_traffic


def test_a_ring_all_reduce_moves_twice_the_bytes_times_k_minus_1_over_k() -> None:
    assert tie_seconds(2, 1e6, 1e9) == pytest.approx(1e-3)
    assert tie_seconds(4, 1e6, 1e9) == pytest.approx(1.5e-3)
    assert tie_seconds(1, 1e6, 1e9) == 0.0


def test_the_plan_adds_each_ties_time_and_says_so() -> None:
    plan = replace(Plan.from_balance([2, 2], replicas=[2, 1]), slowest_stage_time=0.01)
    counted = with_tied_traffic(plan, [((0, 1), 1e6)], 1e9)  # 3 ranks hold it
    assert counted.slowest_stage_time == pytest.approx(0.01 + 2 * 2 * 1e6 / (3 * 1e9))
    assert "stages [0, 1]" in counted.meta["tied"]
    assert "tied parameters" in counted.render()
    assert with_tied_traffic(plan, [], 1e9) == plan
