"""What each sync mode keeps per stage, held against the schedule that is built for it."""

from __future__ import annotations

import itertools
import math

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import SyncMode, build, rules
from pl_pipedream.schedule.footprint import in_flight_counts, live_version_counts
from pl_pipedream.schedule.in_flight import sends_in_flight
from pl_pipedream.schedule.memory import (
    frame_bytes,
    frames_in_flight,
    minibatches_in_flight,
    rank_frame_bytes,
    stage_bytes,
    versions_kept,
)

CONTIGUOUS = [mode for mode in SyncMode if not mode.chunked]

# Every replica layout of 2 to 4 stages on at most 6 workers, straight ones included.
LAYOUTS = [
    list(replicas)
    for stages in (2, 3, 4)
    for replicas in itertools.product((1, 2, 3), repeat=stages)
    if sum(replicas) <= 6
]
BATCHES = 8  # enough for every layout here to reach its steady state


def built_counts(plan: Plan, sync: SyncMode, microbatches: int) -> list[tuple[int, int]]:
    """(weight versions, minibatches in flight) per stage: the most any of its ranks holds
    after any action of the built schedule."""
    schedule = build(plan, sync, BATCHES, microbatches)
    return [
        (
            max(max(live_version_counts(schedule.actions[rank])) for rank in stage.ranks),
            max(max(in_flight_counts(schedule.actions[rank])) for rank in stage.ranks),
        )
        for stage in plan.stages
    ]


@pytest.mark.parametrize("sync", CONTIGUOUS, ids=str)
def test_the_counts_are_those_of_the_built_schedule(sync: SyncMode) -> None:
    checked = 0
    for replicas in LAYOUTS:
        plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
        for microbatches in (1, 2, 3, 4, 6, 12):
            try:
                built = built_counts(plan, sync, microbatches)
            except ValueError:  # counts the mode cannot serve (rules.check_arguments)
                continue
            stages = range(plan.num_stages)
            said = [
                (
                    versions_kept(plan, sync, microbatches, s),
                    minibatches_in_flight(plan, sync, microbatches, s),
                )
                for s in stages
            ]
            assert said == built, (replicas, microbatches)
            assert all(v <= rules.stash_limit(plan, sync, s) for s, (v, _) in enumerate(said))
            checked += 1
    assert checked > 100


def test_a_straight_pipeline_per_mode() -> None:
    plan = Plan.from_balance([1, 1, 1])
    table = {mode: [versions_kept(plan, mode, 4, s) for s in range(3)] for mode in CONTIGUOUS}
    assert table == {
        SyncMode.ASYNC: [3, 2, 1],
        SyncMode.VERTICAL_SYNC: [3, 3, 3],  # every stage on the input stage's version
        SyncMode.TWO_BW: [2, 2, 2],
        SyncMode.FLUSH: [1, 1, 1],
        SyncMode.GPIPE: [1, 1, 1],
        SyncMode.ZERO_BUBBLE: [1, 1, 1],
    }
    flight = {
        mode: [minibatches_in_flight(plan, mode, 2, s) for s in range(3)] for mode in CONTIGUOUS
    }
    assert flight[SyncMode.VERTICAL_SYNC] == [3, 2, 1]
    assert flight[SyncMode.FLUSH] == [2, 2, 1]
    assert flight[SyncMode.GPIPE] == [2, 2, 2]
    assert flight[SyncMode.ZERO_BUBBLE] == [2, 2, 2]  # held to the weight half: 1F1B's peak


def test_the_bytes_are_weights_times_versions_plus_activations_in_flight() -> None:
    plan = Plan.from_balance([1, 1, 1])
    stages = tuple(
        s.__class__(
            **{**s.__dict__, "parameter_bytes": 10.0, "activation_bytes": 1.0, "input_bytes": 0.5}
        )
        for s in plan.stages
    )
    sized = Plan(stages)
    assert [stage_bytes(sized, SyncMode.ASYNC, 4, s) for s in range(3)] == [33.0, 22.0, 11.0]
    assert [stage_bytes(sized, SyncMode.VERTICAL_SYNC, 4, s) for s in range(3)] == [
        33.0,
        32.0,
        31.0,
    ]
    # recompute: a stage but the last keeps its inputs in flight plus one replay's activations
    assert stage_bytes(sized, SyncMode.ASYNC, 4, 0, recompute=True) == 30.0 + 1.5 + 1.0
    assert stage_bytes(sized, SyncMode.ASYNC, 4, 2, recompute=True) == 11.0


@pytest.mark.slow  # 8 s a mode; the fast tier checks the counts against the built schedule
@pytest.mark.parametrize("sync", list(CONTIGUOUS), ids=str)
def test_frames_in_flight_are_those_of_a_long_run(sync: SyncMode) -> None:
    """The short run ``frames_in_flight`` reads (the straight case from three lists alone)
    gives the count of runs of many more batches, at every rank (3-4 s a mode: the fast tier
    runs async and flush, the whole suite every mode)."""
    checked = 0
    for replicas in LAYOUTS:
        plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
        for microbatches in (1, 2, 3, 4, 6, 12):
            batches = 6 + math.ceil(2 * plan.num_workers / microbatches)
            try:
                schedule = build(plan, sync, batches, microbatches)
            except ValueError:  # counts the mode cannot serve (rules.check_arguments)
                continue
            for rank in range(plan.num_workers):
                said = frames_in_flight(plan, sync, microbatches, rank)
                assert said == sends_in_flight(schedule, rank), (replicas, microbatches, rank)
                checked += 1
    assert checked > 500


def test_frames_in_flight_do_not_grow_with_the_microbatches() -> None:
    # 16 stages: the most on any link is the input stage's 16 minibatches in flight (async), not
    # the (2 S + 4) m = 144 frames the channel once kept at m = 4
    plan = Plan.from_balance([1] * 16)
    for microbatches in (1, 4, 16):
        most = max(
            max(frames_in_flight(plan, SyncMode.ASYNC, microbatches, rank).values())
            for rank in range(16)
        )
        assert most == 16
    assert frames_in_flight(plan, SyncMode.FLUSH, 4, 0) == {(1, "a"): 4}


def test_the_frames_count_what_crosses_each_link() -> None:
    plan = Plan.from_balance([1, 1, 1])
    stages = tuple(
        s.__class__(
            **{**s.__dict__, "output_bytes": 0.0 if s.index == 2 else 100.0 * (s.index + 1)}
        )
        for s in plan.stages
    )
    sized = Plan(stages)
    # stage 1 (async, 3 stages): sends 2 activations of 200 B and 3 gradients of 100 B in
    # flight, and keeps one receive posted from each neighbour (100 B in, 200 B back)
    assert frame_bytes(sized, SyncMode.ASYNC, 4, 1) == 2 * 200 + 3 * 100 + 100 + 200
    assert frame_bytes(sized, SyncMode.ASYNC, 4, 0) == 3 * 100 + 100
    assert stage_bytes(sized, SyncMode.ASYNC, 4, 1) == frame_bytes(sized, SyncMode.ASYNC, 4, 1)
    # replicated: the most over the stage's ranks, from one pass for every rank
    plan = Plan.from_balance([1, 1, 1], replicas=[2, 1, 2])
    stages = tuple(s.__class__(**{**s.__dict__, "output_bytes": 10.0}) for s in plan.stages)
    replicated = Plan(stages)
    for stage in replicated.stages:
        each = [sum(rank_frame_bytes(replicated, SyncMode.ASYNC, 4, r)) for r in stage.ranks]
        assert frame_bytes(replicated, SyncMode.ASYNC, 4, stage.index) == max(each) > 0
