"""Each rank's segment for any Lightning step, in time independent of the step.

The runtime learns only at the end of a step whether a drain follows (end of epoch, ``max_steps``,
validation, a checkpoint), so it asks for the segment of step ``t`` as if the pipeline continued,
and for the drain on its own. Both are what ``segments(build(...))`` gives: a segment does not
depend on how many batches come after it, and the segment that ends a schedule is that same
segment followed by the drain (``tests/schedule/test_stream.py`` checks both).

Past the warm-up every step repeats the one before with batch ``t + 1`` in place of ``t``:
minibatches move by ``m``, versions by the stage's updates per batch (``m / r_s`` in ``async`` and
``vertical_sync``, one otherwise), and peers stay put because ``m`` is a multiple of every
``r_s``. So a few small schedules are built once and later steps are shifted copies.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import Action, Schedule
from pl_pipedream.schedule.build import build
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.segments import segments
from pl_pipedream.schedule.validate import validate

__all__ = ["SegmentStream"]

Segment = tuple[Action, ...]


@dataclass(frozen=True)
class SegmentStream:
    """Segments and drains of ``build(plan, sync, N, microbatches)`` for unbounded ``N``.

    ``sync`` may be given as the mode's name; it is stored as the ``SyncMode``.
    """

    plan: Plan
    sync: SyncMode
    microbatches: int

    def __post_init__(self) -> None:
        mode = rules.check_arguments(self.plan, self.sync, 1, self.microbatches)
        object.__setattr__(self, "sync", mode)

    @property
    def steady_from(self) -> int:
        """The first step from which every step is a shifted copy of the one before.

        The last warm-up effects (clamped versions, a backward of the first batches) end by step
        ``2 (p - 1) / m`` in a straight pipeline; ``2 + ceil(2 W / m)`` over ``W`` workers bounds
        it for every plan with room to spare.
        """
        return 2 + math.ceil(2 * self.plan.num_workers / self.microbatches)

    def segment(self, rank: int, t: int) -> Segment:
        """Rank's actions for Lightning step ``t`` when the pipeline goes on after it."""
        return self._at(self._segments, rank, t)

    def drain(self, rank: int, t: int) -> Segment:
        """What rank runs after ``segment(rank, t)`` when step ``t`` is the last before a drain."""
        return self._at(self._drains, rank, t)

    def _at(self, table: tuple[tuple[Segment, ...], ...], rank: int, t: int) -> Segment:
        if not 0 <= rank < self.plan.num_workers:
            raise ValueError(
                f"rank must name a worker of the plan (rank: {rank}, workers: "
                f"{self.plan.num_workers}); pass 0 <= rank < {self.plan.num_workers}"
            )
        if t < 0:
            raise ValueError(f"steps count from 0 after the last drain (t: {t}); pass t >= 0")
        base = min(t, self.steady_from)
        return self._shift(table[rank][base], rank, t - base)

    def _shift(self, actions: Segment, rank: int, steps: int) -> Segment:
        """Move ``actions`` ``steps`` batches later."""
        if steps == 0:
            return actions
        m = self.microbatches
        stage = self.plan.stage_of_rank(rank)
        per_batch = m // stage.replicas if self.sync.updates_per_minibatch else 1
        return tuple(
            Action(
                a.kind,
                a.rank,
                a.stage,
                a.replica,
                None if a.minibatch is None else a.minibatch + m * steps,
                None if a.batch is None else a.batch + steps,
                None if a.version is None else a.version + per_batch * steps,
                a.peer,
            )
            for a in actions
        )

    def validate(self) -> None:
        """Run ``validate`` on every schedule the segments and drains are cut from.

        Raises ``ScheduleError`` naming the first broken rule. Every later step is a shifted
        copy of step ``steady_from`` (see the module docstring), so a runtime that calls this at
        setup runs only segments the validator has checked, up to that shift.
        """
        for schedule in (self._going_on, *self._ending):
            validate(schedule)

    @cached_property
    def _going_on(self) -> Schedule:
        """The schedule of ``steady_from + 2`` batches: steps up to ``steady_from`` continue."""
        return build(self.plan, self.sync, self.steady_from + 2, self.microbatches)

    @cached_property
    def _ending(self) -> tuple[Schedule, ...]:
        """The schedules of ``t + 1`` batches for each step ``t`` up to ``steady_from``."""
        return tuple(
            build(self.plan, self.sync, t + 1, self.microbatches)
            for t in range(self.steady_from + 1)
        )

    @cached_property
    def _segments(self) -> tuple[tuple[Segment, ...], ...]:
        """Per rank, the segments of steps ``0 .. steady_from`` with more batches after them."""
        return tuple(
            tuple(segments(self._going_on, rank)[: self.steady_from + 1])
            for rank in range(self.plan.num_workers)
        )

    @cached_property
    def _drains(self) -> tuple[tuple[Segment, ...], ...]:
        """Per rank, the drain after each of steps ``0 .. steady_from``."""
        return tuple(
            tuple(
                segments(schedule, rank)[t][len(self._segments[rank][t]) :]
                for t, schedule in enumerate(self._ending)
            )
            for rank in range(self.plan.num_workers)
        )
