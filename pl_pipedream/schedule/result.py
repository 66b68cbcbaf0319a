"""What a simulation measured, as a frozen value with a short text summary.

Busy time is the time spent in actions of ``BUSY_KINDS`` (forward, backward, optimizer step); a
rank's bubble is the part of a window it is not busy (waiting for messages and all-reduces counts
as bubble). ``bubble_fraction`` is that share, for the simulator and the runtime's timeline alike.

Steady state. Let ``C(t)`` be the time the input stage finishes the last backward (or weight half)
of batch ``t``:
then every minibatch of batch ``t`` has left the pipeline. With ``T`` batches the steady window
runs from ``C(t1)`` to ``C(t2)``, ``t1 = T // 4`` and ``t2 = T - 1 - T // 4``: it skips the first
and last quarter of the batches, which hold the warm-up (pipeline fill) and the drain, and spans
``(t2 - t1) * m`` minibatches. Time per minibatch is the window's length over that count. With
fewer than 3 batches there is no such window and the whole run is used (total time / minibatches).
For flushed modes a minibatch is a microbatch; the window then covers whole flushed batches.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from pl_pipedream.schedule.actions import BUSY_KINDS, WEIGHT_GRADS, Action, Schedule
from pl_pipedream.schedule.footprint import in_flight_counts, live_version_counts
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["BUSY_KINDS", "SimulationResult", "bubble_fraction", "summarize"]

Span = tuple[float, float]


@dataclass(frozen=True)
class SimulationResult:
    """Times in milliseconds; tuples indexed by rank (``bubble``, ``rank_in_flight``) or stage
    (``peak_*``).

    ``spans[r][k]`` is the (start, end) of rank r's action k, for a trace viewer.
    ``stage_of_rank[r]`` is rank r's stage (its first, in a plan of several stages per rank,
    whose all are ``stages_of_rank[r]``); ``rank_in_flight[r]`` the most activations rank r
    holds at once over all its stages.
    """

    sync: SyncMode
    shape: str
    num_minibatches: int
    total_ms: float
    time_per_minibatch_ms: float
    throughput: float
    steady_window_ms: tuple[float, float]
    bubble: tuple[float, ...]
    steady_bubble: tuple[float, ...]
    peak_in_flight: tuple[int, ...]
    peak_versions: tuple[int, ...]
    stage_of_rank: tuple[int, ...]
    spans: tuple[tuple[Span, ...], ...] = field(repr=False)
    stages_of_rank: tuple[tuple[int, ...], ...] = ()
    rank_in_flight: tuple[int, ...] = ()

    def describe(self) -> str:
        """A few lines: time per minibatch, throughput, bubbles per rank, memory per stage."""
        start, end = self.steady_window_ms
        lines = [
            f"{self.sync} on plan {self.shape}: {self.num_minibatches} minibatches in "
            f"{self.total_ms:.3f} ms",
            f"time per minibatch   {self.time_per_minibatch_ms:.4f} ms (steady window "
            f"{start:.3f}..{end:.3f} ms)",
            f"throughput           {self.throughput:.2f} minibatches/s",
            "rank  stage  bubble(run)  bubble(steady)",
        ]
        for rank, stage in enumerate(self.stage_of_rank):
            run, steady = self.bubble[rank], self.steady_bubble[rank]
            held = self.stages_of_rank[rank] if self.stages_of_rank else (stage,)
            name = ",".join(str(s) for s in held)
            lines.append(f"{rank:>4}  {name:>5}  {run:>11.3f}  {steady:>14.3f}")
        lines.append("stage  peak activations  peak weight versions")
        for stage, (acts, versions) in enumerate(
            zip(self.peak_in_flight, self.peak_versions, strict=True)
        ):
            lines.append(f"{stage:>5}  {acts:>16}  {versions:>20}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.describe()

    def to_dict(self) -> dict[str, object]:
        """Every figure except the per-action spans, JSON-ready."""
        return {
            "sync": self.sync.value,
            "shape": self.shape,
            "num_minibatches": self.num_minibatches,
            "total_ms": self.total_ms,
            "time_per_minibatch_ms": self.time_per_minibatch_ms,
            "throughput": self.throughput,
            "steady_window_ms": list(self.steady_window_ms),
            "bubble": list(self.bubble),
            "steady_bubble": list(self.steady_bubble),
            "peak_in_flight": list(self.peak_in_flight),
            "peak_versions": list(self.peak_versions),
            "stage_of_rank": list(self.stage_of_rank),
            "stages_of_rank": [list(stages) for stages in self.stages_of_rank],
            "rank_in_flight": list(self.rank_in_flight),
        }


def summarize(schedule: Schedule, spans: tuple[tuple[Span, ...], ...]) -> SimulationResult:
    """Turn per-action spans into the result's numbers."""
    total = max((end for rank in spans for _, end in rank), default=0.0)
    start, end, count = steady_window(schedule, spans, total)
    per_minibatch = (end - start) / count if count else 0.0
    plan = schedule.plan
    stages_of_rank = tuple(
        tuple(stage.index for stage in plan.stages_of_rank(r)) for r in range(schedule.num_ranks)
    )
    return SimulationResult(
        sync=schedule.sync,
        shape=plan.shape,
        num_minibatches=schedule.num_minibatches,
        total_ms=total,
        time_per_minibatch_ms=per_minibatch,
        throughput=1e3 / per_minibatch if per_minibatch > 0 else float("inf"),
        steady_window_ms=(start, end),
        bubble=tuple(_idle(schedule, spans, r, 0.0, total) for r in range(schedule.num_ranks)),
        steady_bubble=tuple(
            _idle(schedule, spans, r, start, end) for r in range(schedule.num_ranks)
        ),
        peak_in_flight=_per_stage(schedule, in_flight_counts),
        peak_versions=_per_stage(schedule, live_version_counts),
        stage_of_rank=tuple(stages[0] for stages in stages_of_rank),
        spans=spans,
        stages_of_rank=stages_of_rank,
        rank_in_flight=tuple(max(in_flight_counts(actions)) for actions in schedule.actions),
    )


