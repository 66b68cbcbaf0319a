"""Discrete-event simulation of a schedule: when each action starts and ends on each rank.

Each rank runs its list in order. A forward or backward takes its stage's time; a send costs the
sender nothing and delivers after ``bytes / bandwidth`` on its directed link, one transfer after
another; a receive waits for delivery; an ``ALLREDUCE`` starts when the last replica arrives and
ends for all together; a ``STEP`` takes ``step_ms``. A split backward's weight half takes
``weight_share`` of its stage's backward time and the input half the rest. Activations from stage
s to s + 1 and the gradients back have ``Stage.output_bytes`` of stage s.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass

from pl_pipedream.schedule.actions import RECVS, SENDS, Action, ActionKind, Schedule, ScheduleError
from pl_pipedream.schedule.progress import Progress
from pl_pipedream.schedule.result import SimulationResult, summarize

__all__ = ["Costs", "simulate"]

Span = tuple[float, float]


@dataclass(frozen=True)
class Costs:
    """Milliseconds per action kind and stage; ``transfer_ms[s]`` is one message s <-> s + 1."""

    forward_ms: tuple[float, ...]
    backward_ms: tuple[float, ...]
    transfer_ms: tuple[float, ...]
    allreduce_ms: tuple[float, ...]
    step_ms: float
    weight_share: float = 0.5

    def of(self, action: Action) -> float:
        if action.kind is ActionKind.FORWARD:
            return self.forward_ms[action.stage]
        if action.kind is ActionKind.BACKWARD:
            return self.backward_ms[action.stage]
        if action.kind is ActionKind.BACKWARD_INPUT:
            return self.backward_ms[action.stage] * (1.0 - self.weight_share)
        if action.kind is ActionKind.BACKWARD_WEIGHT:
            return self.backward_ms[action.stage] * self.weight_share
        if action.kind is ActionKind.ALLREDUCE:
            return self.allreduce_ms[action.stage]
        if action.kind is ActionKind.STEP:
            return self.step_ms
        return 0.0

    def transfer(self, action: Action) -> float:
        """Time on the wire for a message between ``action.stage`` and its neighbour (none for
        a hand-over between two stages of one rank)."""
        if action.peer == action.rank:
            return 0.0
        low = action.stage if action.kind is ActionKind.SEND_ACTIVATION else action.stage - 1
        return self.transfer_ms[low]


def simulate(
    schedule: Schedule,
    *,
    forward_ms: Sequence[float] | None = None,
    backward_ms: Sequence[float] | None = None,
    bandwidth: float | None = None,
    allreduce_ms: float | Sequence[float] | None = None,
    step_ms: float = 0.0,
    weight_share: float = 0.5,
) -> SimulationResult:
    """Simulate ``schedule``; per-stage times default to the plan's ``forward_ms``/``backward_ms``.

    ``bandwidth`` is in bytes/s (None: messages are free). ``allreduce_ms`` is one number, one per
    stage, or None for a ring all-reduce of the stage's ``parameter_bytes`` at ``bandwidth``.
    ``weight_share`` is the part of a backward that computes weight gradients (0..1): a split
    backward's weight half takes that share of the stage's backward time, the input half the rest.
    Raises ``ScheduleError`` if the schedule deadlocks.
    """
    if not 0.0 <= weight_share <= 1.0:
        raise ValueError(
            f"weight_share is the part of a backward spent on weight gradients, from 0 to 1 "
            f"(weight_share: {weight_share}); for example 0.5"
        )
    costs = stage_costs(schedule, forward_ms, backward_ms, bandwidth, allreduce_ms, step_ms)
    costs = dataclasses.replace(costs, weight_share=weight_share)
    return summarize(schedule, run(schedule, costs))


def stage_costs(
    schedule: Schedule,
    forward_ms: Sequence[float] | None,
    backward_ms: Sequence[float] | None,
    bandwidth: float | None,
    allreduce_ms: float | Sequence[float] | None,
    step_ms: float,
) -> Costs:
    stages = schedule.plan.stages
    forward = tuple(forward_ms) if forward_ms is not None else tuple(s.forward_ms for s in stages)
    backward = (
        tuple(backward_ms) if backward_ms is not None else tuple(s.backward_ms for s in stages)
    )
    for name, values in (("forward_ms", forward), ("backward_ms", backward)):
        if len(values) != len(stages):
            raise ValueError(
                f"give one time per stage ({name}: {len(values)} values, stages: {len(stages)}); "
                f"pass {len(stages)} values"
            )
    if bandwidth is not None and not bandwidth > 0:
        raise ValueError(f"bandwidth must be positive bytes/s (bandwidth: {bandwidth}); or None")

    def wire(num_bytes: float) -> float:
        return 0.0 if bandwidth is None else 1e3 * num_bytes / bandwidth

    transfer = tuple(wire(s.output_bytes) for s in stages)
    if allreduce_ms is None:
        reduce = tuple(2 * (s.replicas - 1) / s.replicas * wire(s.parameter_bytes) for s in stages)
    elif isinstance(allreduce_ms, (int, float)):
        reduce = (float(allreduce_ms),) * len(stages)
    else:
        reduce = tuple(allreduce_ms)
    return Costs(forward, backward, transfer, reduce, step_ms)


def run(schedule: Schedule, costs: Costs) -> tuple[tuple[Span, ...], ...]:
    """(start, end) in ms of every action of every rank."""
    actions = schedule.actions
    progress = Progress(schedule)
    clock = [0.0] * len(actions)
    spans: list[list[Span]] = [[] for _ in actions]
    link_free: dict[tuple[int, int], float] = defaultdict(float)
    moved = True
    while moved:
        moved = False
        for rank in range(len(actions)):
            while progress.ready(rank):
                action = progress.next(rank)
                assert action is not None
                now = clock[rank]
                if action.kind in SENDS:
                    link = (rank, action.peer)
                    start = max(now, link_free[link])  # type: ignore[index]
                    link_free[link] = start + costs.transfer(action)  # type: ignore[index]
                    spans[rank].append((now, now))
                    progress.advance(rank, payload=link_free[link])  # type: ignore[index]
                elif action.kind in RECVS:
                    arrival = progress.advance(rank)
                    assert arrival is not None  # a receive returns its send's payload
                    clock[rank] = max(now, arrival)
                    spans[rank].append((now, clock[rank]))
                else:  # compute, a step, or an ALLREDUCE that every replica reached
                    group = progress.movers(rank)
                    start = max(clock[other] for other in group)
                    for other in group:
                        clock[other] = start + costs.of(action)
                        spans[other].append((start, clock[other]))
                    progress.advance(rank)
                moved = True
    if progress.stuck:
        waiting = ", ".join(f"rank {r}: {actions[r][pos]}" for r, pos in progress.stuck)
        raise ScheduleError(
            f"a schedule must not deadlock to be simulated (stuck at {waiting}); run "
            "validate(schedule) for the marked table",
            progress.stuck,
        )
    return tuple(tuple(rank_spans) for rank_spans in spans)
