"""Per-Lightning-step segments: one per batch, in batch order, never waiting on a later step."""

from __future__ import annotations

import dataclasses

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, ActionKind, Schedule, build, segments
from pl_pipedream.schedule.unit_time import run_in_unit_time

K = ActionKind


def built(plan: Plan) -> list[Schedule]:
    m = 2 * plan.num_stages
    modes = CONTIGUOUS_MODES
    return [build(plan, sync, 4, m) for sync in modes] + [build(plan, "async", 6, m // 2)]


def test_one_segment_per_batch_covering_the_list(plan: Plan) -> None:
    for schedule in built(plan):
        for rank, actions in enumerate(schedule.actions):
            pieces = segments(schedule, rank)
            assert len(pieces) == schedule.num_batches
            assert tuple(a for piece in pieces for a in piece) == actions
            for batch, piece in enumerate(pieces):
                forwards = {a.batch for a in piece if a.kind is K.FORWARD}
                assert forwards == {batch}
                if batch > 0:  # cut right before the first forward of the batch (or its receive)
                    head = piece[0] if piece[0].kind is K.FORWARD else piece[1]
                    assert head.kind is K.FORWARD and head.batch == batch


def test_last_segment_holds_the_drain() -> None:
    schedule = build(Plan.from_balance([1, 1, 1]), "async", 3, 2)
    last = segments(schedule, 0)[-1]
    assert [str(a) for a in last if a.kind is K.BACKWARD] == ["0B2v0", "0B3v1", "0B4v2", "0B5v3"]
    assert str(last[-1]) == "0Sv6"


def test_flushed_segments_end_with_their_step(plan: Plan) -> None:
    for sync in ("flush", "gpipe"):
        schedule = build(plan, sync, 3, 2 * plan.num_stages)
        for rank in range(schedule.num_ranks):
            for batch, piece in enumerate(segments(schedule, rank)):
                assert piece[-1].kind is K.STEP and piece[-1].version == batch + 1


def test_steps_run_in_lock_step(plan: Plan) -> None:
    """With a barrier after every Lightning step, the first t segments finish on their own."""
    for schedule in built(plan):
        pieces = [segments(schedule, rank) for rank in range(schedule.num_ranks)]
        for steps in range(1, schedule.num_batches + 1):
            prefix = tuple(
                tuple(a for piece in rank_pieces[:steps] for a in piece) for rank_pieces in pieces
            )
            shortened = dataclasses.replace(schedule, actions=prefix)
            run = run_in_unit_time(shortened, lambda r, p, a: True)
            assert run.finished, (schedule.sync, steps, run.stuck)
