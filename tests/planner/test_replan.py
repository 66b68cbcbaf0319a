"""The re-plan decision (planner/replan.py): a slowed rank loses layers, a costly layer is
rebalanced, noise under the threshold and moves that do not pay keep the plan, a faster plan
that does not fit memory is skipped with a warning."""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest

from pl_pipedream.planner import PlanError, Topology
from pl_pipedream.planner.measured import MeasuredModel, RankTimes, measured_model, rank_reading
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import (
    CLEAR,
    Decision,
    confirm,
    decide,
    move_bytes,
    new_work,
)
from pl_pipedream.planner.speeds import plan_time, plan_with_speeds
from pl_pipedream.profile.graph import Profile

WORKERS = 3
TOPOLOGY = Topology.flat(WORKERS, 1e12)
PROFILE = Profile.chain([1.0] * 12, [2.0] * 12, [1.0] * 12, [1000.0] * 12)


def current() -> Plan:
    return plan_with_speeds(PROFILE, TOPOLOGY, [1.0] * WORKERS, straight=True)


def measure(
    plan: Plan, slow: dict[int, float], costly: dict[str, float], noise: float = 0.0
) -> MeasuredModel:
    rng = random.Random(0)
    jitter = lambda: 1 + rng.uniform(-noise, noise)  # noqa: E731
    out = []
    for stage in plan.stages:
        rank = stage.ranks[0]
        factor = {n: slow.get(rank, 1.0) * costly.get(n, 1.0) for n in stage.nodes}
        forward = {n: PROFILE.node(n).forward_ms * factor[n] * jitter() for n in stage.nodes}
        backward = {n: PROFILE.node(n).backward_ms * factor[n] * jitter() for n in stage.nodes}
        out.append(RankTimes(rank, forward, backward))
    return measured_model(PROFILE, out, WORKERS)


def test_a_slowed_rank_has_layers_moved_off_it() -> None:
    plan = current()
    decision = decide(plan, measure(plan, {1: 2.0}, {}), TOPOLOGY, straight=True)
    assert decision.move
    assert [len(s.nodes) for s in decision.plan.stages] == [5, 2, 5]
    assert decision.new_time < decision.current_time


def test_a_costly_layer_is_rebalanced() -> None:
    plan = current()
    decision = decide(plan, measure(plan, {}, {"layer0": 4.0}), TOPOLOGY, straight=True)
    assert decision.move
    sizes = [len(s.nodes) for s in decision.plan.stages]
    assert sizes[0] < 4 and sum(sizes) == 12


def test_noise_under_the_threshold_keeps_the_plan() -> None:
    plan = current()
    decision = decide(plan, measure(plan, {}, {}, noise=0.02), TOPOLOGY, straight=True)
    assert not decision.move
    assert decision.plan is plan


def test_a_move_that_does_not_pay_within_the_horizon_is_not_made() -> None:
    plan = current()
    model = measure(plan, {1: 2.0}, {})
    slow_link = decide(plan, model, TOPOLOGY, straight=True, horizon=1, move_bandwidth=1e3)
    assert not slow_link.move and slow_link.move_seconds > 1.0


@dataclass(frozen=True)
class MostLayers:
    """A memory rule of a few layers per stage (the rule itself is the front ends'
    ``core.memory_limit.MemoryFit``): ``best`` lowers the planner's limit until a plan fits."""

    layers: int
    memory: float = 0.0

    def fits(self, plan: Plan) -> bool:
        return max(len(s.nodes) for s in plan.stages) <= self.layers

    def best(self, make):  # type: ignore[no-untyped-def]
        for limit in (1e9, 5e3, 4e3, 3e3, 2e3):
            found = make(limit)
            if self.fits(found):
                return found
        raise PlanError("none fits")


def test_a_faster_plan_that_does_not_fit_memory_is_skipped_with_a_warning() -> None:
    plan = current()
    # Room for the plan in use (4 layers on a rank) but not for the 5 the slow rank asks.
    fit = MostLayers(4)
    assert fit.fits(plan)
    decision = decide(plan, measure(plan, {1: 2.0}, {}), TOPOLOGY, fit, straight=True)
    assert decision.warnings and "does not fit the memory" in decision.warnings[0]
    assert fit.fits(decision.plan)


def test_a_single_layer_rank_moves_only_when_the_move_pays_either_way() -> None:
    profile = Profile.chain([1.0, 1.0, 1.0], [2.0] * 3, [1.0] * 3, [0.0] * 3)
    plan = plan_with_speeds(profile, TOPOLOGY, [1.0] * WORKERS, straight=True)
    times = [
        RankTimes(
            r, {f"layer{r}": 1.0 * (3 if r == 1 else 1)}, {f"layer{r}": 2.0 * (3 if r == 1 else 1)}
        )
        for r in range(3)
    ]
    model = measured_model(profile, times, WORKERS)
    assert model.ambiguous == (1,)
    assert len(model.alternatives()) == 2
    # One layer per rank: no plan beats this one if layer1 is costly, so nothing moves.
    assert not decide(plan, model, TOPOLOGY, straight=True).move


