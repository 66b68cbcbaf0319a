"""Measured stage times as a cost model: per-layer costs and a speed per rank.

Every rank reports the mean forward and backward milliseconds per minibatch of each layer it
holds, over a window of steps (``RankTimes``; ``core.stage_clock`` makes them from the running
timeline). Two causes make a rank slower than its profile said, and they call for different
plans: a slow rank (a slower or shared device) slows every layer on it by the same factor, and a
layer moved off it runs at its old speed; a layer that became costly stays costly wherever it
goes. ``measured_model`` tells them apart by the ratios measured / profiled of a rank's layers:

* a rank's slowdown comes from its least raised layers (a costly layer raises only its own
  ratio, a slow rank raises all of them): the pooled ratio (measured sum over profiled sum) of
  its layers, leaving out, until none is left to leave out, each layer more than ``POOL`` above
  the pooled ratio. The smallest ratio alone would be biased low by noise in the split of a
  stage's time among its layers (the least of several noisy ratios), and would overstate how
  much slower the other ranks are; pooling averages that noise out and still leaves a costly
  layer out. It is divided by the median over ranks, so a change
  that hits every rank alike (longer sequences, another microbatch size) goes into the layer
  costs, not into the speeds;
* a layer's cost is its measured time divided by its rank's slowdown (the mean over a replicated
  stage's ranks); a layer nobody measured keeps its profiled cost times the median slowdown.

A rank that holds one layer cannot tell the two apart: ``MeasuredModel`` takes the change as the
rank's and lists such ranks in ``ambiguous``; ``alternatives`` gives the model that takes it as
the layers' instead, so that a decision can ask a move to pay under both readings
(``planner.replan``). Without a reference taken on other ranks (the first check's own times are
the profile), no rank's speed is known at all: ``rank_reading`` is then the other reading, every
layer profiled alike, so a rank whose layers all take longer reads as a slow rank. Pure Python:
no torch import.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from pl_pipedream.planner.plan import PlanError
from pl_pipedream.profile.graph import Profile

__all__ = ["POOL", "MeasuredModel", "RankTimes", "measured_model", "rank_reading"]

POOL = 0.25  # a layer more raised than 25% above its rank's pooled ratio is left out


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
    speed 1, and ``speeds[rank]`` (1: as fast as the median rank; 0.5: twice as slow).
    ``ambiguous``: ranks of one measured layer whose speed is not 1 (their change could be the
    layer's), with ``measured`` their layers' costs as measured on them."""

    profile: Profile
    speeds: tuple[float, ...]
    ambiguous: tuple[int, ...] = ()
    measured: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def alternatives(self) -> tuple[MeasuredModel, ...]:
        """This model, and when some ranks are ambiguous the one that takes their change as
        their layers' (speed 1, the layers at their measured cost)."""
        if not self.ambiguous:
            return (self,)
        speeds = tuple(1.0 if r in self.ambiguous else s for r, s in enumerate(self.speeds))
        nodes = [
            replace(
                n, forward_ms=self.measured[n.node_id][0], backward_ms=self.measured[n.node_id][1]
            )
            if n.node_id in self.measured
            else n
            for n in self.profile.nodes
        ]
        return (self, MeasuredModel(self.profile.with_nodes(nodes), speeds))

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
    ambiguous = tuple(
        m.rank
        for m in sorted(measurements, key=lambda m: m.rank)
        if speeds[m.rank] != 1.0 and len(_measured_layers(profile, m)) == 1
    )
    measured = {
        n: (m.forward_ms.get(n, 0.0), m.backward_ms.get(n, 0.0))
        for m in measurements
        if m.rank in ambiguous
        for n in _measured_layers(profile, m)
    }
    return MeasuredModel(profile.with_nodes(nodes), speeds, ambiguous, measured)


def rank_reading(
    profile: Profile, measurements: Sequence[RankTimes], workers: int
) -> MeasuredModel:
    """The reading that takes the ranks' differences as their speeds: ``measured_model`` against
    ``profile`` with every layer of some cost at one cost (1 ms forward, 1 ms backward), so a
    rank's speed is its layers' pooled time against the median rank's (a layer raised alone is
    still a costly layer) and every layer costs its time measured on a rank of speed 1."""
    alike = [
        replace(n, forward_ms=1.0, backward_ms=1.0) if n.compute_ms > 0 else n
        for n in profile.nodes
    ]
    return measured_model(profile.with_nodes(alike), measurements, workers)


def _measured_layers(profile: Profile, times: RankTimes) -> list[str]:
    """The rank's layers with a profiled and a measured time."""
    names = sorted(set(times.forward_ms) | set(times.backward_ms))
    return [n for n in names if profile.node(n).compute_ms > 0 and times.compute_ms(n) > 0]


def _slowdown(profile: Profile, times: RankTimes) -> float | None:
    """The pooled measured / profiled ratio of the rank's layers less raised than ``POOL`` above
    it: start from all of them and leave out the more raised until none is (None: nothing to go
    by)."""
    layers = _measured_layers(profile, times)
    if not layers:
        return None
    ratios = {n: times.compute_ms(n) / profile.node(n).compute_ms for n in layers}
    pooled = layers
    while True:
        measured = math.fsum(times.compute_ms(n) for n in pooled)
        ratio = measured / math.fsum(profile.node(n).compute_ms for n in pooled)
        kept = [n for n in pooled if ratios[n] <= ratio * (1.0 + POOL)]
        if kept == pooled:
            return ratio
        pooled = kept
