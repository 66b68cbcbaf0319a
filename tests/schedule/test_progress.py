"""Progress: a receive waits for its send, an ALLREDUCE for every replica; where ranks stop."""

from __future__ import annotations

import dataclasses

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import Schedule, build
from pl_pipedream.schedule.progress import Progress
from pl_pipedream.schedule.unit_time import run_in_unit_time


def names(progress: Progress) -> list[str | None]:
    return [None if a is None else str(a) for a in map(progress.next, range(2))]


def deadlocked() -> Schedule:
    """Stage 0 waits for the gradient of minibatch 0 before it sends minibatch 1 (GPipe's
    stage 1 needs both forwards first)."""
    flush, gpipe = (build(Plan.from_balance([1, 1]), sync, 1, 2) for sync in ("flush", "gpipe"))
    first = flush.actions[0]  # F0 >a0 F1 >a1 <g0 B0 <g1 B1 S
    waits_early = first[:2] + first[4:6] + first[2:4] + first[6:]  # <g0 before >a1
    return dataclasses.replace(flush, actions=(waits_early, gpipe.actions[1]))


def test_a_receive_waits_for_its_send_and_gets_its_payload() -> None:
    progress = Progress(build(Plan.from_balance([1, 1]), "gpipe", 1, 1))
    assert names(progress) == ["0F0v0", "1<a0@0"]
    assert progress.ready(0) and not progress.ready(1)
    assert progress.advance(0) is None
    assert names(progress) == ["0>a0@1", "1<a0@0"] and not progress.ready(1)
    progress.advance(0, payload=7.5)
    assert progress.ready(1)
    assert progress.advance(1) == 7.5
    assert names(progress) == ["0<g0@1", "1F0v0"] and not progress.ready(0)


def run_until(progress: Progress, rank: int, text: str) -> None:
    while str(progress.next(rank)) != text:
        assert progress.ready(rank), (rank, str(progress.next(rank)))
        progress.advance(rank)


def test_an_allreduce_moves_every_replica_together() -> None:
    """2-1, flush, one batch of two: replicas 0 and 1 of stage 0 average their gradients."""
    progress = Progress(build(Plan.from_balance([1, 1], replicas=[2, 1]), "flush", 1, 2))
    run_until(progress, 0, "0<g0@2")
    run_until(progress, 2, "1<a1@1")
    run_until(progress, 0, "0Av1")
    assert progress.movers(0) == (0, 1) and progress.movers(2) == (2,)
    assert not progress.ready(0)  # replica 1 has not come yet
    run_until(progress, 1, "0<g1@2")
    run_until(progress, 2, "1Sv1")
    run_until(progress, 1, "0Av1")
    assert progress.ready(0) and progress.ready(1)
    before = list(progress.position)
    progress.advance(1)
    assert progress.position == [before[0] + 1, before[1] + 1, before[2]]
    assert names(progress) == ["0Sv1", "0Sv1"]


def test_an_ended_list_is_never_ready() -> None:
    progress = Progress(build(Plan.from_balance([1]), "async", 1, 1))
    progress.run_all()
    assert progress.next(0) is None and not progress.ready(0)
    assert progress.stuck == ()


def test_run_all_stops_where_every_run_stops() -> None:
    schedule = deadlocked()
    progress = Progress(schedule)
    progress.run_all()
    assert [str(schedule.actions[r][p]) for r, p in progress.stuck] == ["0<g0@1", "1<a1@0"]
    for shown in (lambda r, p, a: True, lambda r, p, a: False, lambda r, p, a: p % 2 == 0):
        run = run_in_unit_time(schedule, shown)
        assert run.stuck == progress.stuck
