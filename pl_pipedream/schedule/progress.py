"""Where each rank stands in its list, and whether its next action may run.

The dependencies between ranks, stated once for everything that steps through a schedule without
a process (the deadlock check, the unit-time run behind the table, and the simulator): a
receive waits until its send has run; sends never wait (as if buffers were unbounded); an
``ALLREDUCE`` waits until every replica of its stage stands at the same one, and then all of
them move past it together. A send posts a payload that its receive gets back (the simulator's
arrival time). In a schedule that holds only some ranks' lists (``Schedule.scope``), a receive
from a rank outside it is ready at once and gets no payload: that rank's own check answers for
its send.
"""

from __future__ import annotations

from collections import defaultdict, deque

from pl_pipedream.schedule.actions import (
    RECVS,
    SENDS,
    Action,
    ActionKind,
    Schedule,
    collective_key,
    message_key,
)

__all__ = ["Progress"]


class Progress:
    """Each rank's position in its list of ``schedule``, and the messages posted so far."""

    def __init__(self, schedule: Schedule) -> None:
        self.actions = schedule.actions
        self.ranks = schedule.held_ranks
        self.position = [0] * len(schedule.actions)
        self._outside = set(range(len(schedule.actions))) - set(self.ranks)
        self._posted: dict[object, deque[float]] = defaultdict(deque)
        self._replicas = {stage.index: stage.ranks for stage in schedule.plan.stages}

    def next(self, rank: int) -> Action | None:
        """Rank's next action, None once its list has ended."""
        pos = self.position[rank]
        return self.actions[rank][pos] if pos < len(self.actions[rank]) else None

    def ready(self, rank: int) -> bool:
        """Rank has a next action and what it waits for has happened."""
        action = self.next(rank)
        if action is None:
            return False
        if action.kind in RECVS:
            return action.peer in self._outside or bool(self._posted[message_key(action)])
        if action.kind is ActionKind.ALLREDUCE:
            key = collective_key(action)
            return all(_key(self.next(other)) == key for other in self.movers(rank))
        return True

    def movers(self, rank: int) -> tuple[int, ...]:
        """The ranks that rank's next action moves: every replica for an ``ALLREDUCE``."""
        action = self.next(rank)
        if action is not None and action.kind is ActionKind.ALLREDUCE:
            return self._replicas[action.stage]
        return (rank,)

    def advance(self, rank: int, payload: float = 0.0) -> float | None:
        """Run rank's next action (which must be ready); a send posts ``payload``, a receive
        returns the payload of its send."""
        action = self.next(rank)
        assert action is not None, f"rank {rank} has no action left"
        received = None
        if action.kind in SENDS:
            self._posted[message_key(action)].append(payload)
        elif action.kind in RECVS and action.peer not in self._outside:
            received = self._posted[message_key(action)].popleft()
        for mover in self.movers(rank):
            self.position[mover] += 1
        return received

    def run_all(self) -> None:
        """Move every rank as far as it can go.

        Where the ranks stop does not depend on the order they move in: a ready action stays
        ready until its own rank runs it (only that rank takes its message; replicas standing at
        an ``ALLREDUCE`` cannot move otherwise). So this is where every run of the schedule
        stops, the deadlock check's answer without timing anything.
        """
        moved = True
        while moved:
            moved = False
            for rank in self.ranks:
                while self.ready(rank):
                    self.advance(rank)
                    moved = True

    @property
    def stuck(self) -> tuple[tuple[int, int], ...]:
        """(rank, action index) of every rank whose list has not ended."""
        return tuple(
            (rank, pos) for rank, pos in enumerate(self.position) if pos < len(self.actions[rank])
        )


def _key(action: Action | None) -> object:
    return None if action is None else collective_key(action)
