"""The speed-aware DP (planner/speeds.py): brute force on small chains, equal speeds as PipeDream's
cost model, a slow rank given fewer layers, and ``plan_time`` agreeing with the DP."""

from __future__ import annotations

import itertools
import math

import pytest

from pl_pipedream.planner import Plan, PlanError, Topology, plan
from pl_pipedream.planner.speeds import plan_time, plan_with_speeds, span_bandwidth
from pl_pipedream.profile.graph import Profile

BANDWIDTH = 1e12  # transfers and all-reduce cost next to nothing: compute decides


def chain(costs: list[float], params: float = 0.0) -> Profile:
    return Profile.chain(costs, [2 * c for c in costs], [1.0] * len(costs), [params] * len(costs))


def brute_force(profile: Profile, speeds: list[float]) -> float:
    """Every straight split of the chain into consecutive stages, one per rank in order."""
    layers = [n.compute_ms / 1000 for n in profile.nodes]
    workers = len(speeds)
    best = math.inf
    for cuts in itertools.combinations(range(1, len(layers)), workers - 1):
        bounds = (0, *cuts, len(layers))
        times = [
            sum(layers[a:b]) / speeds[s] for s, (a, b) in enumerate(itertools.pairwise(bounds))
        ]
        best = min(best, max(times))
    return best


@pytest.mark.parametrize("speeds", [[1, 1, 1], [1, 0.5, 1], [0.25, 1, 1], [1, 1, 0.4]])
def test_a_straight_pipeline_matches_brute_force_on_every_speed(speeds: list[float]) -> None:
    profile = chain([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0])
    topology = Topology.flat(3, BANDWIDTH)
    result = plan_with_speeds(profile, topology, speeds, straight=True)
    assert result.slowest_stage_time == pytest.approx(brute_force(profile, speeds), rel=1e-6)


def brute_force_replicated(profile: Profile, speeds: list[float]) -> float:
    """Every split into consecutive stages on consecutive ranks, any replica counts: a stage
    takes its compute over its replicas at its slowest replica's speed."""
    layers = [n.compute_ms / 1000 for n in profile.nodes]
    workers = len(speeds)
    best = math.inf
    for stages in range(1, min(len(layers), workers) + 1):
        for cuts in itertools.combinations(range(1, len(layers)), stages - 1):
            for splits in itertools.combinations(range(1, workers), stages - 1):
                bounds = list(itertools.pairwise((0, *cuts, len(layers))))
                ranks = list(itertools.pairwise((0, *splits, workers)))
                times = [
                    sum(layers[a:b]) / ((d - c) * min(speeds[c:d]))
                    for (a, b), (c, d) in zip(bounds, ranks, strict=True)
                ]
                best = min(best, max(times))
    return best


@pytest.mark.parametrize("speeds", [[1, 1, 1, 1], [1, 0.5, 1, 1], [0.3, 1, 1, 0.8]])
def test_replicated_stages_match_brute_force_on_every_speed(speeds: list[float]) -> None:
    profile = chain([3.0, 1.0, 4.0, 1.0, 5.0, 9.0])
    topology = Topology.flat(4, BANDWIDTH)
    result = plan_with_speeds(profile, topology, speeds)
    expected = brute_force_replicated(profile, speeds)
    assert result.slowest_stage_time == pytest.approx(expected, rel=1e-6)


def test_a_slow_rank_gets_fewer_layers() -> None:
    profile = chain([1.0] * 12)
    topology = Topology.flat(3, BANDWIDTH)
    equal = plan_with_speeds(profile, topology, [1, 1, 1], straight=True)
    slowed = plan_with_speeds(profile, topology, [1, 0.5, 1], straight=True)
    assert [len(s.nodes) for s in equal.stages] == [4, 4, 4]
    assert [len(s.nodes) for s in slowed.stages] == [5, 2, 5]


def test_a_replicated_stage_goes_at_its_slowest_replicas_pace() -> None:
    profile = chain([1.0])
    topology = Topology.flat(2, BANDWIDTH)
    one = Plan.from_balance([1], ["layer0"], [2])
    assert plan_time(one, profile, topology, [1, 0.5]) == pytest.approx(2 * 0.003 / 2)


@pytest.mark.parametrize("speeds", [[1.0] * 4, [1, 1, 0.5, 1]])
def test_plan_time_prices_the_dp_answer_as_the_dp_did(speeds: list[float]) -> None:
    profile = Profile.chain(
        [2.0, 1.0, 3.0, 1.0, 2.0, 4.0], [4.0, 2.0, 6.0, 2.0, 4.0, 8.0], [1e6] * 6, [1e6] * 6
    )
    topology = Topology.from_lists([2, 2], [1e10, 1e9])
    result = plan_with_speeds(profile, topology, speeds)
    assert plan_time(result, profile, topology, speeds) == pytest.approx(
        result.slowest_stage_time, rel=1e-12
    )


def test_with_equal_speeds_it_is_no_slower_than_pipedreams_plan_on_its_own_terms() -> None:
    profile = chain([3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0], params=1e6)
    topology = Topology.flat(4, 1e9)
    ours = plan_with_speeds(profile, topology, [1.0] * 4)
    theirs = plan(profile, topology)
    assert ours.slowest_stage_time <= plan_time(theirs, profile, topology) * (1 + 1e-9)


def test_memory_rules_out_a_stage_that_does_not_fit() -> None:
    profile = Profile.chain([1.0] * 4, [1.0] * 4, [1.0] * 4, [100.0, 100.0, 100.0, 100.0])
    topology = Topology.flat(2, BANDWIDTH)
    with pytest.raises(PlanError, match="no pipeline fits"):
        plan_with_speeds(profile, topology, [1, 1], straight=True, memory=50.0)


def test_the_bandwidth_joining_ranks_is_their_innermost_common_level() -> None:
    topology = Topology.from_lists([4, 4], [10.0, 1.0])
    assert span_bandwidth(topology, (0, 3)) == 10.0
    assert span_bandwidth(topology, (3, 4)) == 1.0
    assert span_bandwidth(topology, (5,)) == 10.0


def test_one_speed_per_worker_is_required() -> None:
    with pytest.raises(PlanError, match="one positive speed per worker"):
        plan_with_speeds(chain([1.0, 1.0]), Topology.flat(2, 1.0), [1.0])
