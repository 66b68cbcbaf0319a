"""Run a schedule in unit time steps, without any process: the deadlock check and the table.

Every rank walks its own list. A receive waits until its send has run; sends never wait (as if
buffers were unbounded); an ``ALLREDUCE`` waits until every replica of its stage stands at the
same one. Actions the caller shows take one time step each; hidden ones take none and run as soon
as they can. The result lists, per step, which action each rank ran; if the ranks stop before
their lists end, the schedule deadlocks and ``position`` says where each rank is stuck.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

from pl_pipedream.schedule.actions import (
    RECVS,
    SENDS,
    Action,
    ActionKind,
    Schedule,
    collective_key,
    message_key,
)

__all__ = ["UnitTimeRun", "run_in_unit_time"]

Shown = Callable[[int, int, Action], bool]


@dataclass(frozen=True)
class UnitTimeRun:
    """``rows[k][r]`` is the index of the shown action rank r ran at step k (None: idle)."""

    rows: tuple[tuple[int | None, ...], ...]
    position: tuple[int, ...]
    lengths: tuple[int, ...]

    @property
    def finished(self) -> bool:
        return self.position == self.lengths

    @property
    def stuck(self) -> tuple[tuple[int, int], ...]:
        """(rank, action index) of every rank that stopped before the end of its list."""
        return tuple(
            (rank, pos)
            for rank, (pos, length) in enumerate(zip(self.position, self.lengths, strict=True))
            if pos < length
        )


class _State:
    def __init__(self, schedule: Schedule) -> None:
        self.actions = schedule.actions
        self.position = [0] * len(schedule.actions)
        self.posted: Counter[tuple[object, ...]] = Counter()
        self.replicas = {stage.index: stage.ranks for stage in schedule.plan.stages}

    def next(self, rank: int) -> Action | None:
        pos = self.position[rank]
        return self.actions[rank][pos] if pos < len(self.actions[rank]) else None

    def ready(self, action: Action) -> bool:
        if action.kind in RECVS:
            return self.posted[message_key(action)] > 0  # type: ignore[index]
        if action.kind is ActionKind.ALLREDUCE:
            key = collective_key(action)
            for rank in self.replicas[action.stage]:
                other = self.next(rank)
                if other is None or collective_key(other) != key:
                    return False
        return True

    def run(self, rank: int) -> list[int]:
        """Run rank's next action; return every rank that moved (all replicas for a collective)."""
        action = self.next(rank)
        assert action is not None
        if action.kind in SENDS:
            self.posted[message_key(action)] += 1  # type: ignore[index]
        elif action.kind in RECVS:
            self.posted[message_key(action)] -= 1  # type: ignore[index]
        elif action.kind is ActionKind.ALLREDUCE:
            movers = list(self.replicas[action.stage])
            for other in movers:
                self.position[other] += 1
            return movers
        self.position[rank] += 1
        return [rank]


def run_in_unit_time(schedule: Schedule, shown: Shown) -> UnitTimeRun:
    """Run ``schedule`` step by step; ``shown(rank, index, action)`` picks the timed actions."""
    state = _State(schedule)
    rows: list[tuple[int | None, ...]] = []
    while True:
        _run_hidden(state, shown)
        row: list[int | None] = [None] * len(state.actions)
        for rank in range(len(state.actions)):
            action = state.next(rank)
            if action is not None and row[rank] is None and state.ready(action):
                for mover in _movers(state, rank, action):
                    row[mover] = state.position[mover]
        if all(cell is None for cell in row):
            break
        for rank, cell in enumerate(row):
            if cell is not None and state.position[rank] == cell:
                state.run(rank)
        rows.append(tuple(row))
    lengths = tuple(len(actions) for actions in state.actions)
    return UnitTimeRun(tuple(rows), tuple(state.position), lengths)


def _movers(state: _State, rank: int, action: Action) -> list[int]:
    if action.kind is ActionKind.ALLREDUCE:
        return list(state.replicas[action.stage])
    return [rank]


def _run_hidden(state: _State, shown: Shown) -> None:
    """Run hidden actions on every rank until none is ready (they take no time)."""
    moved = True
    while moved:
        moved = False
        for rank in range(len(state.actions)):
            while True:
                action = state.next(rank)
                pos = state.position[rank]
                if action is None or shown(rank, pos, action) or not state.ready(action):
                    break
                state.run(rank)
                moved = True
