"""SegmentStream: a whole-epoch build's segments and drains at any step, without building it."""

from __future__ import annotations

import dataclasses
import time

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import (
    SYNC_MODES,
    ActionKind,
    ScheduleError,
    SegmentStream,
    build,
    rules,
    segments,
)

PLANS = {f"straight{p}": Plan.from_balance([1] * p) for p in (1, 2, 3, 4)} | {
    shape: Plan.from_balance([1, 1], replicas=[int(r) for r in shape.split("-")])
    for shape in ("2-1", "1-2", "2-2")
}
CASES = [
    (name, sync, m)
    for name, plan in PLANS.items()
    for sync in SYNC_MODES
    for m in (1, 2, 3, 4, 6)
    if all(m % stage.replicas == 0 for stage in plan.stages)
    and (sync != "2bw" or m >= plan.num_stages)
]


@pytest.mark.parametrize(("name", "sync", "m"), CASES)
def test_stream_matches_direct_builds(name: str, sync: str, m: int) -> None:
    """For every N > t + 1 segment t is the same, and the build of t + 1 batches extends it."""
    plan = PLANS[name]
    stream = SegmentStream(plan, sync, m)
    steps = [*range(12), stream.steady_from + 1, stream.steady_from + 3]
    longest = max(steps) + 3
    cut = {n: build(plan, sync, n, m) for n in {*range(1, 15), longest, *(t + 1 for t in steps)}}
    for rank in range(plan.num_workers):
        pieces = {n: segments(schedule, rank) for n, schedule in cut.items()}
        for t in steps:
            going_on = {pieces[n][t] for n in pieces if n > t + 1}
            assert going_on == {stream.segment(rank, t)}, (rank, t)
            last = pieces[t + 1][t]
            assert last == stream.segment(rank, t) + stream.drain(rank, t), (rank, t)


@pytest.mark.parametrize(
    ("plan", "sync", "m"),
    [
        (Plan.from_balance([1] * 4), "async", 4),
        (Plan.from_balance([1] * 4), "vertical_sync", 1),
        (Plan.from_balance([1, 1], replicas=[2, 1]), "async", 2),
        (Plan.from_balance([1, 1], replicas=[1, 2]), "2bw", 4),
        (Plan.from_balance([1, 1, 1]), "gpipe", 3),
    ],
)
def test_far_step_is_fast_and_numbered(plan: Plan, sync: str, m: int) -> None:
    stream = SegmentStream(plan, sync, m)
    t = 10_000
    for rank in range(plan.num_workers):
        stream.segment(rank, 0)  # build the small schedules once
        start = time.perf_counter()
        piece = stream.segment(rank, t)
        assert time.perf_counter() - start < 0.01
        stage = plan.stage_of_rank(rank).index
        forwards = [a for a in piece if a.kind is ActionKind.FORWARD]
        assert {a.batch for a in forwards} == {t}
        mine = [
            i for i in range(t * m, (t + 1) * m) if rules.rank_of(plan.stages[stage], i) == rank
        ]
        assert [a.minibatch for a in forwards] == mine
        for action in piece:
            if action.minibatch is not None:
                assert action.batch == action.minibatch // m
            if action.kind in (ActionKind.FORWARD, ActionKind.BACKWARD):
                i = action.minibatch
                assert action.version == rules.weight_version(plan, stream.sync, m, stage, i)  # type: ignore[arg-type]
        last_backward = None
        for action in piece:
            if action.kind is ActionKind.BACKWARD:
                last_backward = action.minibatch
            elif action.kind is ActionKind.STEP:  # the update the backward before it closes
                assert last_backward is not None
                assert action.version == rules.update_of(plan, stream.sync, m, stage, last_backward)


def test_async_far_step_by_hand() -> None:
    """Four stages, m = 4: stage 0 runs batch 10 000 with versions i - 3, one step per backward."""
    piece = SegmentStream(Plan.from_balance([1] * 4), "async", 4).segment(0, 10_000)
    assert [
        str(a)
        for a in piece
        if a.kind in (ActionKind.FORWARD, ActionKind.BACKWARD, ActionKind.STEP)
    ][:6] == [
        "0F40000v39997",
        "0B39997v39994",
        "0Sv39998",
        "0F40001v39998",
        "0B39998v39995",
        "0Sv39999",
    ]


@pytest.mark.parametrize(("name", "sync", "m"), [c for c in CASES if c[2] in (1, 4)])
def test_validate_checks_every_schedule_it_cuts(name: str, sync: str, m: int) -> None:
    stream = SegmentStream(PLANS[name], sync, m)
    stream.validate()
    assert len(stream._ending) == stream.steady_from + 1


def test_validate_raises_for_a_broken_schedule() -> None:
    stream = SegmentStream(Plan.from_balance([1, 1]), "async", 2)
    ending = stream._ending[1]
    broken = dataclasses.replace(ending, actions=(ending.actions[0][1:], ending.actions[1]))
    stream.__dict__["_ending"] = (*stream._ending[:1], broken, *stream._ending[2:])
    with pytest.raises(ScheduleError):
        stream.validate()
