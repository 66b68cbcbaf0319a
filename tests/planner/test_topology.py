"""Topologies: levels innermost first, worker counts multiply, errors that name the bad value."""

from __future__ import annotations

import math

import pytest

from pl_pipedream.planner.topology import Level, Topology, TopologyError


def test_levels_multiply_into_the_cluster() -> None:
    topology = Topology.from_lists([4, 2, 3], [1.2e10, 1.25e9, 1e8])
    assert topology.levels == (Level(4, 1.2e10), Level(2, 1.25e9), Level(3, 1e8))
    assert topology.num_workers == 24
    assert Topology.flat(5, 1e9) == Topology((Level(5, 1e9),))
    assert Topology.flat(5, 1e9).num_workers == 5


def test_from_lists_converts_numbers_from_a_config() -> None:
    """Hydra gives the lists from YAML (``workers: [4, 4]``, ``bandwidths: [1.2e10, ...]``)."""
    topology = Topology.from_lists([4.0, "2"], ["1.2e10", 1])  # type: ignore[list-item]
    assert topology.levels == (Level(4, 1.2e10), Level(2, 1.0))
    assert all(type(level.workers) is int for level in topology.levels)
    assert all(type(level.bandwidth) is float for level in topology.levels)


def test_dict_round_trip() -> None:
    topology = Topology.from_lists([8, 2], [1.5e11, 3.125e9])
    data = topology.to_dict()
    assert data == {"workers": [8, 2], "bandwidths": [1.5e11, 3.125e9]}
    assert Topology.from_dict(data) == topology
    assert Topology.from_dict({"workers": [8.0, 2.0], "bandwidths": [1.5e11, 3.125e9]}) == topology


@pytest.mark.parametrize("workers", [0, -3])
def test_a_level_needs_a_positive_worker_count(workers: int) -> None:
    with pytest.raises(TopologyError, match=rf"at least one worker \(workers: {workers}\)"):
        Level(workers, 1e9)
    with pytest.raises(TopologyError, match=rf"workers: {workers}\)"):
        Topology.from_lists([4, workers], [1e10, 1e9])


def test_a_level_needs_an_integer_worker_count() -> None:
    with pytest.raises(TopologyError, match=r"workers: 2\.5\)"):
        Level(2.5, 1e9)  # type: ignore[arg-type]


@pytest.mark.parametrize("bandwidth", [0.0, -1.0, math.inf, math.nan])
def test_a_level_needs_a_positive_finite_bandwidth(bandwidth: float) -> None:
    with pytest.raises(TopologyError, match=rf"bandwidth: {bandwidth!r}\)") as caught:
        Level(4, bandwidth)
    assert "positive, finite" in str(caught.value)
    with pytest.raises(TopologyError, match="bandwidth"):
        Topology.from_lists([4], [bandwidth])


def test_a_topology_needs_levels_and_one_bandwidth_each() -> None:
    with pytest.raises(TopologyError, match="at least one level"):
        Topology(())
    with pytest.raises(TopologyError, match="at least one level"):
        Topology.from_lists([], [])
    with pytest.raises(
        TopologyError, match=r"one bandwidth per level \(workers: \[4, 4\], bandwidths: \[2\.5\]\)"
    ):
        Topology.from_lists([4, 4], [2.5])


def test_topology_errors_are_value_errors() -> None:
    """Callers that catch ``ValueError`` (argument parsing, Hydra) see them too."""
    with pytest.raises(ValueError):
        Topology.flat(0, 1e9)


def test_workers_fill_the_levels_innermost_first() -> None:
    from pl_pipedream.planner.topology import fill_innermost

    cluster = Topology.from_lists([4, 4], [1.2e10, 1.25e9])
    assert fill_innermost(cluster, 1) == Topology.flat(1, 1.2e10)
    assert fill_innermost(cluster, 2) == Topology.flat(2, 1.2e10)
    assert fill_innermost(cluster, 8) == Topology.from_lists([4, 2], [1.2e10, 1.25e9])
    assert fill_innermost(cluster, 16) == cluster
    # 6 workers do not fill whole servers: the part holds 8, and callers say how to fix it
    assert fill_innermost(cluster, 6).num_workers == 8
