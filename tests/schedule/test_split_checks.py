"""The split-backward rules, each on its own: silent on built schedules, and what each reports
when a zero-bubble schedule is broken in its way."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import (
    CONTIGUOUS_MODES,
    Action,
    ActionKind,
    Schedule,
    ScheduleError,
    build,
)
from pl_pipedream.schedule.split_checks import (
    check_split_counts,
    check_split_order,
    check_split_versions,
)
from pl_pipedream.schedule.validate import validate

K = ActionKind
SPLIT_CHECKS = (check_split_counts, check_split_order, check_split_versions)


def zero_bubble() -> Schedule:
    return build(Plan.from_balance([1, 1]), "zero_bubble", 2, 2)


def with_rank(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(lists))


def position(schedule: Schedule, rank: int, kind: ActionKind, minibatch: int) -> int:
    return next(
        pos
        for pos, a in enumerate(schedule.actions[rank])
        if a.kind is kind and a.minibatch == minibatch
    )


@pytest.mark.parametrize("sync", CONTIGUOUS_MODES)
def test_built_schedules_pass(sync: str) -> None:
    for plan in (Plan.from_balance([1, 1, 1]), Plan.from_balance([1, 1], replicas=[2, 1])):
        schedule = build(plan, sync, 3, 6)
        for check in SPLIT_CHECKS:
            assert check(schedule) is None, (check.__name__, sync)


def test_the_zero_bubble_lists_hold_halves_and_no_whole_backward() -> None:
    kinds = {a.kind for rank in zero_bubble().actions for a in rank}
    assert K.BACKWARD not in kinds and {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT} <= kinds
    flush = build(Plan.from_balance([1, 1]), "flush", 2, 2)
    assert not {K.BACKWARD_INPUT, K.BACKWARD_WEIGHT} & {a.kind for r in flush.actions for a in r}


def test_a_missing_weight_half_is_counted() -> None:
    schedule = zero_bubble()
    pos = position(schedule, 0, K.BACKWARD_WEIGHT, 1)
    dropped = with_rank(schedule, 0, [a for k, a in enumerate(schedule.actions[0]) if k != pos])
    problem = check_split_counts(dropped)
    assert problem is not None
    assert problem.message.startswith("a split backward runs one input half and one weight half")
    assert "(stage 0, minibatch 1: input halves 1, weight halves 0)" in problem.message
    with pytest.raises(ScheduleError, match="one input half and one weight half"):
        validate(dropped)


def test_a_whole_backward_in_a_split_mode_and_a_half_elsewhere_are_refused() -> None:
    schedule = zero_bubble()
    pos = position(schedule, 1, K.BACKWARD_INPUT, 0)
    whole = list(schedule.actions[1])
    whole[pos] = dataclasses.replace(whole[pos], kind=K.BACKWARD)
    problem = check_split_counts(with_rank(schedule, 1, whole))
    assert problem is not None and problem.cells == ((1, pos),)
    assert problem.message.startswith("zero_bubble runs input and weight halves (action 1B0v0")

    flush = build(Plan.from_balance([1, 1]), "flush", 1, 2)
    pos = position(flush, 1, K.BACKWARD, 0)
    halved = list(flush.actions[1])
    halved[pos] = dataclasses.replace(halved[pos], kind=K.BACKWARD_INPUT)
    problem = check_split_counts(with_rank(flush, 1, halved))
    assert problem is not None and problem.cells == ((1, pos),)
    assert problem.message.startswith("flush runs whole backwards (action 1I0v0")


def test_a_weight_half_before_its_input_half_is_refused() -> None:
    schedule = zero_bubble()
    actions = list(schedule.actions[1])
    i_pos = position(schedule, 1, K.BACKWARD_INPUT, 0)
    w_pos = position(schedule, 1, K.BACKWARD_WEIGHT, 0)
    weight = actions.pop(w_pos)
    actions.insert(i_pos, weight)
    broken = with_rank(schedule, 1, actions)
    problem = check_split_order(broken)
    assert problem is not None and problem.cells == ((1, i_pos + 1), (1, i_pos))
    assert problem.message.startswith("a weight half runs after its input half on the same rank")
    with pytest.raises(ScheduleError, match="a weight half runs after its input half"):
        validate(broken)


def test_a_weight_half_on_other_weights_than_its_forward_is_refused() -> None:
    schedule = zero_bubble()
    pos = position(schedule, 0, K.BACKWARD_WEIGHT, 2)  # batch 1: version 1
    actions = list(schedule.actions[0])
    actions[pos] = dataclasses.replace(actions[pos], version=0)
    broken = with_rank(schedule, 0, actions)
    problem = check_split_versions(broken)
    assert problem is not None
    assert problem.message.startswith("a weight half uses the weights of its forward (stage 0, ")
    assert "forward 0F2v1, weight half 0W2v0" in problem.message
    with pytest.raises(ScheduleError, match="a weight half uses the weights of its forward"):
        validate(broken)


def test_a_rank_outside_the_scope_is_not_judged() -> None:
    plan = Plan.from_balance([1, 1, 1, 1])
    schedule = build(plan, "zero_bubble", 2, 4, ranks=[0])
    for check in SPLIT_CHECKS:
        assert check(schedule) is None
