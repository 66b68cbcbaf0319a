"""Each check on its own: silent on built schedules, and what it reports when its rule breaks.

``test_validate`` covers the same rules through ``validate`` (message, table, marks).
"""

from __future__ import annotations

import dataclasses

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, Schedule, build
from pl_pipedream.schedule.checks import (
    CHECKS,
    check_deadlock,
    check_messages,
    check_segments,
    check_shape,
)


def built(plan: Plan) -> list[Schedule]:
    m = 2 * plan.num_stages
    modes = CONTIGUOUS_MODES
    return [build(plan, sync, 4, m) for sync in modes] + [build(plan, "async", 6, m // 2)]


def test_every_check_accepts_built_schedules(plan: Plan) -> None:
    for schedule in built(plan):
        for check in CHECKS:
            assert check(schedule) is None, (check.__name__, schedule.sync)


def test_no_rank_waits_on_a_later_segment(plan: Plan) -> None:
    """Receives find their send in the same or an earlier step; collectives meet in one step."""
    for schedule in built(plan):
        assert check_segments(schedule) is None


def test_a_list_on_the_wrong_rank() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 1, 1)
    swapped = dataclasses.replace(schedule, actions=schedule.actions[::-1])
    problem = check_shape(swapped)
    assert problem is not None and problem.cells == ((0, 0),)
    assert problem.message.startswith("an action must name the rank, stage and replica")


def test_a_send_without_its_receive() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 1, 1)
    receive_dropped = (schedule.actions[0], schedule.actions[1][1:])
    problem = check_messages(dataclasses.replace(schedule, actions=receive_dropped))
    assert problem is not None and problem.cells == ((0, 1),)  # 0>a0@1
    assert "every send needs exactly one matching partner" in problem.message


def test_a_deadlock_reports_where_each_rank_waits() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 1, 1)
    forward, send, receive, backward, step = schedule.actions[0]
    waits_first = (forward, receive, send, backward, step)
    problem = check_deadlock(
        dataclasses.replace(schedule, actions=(waits_first, schedule.actions[1]))
    )
    assert problem is not None and problem.cells == ((0, 1), (1, 0))
    assert "stuck at rank 0: 0<g0@1, rank 1: 1<a0@0" in problem.message


def test_a_rank_of_several_stages_tags_each_action_with_one_of_them() -> None:
    plan = Plan.from_balance([1] * 4, placement="interleaved")  # rank 0: stages 0 and 2
    schedule = build(plan, "interleaved", 1, 2)
    assert check_shape(schedule) is None
    rank0 = list(schedule.actions[0])
    rank0[0] = dataclasses.replace(rank0[0], stage=1)  # stage 1 is rank 1's
    broken = dataclasses.replace(schedule, actions=(tuple(rank0), schedule.actions[1]))
    problem = check_shape(broken)
    assert problem is not None and problem.cells == ((0, 0),)
    assert "must name the rank, stage and replica whose list holds it" in problem.message
