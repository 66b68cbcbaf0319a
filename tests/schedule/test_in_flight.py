"""Messages in flight per link: the worst case over timings, held against runs that reach it."""

from __future__ import annotations

import itertools
from collections import defaultdict

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import Schedule, SyncMode, build, simulate
from pl_pipedream.schedule.actions import RECVS, SENDS, message_key
from pl_pipedream.schedule.in_flight import (
    every_rank_sends_in_flight,
    sends_in_flight,
    sends_in_flight_between,
)
from pl_pipedream.schedule.progress import Progress

CONTIGUOUS = [mode for mode in SyncMode if not mode.chunked]

# Every replica layout of 2 to 4 stages on at most 6 workers, straight ones included.
LAYOUTS = [
    list(replicas)
    for stages in (2, 3, 4)
    for replicas in itertools.product((1, 2, 3), repeat=stages)
    if sum(replicas) <= 6
]


def schedules(sync: SyncMode, layouts: list[list[int]] = LAYOUTS):
    for replicas in layouts:
        plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
        for microbatches in (1, 2, 3, 4, 6):
            try:
                yield build(plan, sync, 4, microbatches)
            except ValueError:  # counts the mode cannot serve (rules.check_arguments)
                continue


def _tensor(action) -> str:
    return message_key(action)[0]


def slowest_peer_run(schedule: Schedule, rank: int, peer: int) -> dict[tuple[int, str], int]:
    """The most messages in flight from ``rank`` to ``peer`` in the run where ``peer`` is
    slowest: every other rank moves as far as it can before the peer runs its next action."""
    progress = Progress(schedule)
    flight: dict[tuple[int, str], int] = defaultdict(int)
    most: dict[tuple[int, str], int] = {}
    while True:
        moved = True
        while moved:
            moved = False
            for r in range(schedule.num_ranks):
                while r != peer and progress.ready(r) and peer not in progress.movers(r):
                    action = progress.next(r)
                    if r == rank and action.kind in SENDS and action.peer == peer:
                        link = (peer, _tensor(action))
                        flight[link] += 1
                        most[link] = max(most.get(link, 0), flight[link])
                    progress.advance(r)
                    moved = True
        if not progress.ready(peer):
            break
        action = progress.next(peer)
        if action.kind in RECVS and action.peer == rank:
            flight[(peer, _tensor(action))] -= 1
        progress.advance(peer)
    assert not progress.stuck
    return most


@pytest.mark.parametrize(
    "sync",
    [  # 1-2 s a mode: the fast tier runs async and flush, the whole suite every mode
        pytest.param(m, marks=() if m in (SyncMode.ASYNC, SyncMode.FLUSH) else pytest.mark.slow)
        for m in CONTIGUOUS
    ],
    ids=str,
)
def test_the_count_is_reached_when_the_peer_is_slowest(sync: SyncMode) -> None:
    checked = 0
    for schedule in schedules(sync):
        every = every_rank_sends_in_flight(schedule)  # one pass for all ranks, the same counts
        for rank in range(schedule.num_ranks):
            counts = sends_in_flight(schedule, rank)
            assert every[rank] == counts
            for peer in {peer for peer, _ in counts}:
                run = slowest_peer_run(schedule, rank, peer)
                assert run == {k: v for k, v in counts.items() if k[0] == peer}, (
                    schedule.plan.shape,
                    schedule.microbatches,
                    rank,
                )
                checked += 1
    assert checked > 200


@pytest.mark.parametrize("sync", CONTIGUOUS, ids=str)
def test_a_simulated_run_never_holds_more(sync: SyncMode) -> None:
    for schedule in schedules(sync):
        spans = simulate(schedule).spans
        for rank in range(schedule.num_ranks):
            counts = sends_in_flight(schedule, rank)
            for (peer, tensor), count in counts.items():
                received = [
                    spans[peer][pos][1]
                    for pos, a in enumerate(schedule.actions[peer])
                    if a.kind in RECVS and a.peer == rank and _tensor(a) == tensor
                ]
                sent = 0
                for pos, a in enumerate(schedule.actions[rank]):
                    if a.kind in SENDS and a.peer == peer and _tensor(a) == tensor:
                        sent += 1
                        at = spans[rank][pos][0]
                        assert sent - sum(end <= at for end in received) <= count


@pytest.mark.parametrize("sync", CONTIGUOUS, ids=str)
def test_two_lists_give_the_count_of_a_straight_pipeline(sync: SyncMode) -> None:
    for schedule in schedules(sync, [[1] * stages for stages in (2, 3, 4, 5)]):
        for rank in range(schedule.num_ranks):
            pairs = {}
            for peer in (rank - 1, rank + 1):
                if 0 <= peer < schedule.num_ranks:
                    theirs = schedule.actions[peer]
                    pairs |= sends_in_flight_between(schedule.actions[rank], theirs, rank, peer)
            assert pairs == sends_in_flight(schedule, rank)


def test_a_straight_pipeline_holds_the_minibatches_in_flight_per_link() -> None:
    # async on 4 stages: stage s has w_s + 1 = 4 - s minibatches in flight, and the link to the
    # next stage carries at most that many messages each way, whatever m is
    for microbatches in (1, 4):
        schedule = build(Plan.from_balance([1] * 4), SyncMode.ASYNC, 6, microbatches)
        counts = [sends_in_flight(schedule, rank) for rank in range(4)]
        assert counts == [
            {(1, "a"): 4},
            {(0, "g"): 4, (2, "a"): 3},
            {(1, "g"): 3, (3, "a"): 2},
            {(2, "g"): 2},
        ]
    # gpipe sends a whole batch before any backward
    schedule = build(Plan.from_balance([1, 1]), SyncMode.GPIPE, 3, 8)
    assert sends_in_flight(schedule, 0) == {(1, "a"): 8}
