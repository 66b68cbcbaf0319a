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


def test_a_plan_may_give_each_rank_several_stages() -> None:
    plan = Plan.from_balance([1, 2, 1, 1], placement="interleaved")
    assert [stage.ranks for stage in plan.stages] == [(0,), (1,), (0,), (1,)]
    assert [stage.nodes for stage in plan.stages] == [("0",), ("1", "2"), ("3",), ("4",)]
    assert (plan.num_workers, plan.chunks_per_rank, plan.placement) == (2, 2, "interleaved")
    assert [stage.index for stage in plan.stages_of_rank(1)] == [1, 3]
    assert Plan.from_json(plan.to_json()) == plan
    assert "placement            interleaved, 2 stages per rank" in plan.render()
    v_shape = Plan.from_balance([1] * 6, placement="v")
    assert [stage.ranks[0] for stage in v_shape.stages] == [0, 1, 2, 2, 1, 0]
    assert Plan.from_json(v_shape.to_json()) == v_shape
    three = Plan.from_balance([1] * 6, placement="interleaved", num_ranks=2)
    assert (three.num_workers, three.chunks_per_rank) == (2, 3)


def test_a_plan_of_one_stage_per_rank_keeps_its_meaning() -> None:
    plan = Plan.from_balance([1, 1, 1], replicas=[2, 1, 1])
    assert (plan.num_workers, plan.chunks_per_rank, plan.placement) == (4, 1, "contiguous")
    assert plan.stages_of_rank(1) == (plan.stage_of_rank(1),) == (plan.stages[0],)
    assert Plan.from_dict(plan.to_dict()).to_dict() == plan.to_dict()


def test_one_stage_per_rank_is_asked_for_loudly() -> None:
    plan = Plan.from_balance([1] * 4, placement="v")
    with pytest.raises(PlanError, match=r"rank 1 several \(stages: \[1, 2\], placement: v\); use"):
        plan.stage_of_rank(1)


def test_a_mapping_neither_contiguous_interleaved_nor_a_v_is_refused() -> None:
    from pl_pipedream.planner.plan import Stage

    def stages(ranks: list[tuple[int, ...]]) -> tuple[Stage, ...]:
        return tuple(Stage(s, (str(s),), len(r), r) for s, r in enumerate(ranks))

    for bad in ([(0,), (0,), (1,), (1,)], [(0,), (1,), (1,)], [(0, 1), (0,)]):
        with pytest.raises(PlanError) as error:
            Plan(stages(bad))
        message = str(error.value)
        assert message.startswith("every rank must serve exactly one stage, or each rank the same")
        assert f"(stage ranks: {[list(r) for r in bad]}); give each stage its own rank" in message


def test_chunked_construction_is_checked() -> None:
    with pytest.raises(PlanError, match=r"placement must be one of contiguous, interleaved, v"):
        Plan.from_balance([1, 1], placement="spiral")
    with pytest.raises(PlanError, match=r"\(stages: 3, num_ranks: 2\); pass a stage count"):
        Plan.from_balance([1, 1, 1], placement="interleaved", num_ranks=2)
    with pytest.raises(PlanError, match=r"placement 'v' gives each rank 2 stages \(stages: 6, "):
        Plan.from_balance([1] * 6, placement="v", num_ranks=2)
    with pytest.raises(PlanError, match=r"gives each rank 2 or more stages"):
        Plan.from_balance([1, 1], placement="interleaved", num_ranks=2)
