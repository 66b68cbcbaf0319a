"""Whether to re-plan: a better plan for the measured costs, worth the one-off cost of moving.

Given the plan in use, the measured model (``planner.measured``: per-layer costs and a speed per
rank), the topology and the memory per worker, ``decide`` plans again with the ranks' speeds
(``planner.speeds``; ``planner.plan`` too when every speed is 1) and prices both plans with
``speeds.plan_time`` on the same terms. Moving costs the bytes of every layer that lands on a rank
that did not hold it, its parameters and its optimizer state (``state_factor`` times the parameters:
2 for Adam, 1 for SGD with momentum), sent at ``move_bandwidth``; spread over ``horizon``
minibatches it is added to the new plan's time per minibatch. The decision moves only when the
current time exceeds that by more than ``threshold`` (a fraction), so measurement noise does not
move layers back and forth. Where the measurements read two ways (a rank of one layer: slow rank or
costly layer, ``MeasuredModel.alternatives``), a move must pay under both. A better plan that does
not fit the memory per worker (``fit``) is skipped with a warning, and the best plan that fits is
weighed instead. Where a rank's speed cannot be read from a reference yet (the reference profile is
its own measurements), the caller passes the other reading (``measured.rank_reading``) in
``readings``, and a move must pay under it too: a plan that puts every layer on a rank that is slow,
not costly, is slower under that reading and is not chosen. ``confirm`` adds hysteresis across
checks: a gain beyond ``CLEAR`` thresholds (a rank several times slower) moves at once, and a
smaller one only when the check before found the same plan, so that noise of a few thresholds' size
(a loaded machine) does not move layers to a plan that only ties with the current one, nor back
again; a move that gives a rank of unknown speed work it does not do now (``new_work``) is always
held for the next check. Pure: no torch import."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from pl_pipedream.planner.measured import MeasuredModel
from pl_pipedream.planner.optimize import plan as plan_equal
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.speeds import plan_time, plan_with_speeds
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["CLEAR", "Decision", "Fit", "confirm", "decide", "move_bytes", "new_work"]

CLEAR = 4.0  # a gain beyond 1 + CLEAR x threshold moves at once; a smaller one is seen twice


@dataclass(frozen=True)
class Decision:
    """The outcome of one check: ``plan`` is the plan to train with next (the current one when
    ``move`` is False); times are predicted seconds per minibatch on the measured model,
    ``new_time`` the best candidate's with its ``move_seconds`` amortised (under the reading
    least favourable to it)."""

    move: bool
    plan: Plan
    current_time: float
    new_time: float
    move_seconds: float
    warnings: tuple[str, ...] = ()

    @property
    def gain(self) -> float:
        """Current time over the new plan's time with the move amortised (1: no gain)."""
        return self.current_time / self.new_time if self.new_time > 0 else math.inf

    def render(self) -> str:
        if not self.move:
            return f"kept {self.plan.layout}: {self.current_time * 1e3:.3f} ms per minibatch"
        return (
            f"move to {self.plan.layout}: {self.current_time * 1e3:.3f} ms -> "
            f"{self.new_time * 1e3:.3f} ms per minibatch (move {self.move_seconds:.3f} s)"
        )


def move_bytes(current: Plan, new: Plan, profile: Profile, state_factor: float = 2.0) -> float:
    """Bytes sent to move from ``current`` to ``new``: each layer's parameters and optimizer
    state (``state_factor`` times the parameters) to every rank that newly holds it."""
    before = {n: set(s.ranks) for s in current.stages for n in s.nodes}
    total = 0.0
    for stage in new.stages:
        for node_id in stage.nodes:
            gained = len(set(stage.ranks) - before.get(node_id, set()))
            total += gained * profile.node(node_id).parameter_bytes * (1.0 + state_factor)
    return total


def new_work(current: Plan, new: Plan, ranks: Sequence[int]) -> tuple[int, ...]:
    """The ranks of ``ranks`` that ``new`` gives work they do not do in ``current``: a layer
    they do not hold, or a larger share of one (fewer replicas of their stage)."""
    out = []
    for rank in ranks:
        before, after = current.stage_of_rank(rank), new.stage_of_rank(rank)
        if not set(after.nodes) <= set(before.nodes) or after.replicas < before.replicas:
            out.append(rank)
    return tuple(out)


class Fit(Protocol):
    """The memory a plan must fit (``core.memory_limit.MemoryFit``: by what the sync mode
    keeps, the rule setup holds a plan to)."""

    @property
    def memory(self) -> float: ...

    def fits(self, plan: Plan) -> bool: ...

    def best(self, make: Callable[[float | None], Plan]) -> Plan: ...


