"""Measured stage times as a cost model: per-layer costs and a speed per rank.

Every rank reports the mean forward and backward milliseconds per minibatch of each layer it
holds, over a window of steps (``RankTimes``; ``core.stage_clock`` makes them from the running
timeline). Two causes make a rank slower than its profile said, and they call for different
plans: a slow rank (a slower or shared device) slows every layer on it by the same factor, and a
layer moved off it runs at its old speed; a layer that became costly stays costly wherever it
goes. ``measured_model`` tells them apart by the ratios measured / profiled of a rank's layers:

* a rank's slowdown is the smallest ratio among its layers (a costly layer raises only its own
  ratio, a slow rank raises all of them, so the least raised bounds the rank's factor), divided
  by the median over ranks, so a change that hits every rank alike (longer sequences, another
  microbatch size) goes into the layer costs, not into the speeds;
* a layer's cost is its measured time divided by its rank's slowdown (the mean over a replicated
  stage's ranks); a layer nobody measured keeps its profiled cost times the median slowdown.

A rank that holds one layer cannot tell the two apart from one window: the change is taken as the
rank's (the next window after a move shows which it was). Pure Python: no torch import.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from pl_pipedream.planner.plan import PlanError
from pl_pipedream.profile.graph import Profile

__all__ = ["MeasuredModel", "RankTimes", "measured_model"]


@dataclass(frozen=True)
class RankTimes:
    """One rank's mean milliseconds per minibatch of each layer it holds, over ``steps``."""

    rank: int
    forward_ms: Mapping[str, float]
    backward_ms: Mapping[str, float]
    steps: int = 1

    def compute_ms(self, node_id: str) -> float:
        return self.forward_ms.get(node_id, 0.0) + self.backward_ms.get(node_id, 0.0)


@dataclass(frozen=True)
class MeasuredModel:
    """What the measurements say: ``profile`` with every layer's cost as measured on a rank of
    speed 1, and ``speeds[rank]`` (1: as fast as the median rank; 0.5: twice as slow)."""

    profile: Profile
    speeds: tuple[float, ...]

    @property
    def slowest(self) -> int:
        """The slowest rank (the lowest one among equals)."""
        return min(range(len(self.speeds)), key=lambda r: (self.speeds[r], r))


def measured_model(
    profile: Profile, measurements: Sequence[RankTimes], workers: int
) -> MeasuredModel:
    """Per-layer costs and per-rank speeds from every rank's ``RankTimes`` (``profile``: the
    profile the plan in use came from)."""
    ranks = sorted(m.rank for m in measurements)
    if ranks != list(range(workers)):
        raise PlanError(
            f"every rank must report its times once (ranks: {ranks}, workers: {workers}); "
            "gather one RankTimes from each rank"
        )
    slowdowns = [_slowdown(profile, m) for m in sorted(measurements, key=lambda m: m.rank)]
    middle = statistics.median(s for s in slowdowns if s is not None) if any(slowdowns) else 1.0
    relative = [middle if s is None else s for s in slowdowns]
    speeds = tuple(middle / s for s in relative)
    forward: dict[str, list[float]] = {}
    backward: dict[str, list[float]] = {}
    for m in measurements:
        factor = relative[m.rank] / middle
        for node_id in set(m.forward_ms) | set(m.backward_ms):
            forward.setdefault(node_id, []).append(m.forward_ms.get(node_id, 0.0) / factor)
            backward.setdefault(node_id, []).append(m.backward_ms.get(node_id, 0.0) / factor)
    nodes = []
    for node in profile.nodes:
        if node.node_id in forward:
            nodes.append(
                replace(
                    node,
                    forward_ms=math.fsum(forward[node.node_id]) / len(forward[node.node_id]),
                    backward_ms=math.fsum(backward[node.node_id]) / len(backward[node.node_id]),
                )
            )
        else:
            nodes.append(
                replace(
                    node, forward_ms=node.forward_ms * middle, backward_ms=node.backward_ms * middle
                )
            )
    return MeasuredModel(profile.with_nodes(nodes), speeds)


def _slowdown(profile: Profile, times: RankTimes) -> float | None:
    """The smallest measured / profiled ratio among the rank's layers (None: nothing to go by)."""
    ratios = []
    for node_id in set(times.forward_ms) | set(times.backward_ms):
        profiled = profile.node(node_id).compute_ms
        measured = times.compute_ms(node_id)
        if profiled > 0 and measured > 0:
            ratios.append(measured / profiled)
    return min(ratios) if ratios else None
