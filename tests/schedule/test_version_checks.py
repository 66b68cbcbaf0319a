"""check_versions: the mode's versions, updates in order, every update by the drain.

The wrong version, a version used before its step and an overfull stash are in
``test_validate``, through ``validate``.
"""

from __future__ import annotations

import dataclasses

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, Schedule, build
from pl_pipedream.schedule.version_checks import check_versions


def with_rank(schedule: Schedule, rank: int, actions: tuple) -> Schedule:  # type: ignore[type-arg]
    lists = list(schedule.actions)
    lists[rank] = actions
    return dataclasses.replace(schedule, actions=tuple(lists))


def test_accepts_every_mode(plan: Plan) -> None:
    for sync in CONTIGUOUS_MODES:
        assert check_versions(build(plan, sync, 3, 2 * plan.num_stages)) is None


def test_the_drain_applies_every_update() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 2, 1)
    last_step_dropped = schedule.actions[1][:-1]
    problem = check_versions(with_rank(schedule, 1, last_step_dropped))
    assert problem is not None
    assert problem.message.startswith(
        "the drain applies every update (rank 1: steps 1, expected 2)"
    )
    assert problem.cells == ((1, len(last_step_dropped) - 1),)


def test_updates_come_in_order() -> None:
    schedule = build(Plan.from_balance([1, 1], replicas=[2, 1]), "async", 1, 2)
    actions = list(schedule.actions[0])
    pos = [str(a) for a in actions].index("0Av1")
    actions[pos] = dataclasses.replace(actions[pos], version=2)
    problem = check_versions(with_rank(schedule, 0, tuple(actions)))
    assert problem is not None and problem.cells == ((0, pos),)
    assert problem.message.startswith("updates come in order (action 0Av2: expected v1)")


def test_each_stage_of_a_rank_counts_its_own_updates() -> None:
    plan = Plan.from_balance([1] * 4, placement="interleaved")  # rank 0: stages 0 and 2
    schedule = build(plan, "interleaved", 2, 2)
    assert check_versions(schedule) is None
    rank0 = [a for a in schedule.actions[0] if not (a.kind.name == "STEP" and a.stage == 2)]
    broken = dataclasses.replace(schedule, actions=(tuple(rank0), schedule.actions[1]))
    problem = check_versions(broken)
    assert problem is not None
    assert "a version is used only after the step that produces it (action 2F2v1" in (
        problem.message
    )
