"""Measured times to a cost model (planner/measured.py): a slow rank is told apart from a costly
layer, and a change on every rank goes into the layer costs."""

from __future__ import annotations

import pytest

from pl_pipedream.planner import PlanError
from pl_pipedream.planner.measured import RankTimes, measured_model
from pl_pipedream.profile.graph import Profile

PROFILE = Profile.chain([1.0] * 6, [2.0] * 6, [1.0] * 6, [0.0] * 6)
LAYERS = {0: ["layer0", "layer1"], 1: ["layer2", "layer3"], 2: ["layer4", "layer5"]}


def times(scale: dict[int, float], layer: dict[str, float] | None = None) -> list[RankTimes]:
    """Each rank's layers at the profile's cost, times the rank's and the layer's factors."""
    layer = layer or {}
    return [
        RankTimes(
            rank,
            {n: 1.0 * scale.get(rank, 1) * layer.get(n, 1) for n in nodes},
            {n: 2.0 * scale.get(rank, 1) * layer.get(n, 1) for n in nodes},
        )
        for rank, nodes in LAYERS.items()
    ]


def test_a_slow_rank_gets_a_low_speed_and_its_layers_keep_their_cost() -> None:
    model = measured_model(PROFILE, times({1: 2.0}), 3)
    assert model.speeds == (1.0, 0.5, 1.0)
    assert model.slowest == 1
    assert [n.forward_ms for n in model.profile.nodes] == [1.0] * 6


def test_a_costly_layer_keeps_its_rank_at_full_speed() -> None:
    model = measured_model(PROFILE, times({}, {"layer3": 3.0}), 3)
    assert model.speeds == (1.0, 1.0, 1.0)
    assert model.profile.node("layer3").compute_ms == pytest.approx(9.0)
    assert model.profile.node("layer2").compute_ms == pytest.approx(3.0)


def test_a_change_on_every_rank_goes_into_the_layer_costs() -> None:
    model = measured_model(PROFILE, times({0: 1.5, 1: 1.5, 2: 1.5}), 3)
    assert model.speeds == (1.0, 1.0, 1.0)
    assert model.profile.node("layer0").forward_ms == pytest.approx(1.5)


def test_every_rank_must_report() -> None:
    with pytest.raises(PlanError, match="every rank must report"):
        measured_model(PROFILE, times({})[:2], 3)


def test_noise_in_the_split_among_layers_does_not_overstate_a_slow_rank() -> None:
    """A stage's time is split among its layers with some noise; the rank's slowdown pools its
    least raised layers instead of taking the least of the noisy ratios."""
    profile = Profile.chain([1.0] * 8, [2.0] * 8, [1.0] * 8, [0.0] * 8)
    split = [0.85, 1.1, 1.05, 1.0]  # rank 0 at its old speed, its stage time split unevenly
    fast = {f"layer{i}": 3.0 * split[i] for i in range(4)}
    slow = {f"layer{i}": 9.0 for i in range(4, 8)}  # rank 1: 3x slower, split evenly
    measured = [
        RankTimes(0, {n: t / 3 for n, t in fast.items()}, {n: 2 * t / 3 for n, t in fast.items()}),
        RankTimes(1, {n: t / 3 for n, t in slow.items()}, {n: 2 * t / 3 for n, t in slow.items()}),
    ]
    model = measured_model(profile, measured, 2)
    assert model.speeds[0] / model.speeds[1] == pytest.approx(3.0, rel=0.02)
    even = [measured[0], RankTimes(1, {n: 1.0 for n in slow}, {n: 2.0 for n in slow})]
    assert measured_model(profile, even, 2).speeds == pytest.approx((1.0, 1.0), rel=0.02)
