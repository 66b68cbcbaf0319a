"""Plan values: construction from a balance, warm-up and versions, JSON, clear errors."""

from __future__ import annotations

import pytest

from pl_pipedream.planner.plan import Plan, PlanError


def test_from_balance_builds_a_straight_pipeline() -> None:
    plan = Plan.from_balance([2, 1, 3])
    assert [stage.nodes for stage in plan.stages] == [("0", "1"), ("2",), ("3", "4", "5")]
    assert [stage.warmup for stage in plan.stages] == [2, 1, 0]
    assert [stage.weight_versions for stage in plan.stages] == [3, 2, 1]
    assert plan.noam == 3
    assert plan.shape == "1-1-1"


def test_replicated_warmup_follows_pipedream_runtime() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    assert [stage.ranks for stage in plan.stages] == [(0, 1), (2,)]
    assert [stage.warmup for stage in plan.stages] == [1, 0]
    assert plan.noam == 2
    plan = Plan.from_balance([1, 1, 1], replicas=[1, 2, 1])
    assert [stage.warmup for stage in plan.stages] == [3, 1, 0]


def test_balance_must_cover_every_layer() -> None:
    with pytest.raises(PlanError, match=r"layers: 5, sum of balance: 4"):
        Plan.from_balance([2, 2], layer_ids=[str(i) for i in range(5)])
    with pytest.raises(PlanError, match="at least one layer"):
        Plan.from_balance([2, 0])


def test_json_round_trip_and_rendering() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    assert Plan.from_json(plan.to_json()) == plan
    text = plan.render()
    assert "2-1 on 3 workers" in text


def test_ranks_must_cover_all_workers() -> None:
    from pl_pipedream.planner.plan import Stage

    with pytest.raises(PlanError, match="must serve a stage"):
        Plan((Stage(0, ("a",), 1, (0,)), Stage(1, ("b",), 1, (2,))))
