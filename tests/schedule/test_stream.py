"""SegmentStream: a whole-epoch build's segments and drains at any step, without building it."""

from __future__ import annotations

import dataclasses
import importlib
import time

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import (
    CONTIGUOUS_MODES,
    ActionKind,
    Schedule,
    ScheduleError,
    SegmentStream,
    SyncMode,
    build,
    rules,
    segments,
)
from pl_pipedream.schedule import stream as stream_module

# the package's ``build`` and ``validate`` are the functions; these are their modules
build_module = importlib.import_module("pl_pipedream.schedule.build")
validate_module = importlib.import_module("pl_pipedream.schedule.validate")

PLANS = {f"straight{p}": Plan.from_balance([1] * p) for p in (1, 2, 3, 4)} | {
    shape: Plan.from_balance([1, 1], replicas=[int(r) for r in shape.split("-")])
    for shape in ("2-1", "1-2", "2-2")
}
CASES = [
    (name, sync, m)
    for name, plan in PLANS.items()
    for sync in CONTIGUOUS_MODES
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
    assert sorted(stream._endings) == list(range(stream.steady_from + 1))


def _breaking(monkeypatch: pytest.MonkeyPatch, num_batches: int) -> None:
    """Make the stream's build of ``num_batches`` batches lose rank 0's first action."""
    real = stream_module.build

    def broken(*args: object, **kwargs: object) -> Schedule:
        schedule = real(*args, **kwargs)  # type: ignore[arg-type]
        if schedule.num_batches != num_batches:
            return schedule
        first, *rest = schedule.actions
        return dataclasses.replace(schedule, actions=(first[1:], *rest))

    monkeypatch.setattr(stream_module, "build", broken)


def test_validate_raises_for_a_broken_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    _breaking(monkeypatch, 2)  # the schedule behind the drain after step 1
    stream = SegmentStream(Plan.from_balance([1, 1]), "async", 2)
    stream.validate(drains=False)
    with pytest.raises(ScheduleError):
        stream.validate()


def test_a_drain_is_checked_before_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    _breaking(monkeypatch, 2)
    stream = SegmentStream(Plan.from_balance([1, 1]), "async", 2, ranks=(0,))
    stream.validate(drains=False)
    assert stream.drain(0, 0)  # behind it: the schedule of one batch
    with pytest.raises(ScheduleError):
        stream.drain(0, 1)


def test_a_drain_is_cut_once_however_often_it_is_asked_for(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A flushed mode drains at every step: the drain of a step is cut from its schedule once."""
    stream = SegmentStream(Plan.from_balance([1, 1]), "async", 4, ranks=(0,))
    first, far = stream.drain(0, 0), stream.drain(0, 10)
    assert first and far
    cuts: list[int] = []
    monkeypatch.setattr(stream_module, "segments", lambda *a: cuts.append(1) or segments(*a))
    assert stream.drain(0, 0) is first
    assert stream.drain(0, 10) == far  # past the warm-up: shifted copies of one cut
    assert stream.drain(0, 11)[0].minibatch == far[0].minibatch + 4
    assert cuts == []


def test_a_segment_is_checked_before_it_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    stream = SegmentStream(Plan.from_balance([1, 1]), "flush", 1, ranks=(1,))
    _breaking(monkeypatch, stream.steady_from + 2)
    with pytest.raises(ScheduleError):
        stream.segment(1, 0)


@pytest.mark.parametrize("sync", CONTIGUOUS_MODES)
def test_a_rank_builds_and_checks_only_its_neighbourhood(
    monkeypatch: pytest.MonkeyPatch, sync: str
) -> None:
    """Serving rank 9 of 16 stages (and the input stage): lists of stages 0, 1 and 8-10 only,
    every one of them validated, and the same segments and drains as the whole pipeline's."""
    plan, m = Plan.from_balance([1] * 16), 16 if sync == "2bw" else 1
    expanded: list[int] = []
    real = build_module.expand

    def counted(plan: Plan, sync: SyncMode, m: int, rank: int, tokens: list) -> list:  # type: ignore[type-arg]
        expanded.append(rank)
        return real(plan, sync, m, rank, tokens)

    validated: list[frozenset[int] | None] = []
    checks = validate_module.CHECKS

    def first_check(schedule: Schedule):  # type: ignore[no-untyped-def]
        validated.append(schedule.scope)
        return checks[0](schedule)

    monkeypatch.setattr(build_module, "expand", counted)
    monkeypatch.setattr(validate_module, "CHECKS", (first_check, *checks[1:]))
    stream = SegmentStream(plan, sync, m, ranks=(9, 0))
    stream.validate(drains=False)
    near = {0, 1, 8, 9, 10}
    assert set(expanded) == near
    assert validated == [frozenset(near)]
    stream.drain(9, 3)
    assert set(expanded) == near and validated == [frozenset(near)] * 2
    monkeypatch.undo()
    whole = SegmentStream(plan, sync, m)
    for t in (0, 3, stream.steady_from + 5):
        assert stream.segment(9, t) == whole.segment(9, t)
        assert stream.drain(9, t) == whole.drain(9, t)
        assert stream.segment(0, t) == whole.segment(0, t)


def test_a_stream_gives_only_the_ranks_it_serves() -> None:
    stream = SegmentStream(Plan.from_balance([1] * 4), "async", 1, ranks=(2,))
    with pytest.raises(ValueError, match=r"the ranks it serves \(rank: 1, served: \[2\]\)"):
        stream.segment(1, 0)
    with pytest.raises(ValueError, match="rank must name a worker"):
        SegmentStream(Plan.from_balance([1] * 4), "async", 1, ranks=(4,))
