"""Cluster topologies: levels of workers joined by links of a given bandwidth.

PipeDream's hierarchical optimizer (SOSP'19, section 3.1) sees a cluster as levels listed
innermost first: level 0 is the workers inside one server, level 1 the servers of a rack, and so
on. Each level has a number of components from the level below and the bandwidth (bytes/s) of the
links that join them.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["Level", "Topology", "TopologyError", "fill_innermost"]


class TopologyError(ValueError):
    """A topology that cannot describe a cluster."""


@dataclass(frozen=True)
class Level:
    """``workers`` components of the level below, joined by links of ``bandwidth`` bytes/s."""

    workers: int
    bandwidth: float

    def __post_init__(self) -> None:
        if not isinstance(self.workers, int) or self.workers < 1:
            raise TopologyError(
                f"a level needs at least one worker (workers: {self.workers!r}); "
                "pass a positive integer"
            )
        if not self.bandwidth > 0 or math.isinf(self.bandwidth):
            raise TopologyError(
                f"a level's bandwidth must be a positive, finite number of bytes/s "
                f"(bandwidth: {self.bandwidth!r}); for example 1.25e9 for 10 Gbps"
            )


@dataclass(frozen=True)
class Topology:
    """Levels innermost first; the cluster has the product of their worker counts."""

    levels: tuple[Level, ...]

    def __post_init__(self) -> None:
        if not self.levels:
            raise TopologyError("a topology needs at least one level (levels: ()); add one")

    @classmethod
    def from_lists(cls, workers: Sequence[int], bandwidths: Sequence[float]) -> Topology:
        if len(workers) != len(bandwidths):
            raise TopologyError(
                "a topology needs one bandwidth per level (workers: "
                f"{list(workers)}, bandwidths: {list(bandwidths)}); give as many of each"
            )
        return cls(tuple(Level(int(w), float(b)) for w, b in zip(workers, bandwidths, strict=True)))

    @classmethod
    def flat(cls, workers: int, bandwidth: float) -> Topology:
        return cls((Level(workers, bandwidth),))

    @property
    def num_workers(self) -> int:
        return math.prod(level.workers for level in self.levels)

    def to_dict(self) -> dict[str, list[float]]:
        return {
            "workers": [level.workers for level in self.levels],
            "bandwidths": [level.bandwidth for level in self.levels],
        }

    @classmethod
    def from_dict(cls, data: dict[str, list[float]]) -> Topology:
        return cls.from_lists([int(w) for w in data["workers"]], data["bandwidths"])


def fill_innermost(topology: Topology, devices: int) -> Topology:
    """The part of ``topology`` that ``devices`` workers occupy, filled innermost first: each
    level keeps as many of its components as the workers need, so 2 workers on servers of 4 are
    2 workers of one server, 8 are 2 full servers. Workers that do not fill whole components
    (6 on servers of 4) get a part with more workers than ``devices``: callers compare
    ``num_workers`` and say how to fix it. One worker (or none) is a flat level of one at the
    innermost bandwidth."""
    if devices <= 1:
        return Topology.flat(1, topology.levels[0].bandwidth)
    levels = []
    occupied = 1
    for level in topology.levels:
        if occupied >= devices:
            break
        count = min(level.workers, math.ceil(devices / occupied))
        levels.append(Level(count, level.bandwidth))
        occupied *= count
    return Topology(tuple(levels))
