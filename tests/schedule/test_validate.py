"""The validator accepts what the builder makes and catches deliberately broken schedules."""

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
    validate,
)

K = ActionKind


def with_rank(schedule: Schedule, rank: int, actions: list[Action]) -> Schedule:
    lists = list(schedule.actions)
    lists[rank] = tuple(actions)
    return dataclasses.replace(schedule, actions=tuple(lists))


def find(actions: tuple[Action, ...], text: str) -> int:
    return [str(action) for action in actions].index(text)


def test_accepts_every_built_schedule(plan: Plan) -> None:
    for sync in CONTIGUOUS_MODES:
        for num_batches in (1, 2, 4):
            validate(build(plan, sync, num_batches, 2 * plan.num_stages))


def test_accepts_larger_replicated_shapes() -> None:
    for replicas in ([3, 1], [1, 3], [2, 1, 1], [1, 1, 2], [3, 2, 1], [2, 2, 2]):
        plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
        for sync in CONTIGUOUS_MODES:
            validate(build(plan, sync, 3, 12))


def test_missing_receive() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 2, 2)
    actions = list(schedule.actions[1])
    del actions[find(schedule.actions[1], "1<a1@0")]
    with pytest.raises(ScheduleError, match="every send needs exactly one matching") as error:
        validate(with_rank(schedule, 1, actions))
    assert error.value.cells == ((0, find(schedule.actions[0], "0>a1@1")),)
    assert "*0>a1@1*" in str(error.value)


def test_receive_from_the_wrong_replica() -> None:
    schedule = build(Plan.from_balance([1, 1], replicas=[2, 1]), "async", 1, 2)
    actions = list(schedule.actions[2])
    pos = find(schedule.actions[2], "1<a1@1")
    actions[pos] = dataclasses.replace(actions[pos], peer=0)
    with pytest.raises(ScheduleError, match="replica that serves the minibatch"):
        validate(with_rank(schedule, 2, actions))


def test_wrong_version() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 3, 1)
    actions = list(schedule.actions[0])
    for text in ("0F2v1", "0B2v1"):
        pos = find(schedule.actions[0], text)
        actions[pos] = dataclasses.replace(actions[pos], version=0)
    with pytest.raises(ScheduleError, match="async fixes the weight version") as error:
        validate(with_rank(schedule, 0, actions))
    assert "*0F2v0*" in str(error.value)


def test_backward_with_other_weights_than_its_forward() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 3, 1)
    actions = list(schedule.actions[0])
    pos = find(schedule.actions[0], "0B2v1")
    actions[pos] = dataclasses.replace(actions[pos], version=2)
    with pytest.raises(ScheduleError, match="same weights"):
        validate(with_rank(schedule, 0, actions))


def test_missing_backward() -> None:
    schedule = build(Plan.from_balance([1, 1]), "flush", 1, 2)
    actions = [a for a in schedule.actions[1] if str(a) != "1B1v0"]
    with pytest.raises(ScheduleError, match="one forward and one backward"):
        validate(with_rank(schedule, 1, actions))


def test_version_used_before_its_step() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 2, 1)
    actions = list(schedule.actions[1])
    step = actions.pop(find(schedule.actions[1], "1Sv1"))
    actions.insert(find(schedule.actions[1], "1F1v1"), step)  # now right after the forward
    with pytest.raises(ScheduleError, match="only after the step that produces it"):
        validate(with_rank(schedule, 1, actions))


def test_more_versions_than_the_stash_holds() -> None:
    plan = Plan.from_balance([1, 1])
    small = dataclasses.replace(plan.stages[0], weight_versions=1)
    plan = dataclasses.replace(plan, stages=(small, plan.stages[1]))
    with pytest.raises(ScheduleError, match="no more weight versions than async stashes"):
        validate(build(plan, "async", 4, 1))


def test_deadlock_is_caught_and_shown() -> None:
    flush, gpipe = (build(Plan.from_balance([1, 1]), sync, 1, 2) for sync in ("flush", "gpipe"))
    first = list(flush.actions[0])  # F0 >a0 F1 >a1 <g0 B0 <g1 B1 S
    waits_early = first[:2] + first[4:6] + first[2:4] + first[6:]  # <g0 before >a1
    schedule = with_rank(with_rank(flush, 0, waits_early), 1, list(gpipe.actions[1]))
    with pytest.raises(ScheduleError, match="must not deadlock") as error:
        validate(schedule)
    text = str(error.value)
    assert "stuck" in text and "*0<g0@1*" in text and "*1<a1@0*" in text


def test_collective_split_across_lightning_steps() -> None:
    """2-1 with one microbatch per batch: the replicas' all-reduce falls in different steps."""
    schedule = build(Plan.from_balance([1, 1], replicas=[2, 1]), "async", 2, 2)
    relabel = tuple(
        tuple(a if a.minibatch is None else dataclasses.replace(a, batch=a.minibatch) for a in rank)
        for rank in schedule.actions
    )
    one_each = dataclasses.replace(schedule, num_batches=4, microbatches=1, actions=relabel)
    with pytest.raises(ScheduleError, match="meet in the same Lightning step"):
        validate(one_each)
