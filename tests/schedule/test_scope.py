"""A rank's neighbourhood: which lists it holds, and what the checks over them still catch."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, Schedule, ScheduleError, build, render, validate
from pl_pipedream.schedule.checks import check_deadlock, check_messages
from pl_pipedream.schedule.scope import neighbourhood


def test_a_straight_rank_holds_itself_and_the_stages_on_either_side() -> None:
    plan = Plan.from_balance([1] * 32)
    assert neighbourhood(plan, [17]) == {16, 17, 18}
    assert neighbourhood(plan, [0]) == {0, 1}
    assert neighbourhood(plan, [31, 0]) == {0, 1, 30, 31}


def test_a_replicated_rank_holds_whole_stages() -> None:
    plan = Plan.from_balance([1, 1, 1, 1], replicas=[2, 1, 3, 1])  # ranks 0-1, 2, 3-5, 6
    assert neighbourhood(plan, [4]) == {2, 3, 4, 5, 6}
    assert neighbourhood(plan, [0]) == {0, 1, 2}


def test_every_neighbourhood_of_a_built_schedule_is_valid(plan: Plan) -> None:
    m = 2 * plan.num_stages
    for sync in CONTIGUOUS_MODES:
        for rank in range(plan.num_workers):
            near = neighbourhood(plan, [rank])
            schedule = build(plan, sync, 3, m, ranks=near)
            assert schedule.scope == near
            assert [bool(a) for a in schedule.actions] == [
                r in near for r in range(plan.num_workers)
            ]
            validate(schedule)


def test_a_scoped_build_holds_the_same_lists_as_the_whole() -> None:
    plan = Plan.from_balance([1, 1, 1], replicas=[1, 2, 1])
    whole, part = build(plan, "async", 3, 2), build(plan, "async", 3, 2, ranks=[1, 2, 3])
    assert part.actions[1:] == whole.actions[1:] and part.actions[0] == ()


def test_a_scoped_build_names_ranks_of_the_plan() -> None:
    with pytest.raises(ValueError, match=r"ranks must name workers of the plan \(ranks: \[2\]"):
        build(Plan.from_balance([1, 1]), "async", 1, 1, ranks=[2])


def _stalled(ranks: list[int]) -> Schedule:
    """Four stages; rank 1 waits for its gradient before it sends the activation rank 2 needs."""
    schedule = build(Plan.from_balance([1] * 4), "async", 1, 1, ranks=ranks)
    receive, forward, send, grad, *rest = schedule.actions[1]  # 1<a0@0 1F0v0 1>a0@2 1<g0@2 ...
    lists = list(schedule.actions)
    lists[1] = (receive, forward, grad, send, *rest)
    return dataclasses.replace(schedule, actions=tuple(lists))


def test_a_deadlock_of_two_neighbours_is_seen_by_both() -> None:
    for rank in (1, 2):
        with pytest.raises(ScheduleError, match="must not deadlock"):
            validate(_stalled(sorted(neighbourhood(Plan.from_balance([1] * 4), [rank]))))
    with pytest.raises(ScheduleError, match="must not deadlock"):
        validate(_stalled([0, 1, 2, 3]))


def test_a_neighbourhood_takes_messages_from_outside_as_given() -> None:
    """Rank 0's neighbourhood holds ranks 0 and 1: rank 1's messages with rank 2 pass."""
    schedule = build(Plan.from_balance([1] * 4), "async", 2, 1, ranks=[0, 1])
    assert check_messages(schedule) is None and check_deadlock(schedule) is None
    receive_dropped = (schedule.actions[0], schedule.actions[1][1:], *schedule.actions[2:])
    problem = check_messages(dataclasses.replace(schedule, actions=receive_dropped))
    assert problem is not None and problem.cells == ((0, 1),)  # 0>a0@1 lost its receive


def test_a_neighbourhood_table_shows_its_ranks() -> None:
    table = render(build(Plan.from_balance([1] * 8), "async", 1, 1, ranks=[3, 4, 5]))
    header = table.splitlines()[1]
    assert "r3 s3" in header and "r5 s5" in header and "r2" not in header and "r6" not in header


def test_a_scope_survives_json() -> None:
    schedule = build(Plan.from_balance([1] * 3), "flush", 1, 1, ranks=[1, 2])
    assert Schedule.from_dict(schedule.to_dict()) == schedule
    whole = build(Plan.from_balance([1] * 3), "flush", 1, 1)
    assert Schedule.from_dict(whole.to_dict()).scope is None


def test_every_neighbourhood_of_a_longer_replicated_plan_is_valid() -> None:
    plan = Plan.from_balance([1] * 5, replicas=[2, 1, 3, 1, 2])
    for sync in CONTIGUOUS_MODES:
        for rank in range(plan.num_workers):
            validate(build(plan, sync, 3, 12, ranks=neighbourhood(plan, [rank, 0])))
