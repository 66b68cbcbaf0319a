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
