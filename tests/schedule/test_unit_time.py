"""The unit-time run behind the table: shown actions take a step, hidden ones none."""

from __future__ import annotations

import dataclasses

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import ActionKind, build
from pl_pipedream.schedule.unit_time import run_in_unit_time

COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)


def cells(schedule, run) -> list[list[str]]:  # type: ignore[no-untyped-def]
    return [
        ["" if pos is None else str(schedule.actions[rank][pos]) for rank, pos in enumerate(row)]
        for row in run.rows
    ]


def test_hidden_messages_and_updates_take_no_step() -> None:
    schedule = build(Plan.from_balance([1, 1]), "gpipe", 1, 2)
    run = run_in_unit_time(schedule, lambda rank, pos, action: action.kind in COMPUTE)
    assert run.finished and run.stuck == ()
    assert cells(schedule, run) == [
        ["0F0v0", ""],
        ["0F1v0", "1F0v0"],
        ["", "1F1v0"],
        ["", "1B0v0"],
        ["0B0v0", "1B1v0"],
        ["0B1v0", ""],
    ]


def test_every_shown_action_takes_one_step() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 1, 1)
    run = run_in_unit_time(schedule, lambda rank, pos, action: True)
    assert run.finished
    assert cells(schedule, run) == [
        ["0F0v0", ""],
        ["0>a0@1", ""],
        ["", "1<a0@0"],  # a receive runs the step after its send
        ["", "1F0v0"],
        ["", "1B0v0"],
        ["", "1>g0@0"],
        ["0<g0@1", "1Sv1"],
        ["0B0v0", ""],
        ["0Sv1", ""],
    ]


def test_a_deadlock_stops_the_run() -> None:
    schedule = build(Plan.from_balance([1, 1]), "async", 1, 1)
    forward, send, receive, backward, step = schedule.actions[0]
    waits_first = (forward, receive, send, backward, step)  # the gradient before the activation
    stuck = dataclasses.replace(schedule, actions=(waits_first, schedule.actions[1]))
    run = run_in_unit_time(stuck, lambda rank, pos, action: True)
    assert not run.finished
    assert run.stuck == ((0, 1), (1, 0))
    assert run.position == (1, 0) and run.lengths == (5, 5)
    assert cells(stuck, run) == [["0F0v0", ""]]
