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

Every schedule the stream builds is validated before a segment is cut from it. A stream that
serves some ranks only (a rank's runtime serves itself and the input stage, whose backward passes
say which batch has finished) builds and checks only their neighbourhoods (module ``scope``), so
its cost grows with the length of a rank's list, not with the whole pipeline; and it builds the
schedule behind a drain when that drain is first asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import rules
from pl_pipedream.schedule.actions import Action, Schedule
from pl_pipedream.schedule.build import build
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.scope import neighbourhood
from pl_pipedream.schedule.segments import segments
from pl_pipedream.schedule.validate import validate

__all__ = ["SegmentStream"]

Segment = tuple[Action, ...]


@dataclass(frozen=True)
class SegmentStream:
    """Segments and drains of ``build(plan, sync, N, microbatches)`` for unbounded ``N``.

    ``sync`` may be given as the mode's name; it is stored as the ``SyncMode``. ``ranks`` are the
    ranks it serves (default: every rank).
    """

    plan: Plan
    sync: SyncMode
    microbatches: int
    ranks: tuple[int, ...] | None = None
    _endings: dict[int, Schedule] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _drains: dict[tuple[int, int], Segment] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        mode = rules.check_arguments(self.plan, self.sync, 1, self.microbatches)
        object.__setattr__(self, "sync", mode)
        if self.ranks is not None:
            object.__setattr__(self, "ranks", tuple(sorted(set(self.ranks))))
            for rank in self.ranks:
                self._check_rank(rank)

    @classmethod
    def of_rank(
        cls, plan: Plan, sync: SyncMode | str, microbatches: int, rank: int
    ) -> SegmentStream:
        """The stream a rank's runtime reads, checked: its own segments and the input stage's
        (whose backward passes say which batch has finished). Its cost grows with the length of
        one rank's list, not with the pipeline; each drain is checked when first asked for."""
        stream = cls(plan, SyncMode.parse(sync), microbatches, (rank, *plan.stages[0].ranks))
        stream.validate(drains=False)
        return stream

    @property
    def served(self) -> tuple[int, ...]:
        """The ranks whose segments it gives."""
        return tuple(range(self.workers)) if self.ranks is None else self.ranks

    @cached_property
    def workers(self) -> int:
        """The plan's workers (read at every step: counted once)."""
        return self.plan.num_workers

    @cached_property
    def scope(self) -> frozenset[int] | None:
        """The ranks whose lists its schedules hold (None: every rank)."""
        return None if self.ranks is None else neighbourhood(self.plan, self.ranks)

    @cached_property
    def steady_from(self) -> int:
        """The first step from which every step is a shifted copy of the one before.

        The last warm-up effects (clamped versions, a backward of the first batches) end by step
        ``2 (p - 1) / m`` in a straight pipeline; ``2 + ceil(2 W / m)`` over ``W`` workers bounds
        it for every plan with room to spare.
        """
        return 2 + math.ceil(2 * self.workers / self.microbatches)

    def segment(self, rank: int, t: int) -> Segment:
        """Rank's actions for Lightning step ``t`` when the pipeline goes on after it."""
        self._check(rank, t)
        base = min(t, self.steady_from)
        return self._shift(self._segments[rank][base], rank, t - base)

    def drain(self, rank: int, t: int) -> Segment:
        """What rank runs after ``segment(rank, t)`` when step ``t`` is the last before a drain."""
        self._check(rank, t)
        base = min(t, self.steady_from)
        return self._shift(self._drain(rank, base), rank, t - base)

    def validate(self, drains: bool = True) -> None:
        """Build, and so validate, the schedule the segments are cut from and, with ``drains``,
        every schedule a drain is cut from.

        Raises ``ScheduleError`` naming the first broken rule. Every later step is a shifted
        copy of step ``steady_from`` (see the module docstring), so a runtime that calls this at
        setup runs only segments the validator has checked, up to that shift; a drain left out
        here is checked when it is first asked for, before it runs.
        """
        self._going_on  # noqa: B018 (built and checked on first use)
        if drains:
            for t in range(self.steady_from + 1):
                self._ending(t)

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.workers:
            raise ValueError(
                f"rank must name a worker of the plan (rank: {rank}, workers: "
                f"{self.workers}); pass 0 <= rank < {self.workers}"
            )

    def _check(self, rank: int, t: int) -> None:
        self._check_rank(rank)
        if rank not in self.served:
            raise ValueError(
                f"a stream gives the segments of the ranks it serves (rank: {rank}, served: "
                f"{list(self.served)}); build SegmentStream(..., ranks=...) with that rank"
            )
        if t < 0:
            raise ValueError(f"steps count from 0 after the last drain (t: {t}); pass t >= 0")

    def _shift(self, actions: Segment, rank: int, steps: int) -> Segment:
        """Move ``actions`` ``steps`` batches later."""
        if steps == 0:
            return actions
        m = self.microbatches
        stage = self.plan.stages_of_rank(rank)[0]  # chunks: one update per batch, one replica
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

    def _checked(self, num_batches: int) -> Schedule:
        """The validated schedule of ``num_batches`` batches, over the stream's scope."""
        schedule = build(self.plan, self.sync, num_batches, self.microbatches, self.scope)
        validate(schedule)
        return schedule

    @cached_property
    def _going_on(self) -> Schedule:
        """The schedule of ``steady_from + 2`` batches: steps up to ``steady_from`` continue."""
        return self._checked(self.steady_from + 2)

    def _ending(self, t: int) -> Schedule:
        """The schedule of ``t + 1`` batches, whose last segment ends with the drain after ``t``."""
        if t not in self._endings:
            self._endings[t] = self._checked(t + 1)
        return self._endings[t]

    @cached_property
    def _segments(self) -> dict[int, tuple[Segment, ...]]:
        """Per rank served, the segments of steps ``0 .. steady_from`` with more batches after."""
        return {
            rank: tuple(segments(self._going_on, rank)[: self.steady_from + 1])
            for rank in self.served
        }

    def _drain(self, rank: int, t: int) -> Segment:
        """Rank's drain after step ``t <= steady_from`` (cut once: a flushed mode drains at
        every step)."""
        drain = self._drains.get((rank, t))
        if drain is None:
            drain = segments(self._ending(t), rank)[t][len(self._segments[rank][t]) :]
            self._drains[(rank, t)] = drain
        return drain