def test_moving_sends_parameters_and_optimizer_state_to_each_new_holder() -> None:
    before = Plan.from_balance([2, 1], ["layer0", "layer1", "layer2"])
    after = Plan.from_balance([1, 2], ["layer0", "layer1", "layer2"])
    profile = Profile.chain([1.0] * 3, [1.0] * 3, [1.0] * 3, [10.0, 20.0, 30.0])
    assert move_bytes(before, after, profile, state_factor=2.0) == 20.0 * 3


def test_a_negative_threshold_is_refused() -> None:
    with pytest.raises(PlanError, match="threshold must be >= 0"):
        decide(current(), measure(current(), {}, {}), TOPOLOGY, threshold=-1.0)


def test_a_large_gain_moves_at_once_and_a_small_one_is_confirmed_by_the_next_check() -> None:
    plan = current()
    model = measure(plan, {1: 2.0}, {})
    large = decide(plan, model, TOPOLOGY, straight=True)
    assert large.gain > 1 + CLEAR * 0.05
    assert confirm(plan, large, None, 0.05) == (large, None)
    small = Decision(True, large.plan, 1.1, 1.0, 0.0)
    held, proposed = confirm(plan, small, None, 0.05)
    assert not held.move and held.plan == plan and proposed == large.plan
    assert confirm(plan, small, proposed, 0.05) == (small, None)
    keep = Decision(False, plan, 1.0, 1.0, 0.0)
    assert confirm(plan, keep, proposed, 0.05) == (keep, None)  # the proposal is forgotten


def test_a_rank_slow_from_the_start_moves_only_where_both_readings_gain() -> None:
    """4 workers, 16 equal layers, rank 0 3 ms slower per layer of 1 ms, its own times the
    reference: read as costly layers, data parallelism looks 2.3x faster, but it gives rank 0
    every layer. Weighed also with the difference read as rank 0's, the move keeps rank 0 on
    fewer layers, and is faster under both readings."""
    ids = [f"layer{i}" for i in range(16)]
    topology = Topology.flat(4, 1e9)
    plan = Plan.from_balance([4, 4, 4, 4], ids)
    times = [
        RankTimes(
            r,
            {n: (4.0 if r == 0 else 1.0) / 3 for n in plan.stage_of_rank(r).nodes},
            {n: (4.0 if r == 0 else 1.0) * 2 / 3 for n in plan.stage_of_rank(r).nodes},
        )
        for r in range(4)
    ]
    # The reference: the layers as measured, every rank taken as speed 1.
    reference = Profile.chain(
        [t.forward_ms[n] for t in times for n in t.forward_ms],
        [t.backward_ms[n] for t in times for n in t.backward_ms],
        [1024.0] * 16,
        [4096.0] * 16,
    )
    model = measured_model(reference, times, 4)
    by_rank = rank_reading(reference, times, 4)
    assert model.speeds == (1.0, 1.0, 1.0, 1.0)
    assert by_rank.speeds == pytest.approx((0.25, 1.0, 1.0, 1.0))
    alone = decide(plan, model, topology, microbatches=4)
    assert alone.move and alone.plan.shape == "4"  # every layer on rank 0 too
    both = decide(plan, model, topology, microbatches=4, readings=(by_rank,))
    assert both.move and len(both.plan.stage_of_rank(0).nodes) < 4
    for reading in (model, by_rank):
        before = plan_time(plan, reading.profile, topology, reading.speeds)
        assert plan_time(both.plan, reading.profile, topology, reading.speeds) < before
    assert plan_time(alone.plan, by_rank.profile, topology, by_rank.speeds) > plan_time(
        plan, by_rank.profile, topology, by_rank.speeds
    )


def test_work_new_to_a_rank_is_a_layer_it_does_not_hold_or_a_larger_share() -> None:
    ids = ["0", "1", "2", "3"]
    before = Plan.from_balance([2, 2], ids)
    assert new_work(before, Plan.from_balance([1, 3], ids), [0, 1]) == (1,)
    assert new_work(before, Plan.from_balance([4], ids, replicas=[2]), [0, 1]) == (0, 1)
    assert new_work(Plan.from_balance([4], ids, replicas=[2]), before, [0, 1]) == (0, 1)
    assert new_work(before, before, [0, 1]) == ()


def test_a_large_gain_waits_a_check_when_it_may_not_move_at_once() -> None:
    plan = current()
    large = decide(plan, measure(plan, {1: 2.0}, {}), TOPOLOGY, straight=True)
    assert large.gain > 1 + CLEAR * 0.05
    held, proposed = confirm(plan, large, None, 0.05, at_once=False)
    assert not held.move and proposed == large.plan
    assert confirm(plan, large, proposed, 0.05, at_once=False) == (large, None)