def decide(
    current: Plan,
    model: MeasuredModel,
    topology: Topology,
    fit: Fit | None = None,
    *,
    threshold: float = 0.05,
    horizon: int = 1000,
    move_bandwidth: float | None = None,
    state_factor: float = 2.0,
    straight: bool = False,
    cuts: str = "auto",
    microbatches: int | None = None,
    readings: Sequence[MeasuredModel] = (),
) -> Decision:
    """Re-plan for ``model`` and say whether moving to the new plan pays within ``horizon``
    minibatches (``move_bandwidth``, bytes/s: default the topology's slowest level); ``fit``:
    the memory per worker a plan must fit (None: no limit); ``readings``: other readings of the
    same measurements a move must pay under as well."""
    if threshold < 0 or horizon < 1:
        raise PlanError(
            f"the threshold must be >= 0 and the horizon >= 1 minibatch (threshold: "
            f"{threshold}, horizon: {horizon}); pass e.g. threshold=0.05, horizon=1000"
        )
    bandwidth = move_bandwidth or min(level.bandwidth for level in topology.levels)
    options = dict(straight=straight, cuts=cuts, microbatches=microbatches)
    readings = (*model.alternatives(), *readings)
    warnings: list[str] = []
    candidates = []
    for reading in readings:
        best = _best(reading.profile, topology, reading.speeds, None, options)
        if best is not None and fit is not None and not fit.fits(best):
            warnings.append(
                f"a faster plan does not fit the memory per worker (plan: {best.shape}, "
                f"memory: {fit.memory:.0f} bytes); it is skipped, and the best plan that fits is "
                "weighed instead"
            )
            best = _fitting(fit, reading, topology, options)
        if best is not None:
            candidates.append(best)
    current_time = plan_time(current, model.profile, topology, model.speeds)
    keep = Decision(False, current, current_time, current_time, 0.0, tuple(warnings))
    if not candidates:
        return keep
    scored = []
    for best in candidates:
        seconds = move_bytes(current, best, model.profile, state_factor) / bandwidth
        # The gain under the reading least favourable to the move.
        gains = []
        for reading in readings:
            before = plan_time(current, reading.profile, topology, reading.speeds)
            after = plan_time(best, reading.profile, topology, reading.speeds) + seconds / horizon
            gains.append(before / after)
        scored.append((min(gains), seconds, best))
    gain, seconds, best = max(scored, key=lambda item: item[0])
    move = gain > 1.0 + threshold
    chosen = best if move else current
    return Decision(move, chosen, current_time, current_time / gain, seconds, keep.warnings)


def _fitting(
    fit: Fit, reading: MeasuredModel, topology: Topology, options: dict[str, object]
) -> Plan | None:
    """The best plan on ``reading`` that ``fit`` accepts (None: none does)."""

    def make(limit: float | None) -> Plan:
        found = _best(reading.profile, topology, reading.speeds, limit, options)
        if found is None:
            raise PlanError(f"no plan fits {limit} bytes per worker")
        return found

    try:
        return fit.best(make)
    except PlanError:
        return None


def _best(
    profile: Profile,
    topology: Topology,
    speeds: Sequence[float],
    memory: float | None,
    options: dict[str, object],
) -> Plan | None:
    """The fastest plan on ``speeds`` by ``plan_time`` (None: none fits): the speed DP's, and
    PipeDream's hierarchical one as well when every speed is 1."""
    candidates = []
    try:
        candidates.append(plan_with_speeds(profile, topology, speeds, memory=memory, **options))  # type: ignore[arg-type]
        if all(s == 1.0 for s in speeds):
            candidates.append(plan_equal(profile, topology, memory=memory, **options))  # type: ignore[arg-type]
    except PlanError:
        if not candidates:
            return None
    return min(candidates, key=lambda p: plan_time(p, profile, topology, speeds))


def confirm(
    current: Plan,
    decision: Decision,
    proposed: Plan | None,
    threshold: float,
    at_once: bool = True,
) -> tuple[Decision, Plan | None]:
    """``decision`` with hysteresis, and the plan to remember for the next check: a move to the
    plan ``proposed`` at the check before goes ahead, and so does one whose gain is beyond
    ``1 + CLEAR * threshold`` when ``at_once``; any other move is held (the current plan kept)
    and its plan proposed."""
    if not decision.move:
        return decision, None
    if (at_once and decision.gain > 1.0 + CLEAR * threshold) or (
        proposed is not None and _layout(proposed) == _layout(decision.plan)
    ):
        return decision, None
    held = Decision(
        False, current, decision.current_time, decision.current_time, 0.0, decision.warnings
    )
    return held, decision.plan


def _layout(plan: Plan) -> list[tuple[tuple[str, ...], tuple[int, ...]]]:
    return [(tuple(s.nodes), tuple(s.ranks)) for s in plan.stages]
