"""``plan``: a chain worked out by hand, the promises of its docstring (ties, cuts, memory,
inputs and selectors), and the whole optimizer against brute force (every partition of a chain
and every replica assignment, on one level and on two)."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from pl_pipedream.planner.optimize import data_parallel_time, plan
from pl_pipedream.planner.plan import PlanError
from pl_pipedream.planner.states import StateSpaceError
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Node, Profile


def three_layers() -> Profile:
    """Layers of 1, 2 and 3 s; only the last has parameters (2.5e8 bytes); the first sends
    5e8 bytes on, the second 1e9 (see tests/planner/test_dp.py for the same chain's DP table)."""
    return Profile.chain([1000.0, 2000.0, 3000.0], [0.0, 0.0, 0.0], [5e8, 1e9, 0.0], [0, 0, 2.5e8])


def test_a_three_layer_chain_by_hand() -> None:
    """Two workers at 1e9 bytes/s. Replicating everything takes (6 + 4 x 2.5e8 / 2e9) / 2 =
    3.25 s; layers 0-1 then layer 2 take max(3, 3, 2 x 1e9 / 1e9) = 3 s; layer 0 then 1-2
    takes 5 s."""
    result = plan(three_layers(), Topology.flat(2, 1e9))
    assert result.shape == "1-1"
    assert [stage.nodes for stage in result.stages] == [("layer0", "layer1"), ("layer2",)]
    assert [stage.ranks for stage in result.stages] == [(0,), (1,)]
    assert result.slowest_stage_time == 3.0
    assert result.data_parallel_time == pytest.approx(3.25, rel=1e-15)
    assert result.single_worker_time == 6.0
    first, last = result.stages
    assert (first.forward_ms, first.parameter_bytes, first.input_bytes, first.output_bytes) == (
        3000.0,
        0.0,
        0.0,
        1e9,
    )
    assert (last.forward_ms, last.parameter_bytes, last.input_bytes, last.output_bytes) == (
        3000.0,
        2.5e8,
        1e9,
        0.0,
    )
    assert [(s.warmup, s.weight_versions) for s in result.stages] == [(1, 2), (0, 1)]
    assert result.meta == {"cuts": "antichain", "states": "3"}


def test_data_parallel_time_by_hand() -> None:
    """8 s of compute, 1e9 bytes of parameters; 4 workers at 1e10 inside a server, 2 servers at
    1e9: (8 + 4 x 3 x 1e9 / 4e10) / 4 = 2.075 s, then (2.075 + (4 x 1e9 / 2e9) / 4) / 2."""
    topology = Topology.from_lists([4, 2], [1e10, 1e9])
    assert data_parallel_time(8.0, 1e9, topology) == pytest.approx(1.2875, rel=1e-15)
    assert data_parallel_time(8.0, 1e9, Topology.flat(1, 1e9)) == 8.0


def test_a_tie_keeps_the_single_stage() -> None:
    """Two 1 s layers on two workers: 0 | 1 and both layers replicated both take 1 s."""
    result = plan(Profile.chain([1000.0, 1000.0], [0, 0], [0, 0], [0, 0]), Topology.flat(2, 1e9))
    assert result.shape == "2"
    assert result.slowest_stage_time == 1.0


def test_a_tie_between_cuts_takes_the_earliest() -> None:
    """Layers of 1, 0 and 1 s with parameters too large to replicate: 0 | 12 and 01 | 2 tie."""
    profile = Profile.chain([1000.0, 0.0, 1000.0], [0, 0, 0], [0, 0, 0], [1e12] * 3)
    result = plan(profile, Topology.flat(2, 1e9))
    assert [stage.nodes for stage in result.stages] == [("layer0",), ("layer1", "layer2")]
    assert result.slowest_stage_time == 1.0


@pytest.mark.parametrize("noise", [0.0, 1e-12, -1e-12, 3e-10])
def test_a_near_tie_between_cuts_takes_the_earliest(noise: float) -> None:
    """Three equal 1 s layers on two straight workers: 0 | 12 and 01 | 2 both take 2 s. A
    difference far below any measurement (a relative 1e-12 to 3e-10, as sums of equal layers
    taken in another order leave) between the first and the last layer does not decide."""
    profile = Profile.chain([1000.0, 1000.0, 1000.0 * (1 + noise)], [0] * 3, [0] * 3, [0] * 3)
    result = plan(profile, Topology.flat(2, 1e9), straight=True)
    assert [stage.nodes for stage in result.stages] == [("layer0",), ("layer1", "layer2")]


def test_straight_with_more_workers_than_layers_cannot_fit() -> None:
    """More workers cannot help: the error says so and names the fix (not 'more workers')."""
    with pytest.raises(PlanError) as caught:
        plan(three_layers(), Topology.flat(4, 1e9), straight=True)
    message = str(caught.value)
    assert "at most 3 stages for 3 layers" in message
    assert "workers: 4" in message and "use fewer devices or more microbatches" in message
    assert "more workers" not in message
    assert plan(three_layers(), Topology.flat(4, 1e9)).num_workers == 4


def test_more_workers_than_layers_with_one_microbatch_names_the_fixes() -> None:
    """3 layers on 4 workers with 1 microbatch per batch (no replication): the error says how
    many devices a plan can use and which fixes work, never 'more workers'."""
    with pytest.raises(PlanError) as caught:
        plan(three_layers(), Topology.flat(4, 1e9), microbatches=1)
    message = str(caught.value)
    assert message.startswith("more devices than a plan can use")
    assert "(workers: 4, layers: 3, microbatches: 1, so at most 3 devices)" in message
    assert "use at most 3 devices, 2 or more microbatches per batch" in message
    assert "more workers" not in message
    assert plan(three_layers(), Topology.flat(4, 1e9), microbatches=2).num_workers == 4


@pytest.mark.parametrize("memory", [0.0, -1.0])
def test_memory_must_be_positive(memory: float) -> None:
    with pytest.raises(PlanError, match=rf"must be positive \(memory: {memory}\)"):
        plan(three_layers(), Topology.flat(2, 1e9), memory=memory)


def test_memory_by_hand() -> None:
    """Layers 0-1 on one of two workers stash 5e8 + 1e9 bytes of activations; with 1e9 bytes
    per worker the 3 s plan is out and replication (3.25 s, no stash) wins."""
    result = plan(three_layers(), Topology.flat(2, 1e9), memory=1e9)
    assert result.shape == "2"
    assert result.slowest_stage_time == pytest.approx(3.25, rel=1e-15)
    # 1-1 needs the first stage's stash (1.5e9) and its frames: the 1e9-byte output of layer 1,
    # two minibatches in flight, plus the receive posted for its gradient (3e9)
    assert plan(three_layers(), Topology.flat(2, 1e9), memory=4.5e9).shape == "1-1"


def test_the_frames_of_messages_in_flight_change_the_answer() -> None:
    """With room for the stash (1.5e9) but not for the frames in flight (3e9 more), the
    pipeline that fits without frames is refused and replication wins."""
    result = plan(three_layers(), Topology.flat(2, 1e9), memory=4.4e9)
    assert result.shape == "2"


def _node(node_id: str, desc: str = "Linear", forward_ms: float = 1000.0) -> Node:
    return Node(node_id, desc, forward_ms, 0.0, (0.0,), 0.0)


def test_inputs_go_first_and_unused_selectors_stay_with_their_producer() -> None:
    profile = Profile(
        (_node("in", "Input0", 0.0), _node("a"), _node("a1", "__getitem__(1)", 0.0), _node("b")),
        (("in", "a"), ("a", "a1"), ("a", "b")),
    )
    result = plan(profile, Topology.flat(2, 1e9), straight=True)
    assert [stage.nodes for stage in result.stages] == [("in", "a", "a1"), ("b",)]


def diamond() -> Profile:
    return Profile(
        (_node("a"), _node("b"), _node("c"), _node("d")),
        (("a", "b"), ("a", "c"), ("b", "d"), ("c", "d")),
    )


def test_auto_cuts_fall_back_to_topological_prefixes() -> None:
    """The diamond has 5 antichain states, 4 topological ones."""
    topology = Topology.flat(2, 1e9)
    assert plan(diamond(), topology).meta == {"cuts": "antichain", "states": "5"}
    assert plan(diamond(), topology, max_states=4).meta == {"cuts": "topological", "states": "4"}
    assert plan(diamond(), topology, cuts="topological").meta["cuts"] == "topological"
    with pytest.raises(StateSpaceError, match="more than 4"):
        plan(diamond(), topology, max_states=4, cuts="antichain")


# ----- against brute force ----------------------------------------------------------------------


def _compositions(total: int, parts: int):
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield [bounds[i + 1] - bounds[i] for i in range(parts)]


def _brute_force(
    profile: Profile,
    workers: int,
    bandwidth: float,
    straight: bool,
    ends_model: bool = True,
    microbatches: int | None = None,
) -> float:
    """Slowest-stage time minimised over all contiguous partitions and replica counts (only
    counts that divide ``microbatches`` when it is given).

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
                if microbatches is not None and any(microbatches % r for r in replicas):
                    continue
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


# ----- replica counts that divide the microbatches ------------------------------------------------


@pytest.mark.parametrize("seed", range(40))
def test_with_microbatches_the_plan_is_the_best_admissible_one(seed: int) -> None:
    """Against brute force over the plans whose replica counts divide the microbatches."""
    rng = random.Random(500 + seed)
    n, workers, microbatches = rng.randint(1, 7), rng.randint(2, 5), rng.randint(1, 6)
    bandwidth = rng.choice([1e8, 1e9, 1e10])
    profile = _random_chain(rng, n)
    expected = _brute_force(profile, workers, bandwidth, False, microbatches=microbatches)
    topology = Topology.flat(workers, bandwidth)
    if math.isinf(expected):
        with pytest.raises(PlanError, match="more microbatches"):
            plan(profile, topology, microbatches=microbatches)
        return
    result = plan(profile, topology, microbatches=microbatches)
    assert all(microbatches % stage.replicas == 0 for stage in result.stages)
    assert result.slowest_stage_time == pytest.approx(expected, rel=1e-12)
    assert result.num_workers == workers


def six_equal_layers() -> Profile:
    return Profile.chain([10.0] * 6, [20.0] * 6, [1e6] * 6, [4e6] * 6)


def test_replicas_that_do_not_divide_are_not_a_fall_back_to_a_straight_pipeline() -> None:
    """Four workers, three microbatches: the best plan (2-2) is not admitted, and the best
    admitted one (1-3) beats the straight pipeline (the old fall back); it says it is slower
    than data parallelism and that four microbatches admit 2-2."""
    topology = Topology.flat(4, 1e10)
    free = plan(six_equal_layers(), topology)
    straight = plan(six_equal_layers(), topology, straight=True)
    chosen = plan(six_equal_layers(), topology, microbatches=3)
    assert free.shape == "2-2" and straight.shape == "1-1-1-1"
    assert chosen.shape == "1-3"
    assert chosen.slowest_stage_time < straight.slowest_stage_time
    assert chosen.speedup_over_data_parallel == pytest.approx(0.904, abs=1e-3)
    assert "microbatches=4 admits the 2-2 plan" in chosen.meta["advice"]
    assert "slower than DP" in chosen.render()
    assert plan(six_equal_layers(), topology, microbatches=4).shape == "2-2"
    assert "advice" not in plan(six_equal_layers(), topology, microbatches=4).meta


@pytest.mark.parametrize("seed", range(20))
def test_two_levels_admit_only_dividing_products(seed: int) -> None:
    rng = random.Random(900 + seed)
    n, microbatches = rng.randint(2, 6), rng.randint(1, 6)
    topology = Topology.from_lists([rng.randint(1, 3), rng.randint(2, 3)], [1e10, 1e9])
    profile = _random_chain(rng, n)
    free = plan(profile, topology)
    try:
        result = plan(profile, topology, microbatches=microbatches)
    except PlanError as error:
        assert "microbatches" in str(error)
        return
    assert all(microbatches % stage.replicas == 0 for stage in result.stages)
    assert result.slowest_stage_time >= free.slowest_stage_time * (1 - 1e-12)
    if all(microbatches % stage.replicas == 0 for stage in free.stages):
        assert result.slowest_stage_time == pytest.approx(free.slowest_stage_time, rel=1e-12)


def test_microbatches_must_be_a_positive_integer() -> None:
    with pytest.raises(PlanError, match=r"microbatches: 0\)"):
        plan(three_layers(), Topology.flat(2, 1e9), microbatches=0)