def steady_window(
    schedule: Schedule, spans: tuple[tuple[Span, ...], ...], total: float
) -> tuple[float, float, int]:
    """(start, end, minibatches) of the steady-state window described in the module docstring."""
    num_batches, m = schedule.num_batches, schedule.microbatches
    first, last = num_batches // 4, num_batches - 1 - num_batches // 4
    if last <= first:
        return 0.0, total, schedule.num_minibatches
    done = [0.0] * num_batches
    for rank in schedule.plan.stages[0].ranks:
        for action, (_, end) in zip(schedule.actions[rank], spans[rank], strict=True):
            if action.kind in WEIGHT_GRADS and action.batch is not None:
                done[action.batch] = max(done[action.batch], end)
    return done[first], done[last], (last - first) * m


def bubble_fraction(busy: Iterable[Span], start: float, end: float) -> float:
    """The share of the window ``[start, end]`` that the ``busy`` spans leave uncovered.

    ``busy`` holds one rank's (start, end) spans of ``BUSY_KINDS`` actions, which do not
    overlap; parts outside the window do not count. An empty window has no bubble (0.0).
    """
    if end <= start:
        return 0.0
    covered = sum(max(0.0, min(b, end) - max(a, start)) for a, b in busy)
    return 1.0 - covered / (end - start)


def _idle(
    schedule: Schedule, spans: tuple[tuple[Span, ...], ...], rank: int, start: float, end: float
) -> float:
    """Fraction of [start, end] that ``rank`` is not busy."""
    busy = (
        span
        for action, span in zip(schedule.actions[rank], spans[rank], strict=True)
        if action.kind in BUSY_KINDS
    )
    return bubble_fraction(busy, start, end)


def _per_stage(
    schedule: Schedule, counts: Callable[[Sequence[Action]], list[int]]
) -> tuple[int, ...]:
    """Per stage, the most ``counts`` gives over its ranks' actions of that stage."""
    return tuple(
        max(
            max(counts([a for a in schedule.actions[r] if a.stage == stage.index]))
            for r in stage.ranks
        )
        for stage in schedule.plan.stages
    )
