"""``plan_chunks``: a profiled chain cut into p v stages placed as the chunked modes need, the
slowest stage as fast as any cut allows (brute force), the predictions the slowest rank's total."""

from __future__ import annotations

import itertools
import math

import pytest

from pl_pipedream.planner.chunk_plan import plan_chunks
from pl_pipedream.planner.chunks import INTERLEAVED, V_SHAPE, stage_ranks
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

TIMES = [3.0, 1.0, 4.0, 1.0, 5.0, 9.0, 2.0, 6.0, 5.0, 3.0]  # forward ms; backward twice that


def profile(times: list[float] = TIMES) -> Profile:
    return Profile.chain(times, [2 * t for t in times], [1e3] * len(times), [4e3] * len(times))


def slowest_rank_of_any_cut(times: list[float], mapping: tuple[int, ...]) -> float:
    """Brute force: the least slowest rank's total over every cut into ``len(mapping)`` stages
    (stage ``s`` on rank ``mapping[s]``)."""
    best = math.inf
    for cuts in itertools.combinations(range(1, len(times)), len(mapping) - 1):
        totals = [0.0] * (max(mapping) + 1)
        for stage, (a, b) in enumerate(itertools.pairwise([0, *cuts, len(times)])):
            totals[mapping[stage]] += sum(times[a:b])
        best = min(best, max(totals))
    return best


@pytest.mark.parametrize(
    ("placement", "ranks", "chunks"),
    [(V_SHAPE, 2, 2), (V_SHAPE, 3, 2), (V_SHAPE, 4, 2), (INTERLEAVED, 2, 2), (INTERLEAVED, 2, 3)],
)
def test_a_chunked_plan_places_p_v_stages_and_its_slowest_rank_is_the_least_of_any_cut(
    placement: str, ranks: int, chunks: int
) -> None:
    plan = plan_chunks(profile(), Topology.flat(ranks, 1e12), placement, chunks)
    assert plan.placement == placement and plan.chunks_per_rank == chunks
    assert plan.num_stages == ranks * chunks and plan.num_workers == ranks
    mapping = stage_ranks(placement, ranks, chunks)
    assert tuple(stage.ranks[0] for stage in plan.stages) == mapping
    layers = [node for stage in plan.stages for node in stage.nodes]
    assert layers == [f"layer{i}" for i in range(len(TIMES))]  # every layer once, in order
    slowest = max(sum(s.compute_ms for s in plan.stages_of_rank(r)) for r in range(ranks))
    assert slowest == pytest.approx(3 * slowest_rank_of_any_cut(TIMES, mapping))
    assert plan.slowest_stage_time == pytest.approx(slowest / 1000, rel=1e-6)  # seconds
    assert Plan.from_json(plan.to_json()) == plan


def test_ranks_stay_balanced_where_the_slowest_stage_alone_would_not() -> None:
    """Cut for the slowest stage alone (no stage above 8 ms), one rank holds 22 ms of the 30
    here; refined, each rank holds its 15 ms share."""
    times = [8.0, 1.0, 8.0, 1.0, 1.0, 5.0, 1.0, 2.0, 1.0, 2.0]
    plan = plan_chunks(profile(times), Topology.flat(2, 1e12), INTERLEAVED, 3)
    totals = [sum(s.forward_ms for s in plan.stages_of_rank(r)) for r in (0, 1)]
    assert totals == [15.0, 15.0]


def test_the_stages_keep_their_profiled_times_and_bytes() -> None:
    plan = plan_chunks(profile([1.0, 2.0, 3.0, 4.0]), Topology.flat(2, 1e12), V_SHAPE)
    assert [stage.nodes for stage in plan.stages] == [(f"layer{i}",) for i in range(4)]
    assert [stage.forward_ms for stage in plan.stages] == [1.0, 2.0, 3.0, 4.0]
    assert [stage.backward_ms for stage in plan.stages] == [2.0, 4.0, 6.0, 8.0]
    assert [stage.input_bytes for stage in plan.stages] == [0.0, 1e3, 1e3, 1e3]
    assert [stage.output_bytes for stage in plan.stages] == [1e3, 1e3, 1e3, 0.0]
    assert all(s.parameter_bytes == 4e3 and s.activation_bytes == 1e3 for s in plan.stages)


def test_the_predicted_time_is_the_slowest_ranks_total() -> None:
    """Rank 0 of the V holds stages 0 and 3 (3 + 12 ms), rank 1 stages 1 and 2 (6 + 9 ms)."""
    plan = plan_chunks(profile([1.0, 2.0, 3.0, 4.0]), Topology.flat(2, 1e12), V_SHAPE)
    assert plan.slowest_stage_time == pytest.approx(0.015)
    assert plan.single_worker_time == pytest.approx(0.030)
    assert plan.data_parallel_time > plan.single_worker_time / 2  # plus the all-reduce
    assert "slowest rank" in plan.render()


def test_a_slow_link_prices_the_messages_between_ranks_only() -> None:
    """At 1 MB/s a 1 kB message takes 2 ms each way: a stage that sends or receives across
    ranks takes at least that, the turn of the V (stages 1 and 2 on rank 1) nothing."""
    layers = profile([0.1, 0.1, 0.1, 0.1])
    plan = plan_chunks(layers, Topology.flat(2, 1e6), V_SHAPE)
    assert plan.slowest_stage_time == pytest.approx(0.002 + 0.002)


def test_too_few_layers_or_a_branchy_graph_is_refused() -> None:
    with pytest.raises(PlanError, match=r"^a chunked plan needs a layer per stage \(layers: 3, "):
        plan_chunks(profile([1.0, 1.0, 1.0]), Topology.flat(2, 1e9), V_SHAPE)
    branchy = Profile(profile([1.0] * 4).nodes, (("layer0", "layer1"), ("layer0", "layer2")))
    with pytest.raises(PlanError, match=r"^a chunked plan cuts a chain of layers"):
        plan_chunks(branchy, Topology.flat(1, 1e9), INTERLEAVED)
