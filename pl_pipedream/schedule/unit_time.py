"""Run a schedule in unit time steps, without any process: the rows of ``render``'s table.

Every rank walks its own list, waiting as ``progress`` says (a receive for its send, an
``ALLREDUCE`` for every replica). Actions the caller shows take one time step each; hidden ones
take none and run as soon as they can. The result lists, per step, which action each rank ran;
if the ranks stop before their lists end, the schedule deadlocks and ``position`` says where each
rank is stuck (where ``Progress.run_all`` stops too).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from pl_pipedream.schedule.actions import Action, Schedule
from pl_pipedream.schedule.progress import Progress

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


def run_in_unit_time(schedule: Schedule, shown: Shown) -> UnitTimeRun:
    """Run ``schedule`` step by step; ``shown(rank, index, action)`` picks the timed actions."""
    progress = Progress(schedule)
    num_ranks = len(schedule.actions)
    rows: list[tuple[int | None, ...]] = []
    while True:
        _run_hidden(progress, shown)
        row: list[int | None] = [None] * num_ranks
        for rank in range(num_ranks):
            if row[rank] is None and progress.ready(rank):
                for mover in progress.movers(rank):
                    row[mover] = progress.position[mover]
        if all(cell is None for cell in row):
            break
        for rank, cell in enumerate(row):
            if cell is not None and progress.position[rank] == cell:  # not moved by its collective
                progress.advance(rank)
        rows.append(tuple(row))
    lengths = tuple(len(actions) for actions in schedule.actions)
    return UnitTimeRun(tuple(rows), tuple(progress.position), lengths)


def _run_hidden(progress: Progress, shown: Shown) -> None:
    """Run hidden actions on every rank until none is ready (they take no time)."""
    moved = True
    while moved:
        moved = False
        for rank in range(len(progress.actions)):
            while progress.ready(rank):
                action = progress.next(rank)
                if shown(rank, progress.position[rank], action):  # type: ignore[arg-type]
                    break
                progress.advance(rank)
                moved = True
