"""The DP against brute force: every partition of a chain and every replica assignment."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _brute_force(
    profile: Profile, workers: int, bandwidth: float, straight: bool, ends_model: bool = True
) -> float:
    """Slowest-stage time minimised over all contiguous partitions and replica counts.

    Every stage but the first pays for receiving its input; a middle stage also pays for
    sending its output (the first stage's output is the second stage's input, priced there).
    """
    layers = profile.nodes
    n = len(layers)
    compute = [node.compute_ms / 1000.0 for node in layers]
    params = [node.parameter_bytes for node in layers]
    acts = [node.output_bytes for node in layers]
    best = math.inf
    for num_stages in range(1, min(n, workers) + 1):
        if straight and num_stages != workers:
            continue
        for sizes in _compositions(n, num_stages):
            replica_options = (
                [[1] * num_stages] if straight else list(_compositions(workers, num_stages))
            )
            for replicas in replica_options:
                slowest = 0.0
                start = 0
                for s, (size, r) in enumerate(zip(sizes, replicas, strict=True)):
                    end = start + size
                    c = sum(compute[start:end])
                    w = sum(params[start:end])
                    slowest = max(slowest, (c + 4 * (r - 1) * w / (r * bandwidth)) / r)
                    if s > 0:
                        slowest = max(slowest, 2 * acts[start - 1] / (bandwidth * r))
                    if 0 < s and (s < num_stages - 1 or not ends_model):
                        slowest = max(slowest, 2 * acts[end - 1] / (bandwidth * r))
                    start = end
                best = min(best, slowest)
    return best


def _random_chain(rng: random.Random, n: int) -> Profile:
    return Profile.chain(
        [rng.uniform(0.1, 10.0) for _ in range(n)],
        [rng.uniform(0.1, 20.0) for _ in range(n)],
        [rng.choice([0.0, rng.uniform(1e3, 2e7), rng.uniform(1e7, 2e8)]) for _ in range(n)],
        [rng.choice([0.0, rng.uniform(1e3, 5e7)]) for _ in range(n)],
    )


@pytest.mark.parametrize("seed", range(60))
def test_dp_equals_brute_force_on_random_chains(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 8)
    workers = rng.randint(1, 4)
    bandwidth = rng.choice([1e8, 1e9, 1e10])
    profile = _random_chain(rng, n)
    for straight in (False, True):
        if straight and workers > n:
            continue
        expected = _brute_force(profile, workers, bandwidth, straight)
        result = plan(profile, Topology.flat(workers, bandwidth), straight=straight)
        assert result.slowest_stage_time == pytest.approx(expected, rel=1e-12)
        assert result.num_workers == workers
        assert sum(len(stage.nodes) for stage in result.stages) == n


def test_plan_time_is_the_slowest_stage_of_its_own_stages() -> None:
    rng = random.Random(7)
    profile = _random_chain(rng, 8)
    bandwidth = 1e9
    result = plan(profile, Topology.flat(4, bandwidth))
    slowest = 0.0
    for s, stage in enumerate(result.stages):
        r = stage.replicas
        c = stage.compute_ms / 1000.0
        slowest = max(slowest, (c + 4 * (r - 1) * stage.parameter_bytes / (r * bandwidth)) / r)
        if s > 0:
            slowest = max(slowest, 2 * stage.input_bytes / (bandwidth * r))
        if 0 < s < result.num_stages - 1:
            slowest = max(slowest, 2 * stage.output_bytes / (bandwidth * r))
    assert result.slowest_stage_time == pytest.approx(slowest, rel=1e-12)


def _inner_best(profile: Profile, start: int, end: int, workers: int, bandwidth: float) -> float:
    sub = Profile.chain(
        [n.forward_ms for n in profile.nodes[start:end]],
        [n.backward_ms for n in profile.nodes[start:end]],
        [n.output_bytes for n in profile.nodes[start:end]],
        [n.parameter_bytes for n in profile.nodes[start:end]],
    )
    return _brute_force(
        sub, workers, bandwidth, straight=False, ends_model=end == len(profile.nodes)
    )


@pytest.mark.parametrize("seed", range(40))
def test_two_levels_equal_brute_force(seed: int) -> None:
    """Level 1 sees a whole inner component as one machine; its first stage's all-reduce is
    divided by the inner worker count (PipeDream's optimizer does so), later stages' are not.
    Inside a component, a segment that does not end the model also pays for sending its output
    from its last inner stage (when it has more than one)."""
    rng = random.Random(100 + seed)
    n = rng.randint(2, 6)
    inner, outer = rng.randint(1, 3), rng.randint(1, 3)
    fast, slow = rng.choice([1e9, 1e10]), rng.choice([1e8, 1e9])
    profile = _random_chain(rng, n)
    compute = {
        (a, b): _inner_best(profile, a, b, inner, fast)
        for a in range(n)
        for b in range(a + 1, n + 1)
    }
    params = [node.parameter_bytes for node in profile.nodes]
    acts = [node.output_bytes for node in profile.nodes]
    best = math.inf
    for num_stages in range(1, min(n, outer) + 1):
        for sizes in _compositions(n, num_stages):
            for replicas in _compositions(outer, num_stages):
                slowest, start = 0.0, 0
                for s, (size, r) in enumerate(zip(sizes, replicas, strict=True)):
                    end = start + size
                    w = sum(params[start:end])
                    allreduce = 4 * (r - 1) * w / (r * slow)
                    if s == 0:
                        allreduce /= inner
                    slowest = max(slowest, (compute[start, end] + allreduce) / r)
                    if s > 0:
                        slowest = max(slowest, 2 * acts[start - 1] / (slow * r))
                    if 0 < s < num_stages - 1:
                        slowest = max(slowest, 2 * acts[end - 1] / (slow * r))
                    start = end
                best = min(best, slowest)
    result = plan(profile, Topology.from_lists([inner, outer], [fast, slow]))
    assert result.slowest_stage_time == pytest.approx(best, rel=1e-12)
    assert result.num_workers == inner * outer
    assert sorted(r for stage in result.stages for r in stage.ranks) == list(range(inner * outer))
