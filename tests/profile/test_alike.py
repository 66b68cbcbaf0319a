"""Identical layers get equal costs, so profiling noise cannot flip the plan."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from torch import nn

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile import measure
from pl_pipedream.profile.alike import equalise
from pl_pipedream.profile.graph import Profile, ProfileError


def _chain(forward: list[float], backward: list[float]) -> Profile:
    count = len(forward)
    return Profile.chain(forward, backward, [8.0] * count, [4.0] * count)


def test_layers_of_one_key_get_their_mean_times() -> None:
    profile = _chain([1.0, 2.0, 1.1, 0.9], [2.0, 4.0, 2.2, 1.8])
    equal = equalise(profile, ["a", "b", "a", "a"])
    assert [node.forward_ms for node in equal.nodes] == pytest.approx([1.0, 2.0, 1.0, 1.0])
    assert [node.backward_ms for node in equal.nodes] == pytest.approx([2.0, 4.0, 2.0, 2.0])
    assert equal.nodes[0].forward_ms == equal.nodes[2].forward_ms == equal.nodes[3].forward_ms
    assert equal.nodes[1] == profile.nodes[1]


def test_the_mean_does_not_depend_on_the_order_of_the_layers() -> None:
    times = [0.1, 0.11, 0.12000000000000001, 0.13]
    one = equalise(_chain(times, times), ["a"] * 4)
    other = equalise(_chain(times[::-1], times[::-1]), ["a"] * 4)
    assert one.nodes[0].forward_ms == other.nodes[0].forward_ms


def test_a_group_that_differs_by_more_than_noise_is_left_as_measured() -> None:
    profile = _chain([1.0, 3.0], [1.0, 3.0])
    assert equalise(profile, ["a", "a"]) == profile
    tiny = _chain([0.001, 0.04], [0.0, 0.0])  # far apart, but both below the floor
    assert equalise(tiny, ["a", "a"]).nodes[0].forward_ms == pytest.approx(0.0205)


def test_one_key_per_node() -> None:
    with pytest.raises(ProfileError, match=r"nodes: 2, keys: 1\)"):
        equalise(_chain([1.0, 1.0], [1.0, 1.0]), ["a"])


def _noisy(monkeypatch: pytest.MonkeyPatch, seed: int) -> None:
    """Replace every measured time by a fixed cost per layer kind times 1 +- 5% noise."""
    rng = random.Random(seed)
    run_once = measure._run_once

    def noisy_run(module: nn.Module, value: Any, device: torch.device) -> tuple[float, float, Any]:
        _, _, output = run_once(module, value, device)
        return rng.uniform(0.95, 1.05), 2.0 * rng.uniform(0.95, 1.05), output

    monkeypatch.setattr(measure, "_run_once", noisy_run)


def test_the_same_model_profiled_with_different_noise_gives_the_same_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three identical layers on two workers: 0 | 12 and 01 | 2 are equal plans, and which one
    the noise makes faster must not decide. Every profile gives the earliest cut."""
    torch.manual_seed(0)
    layers = nn.Sequential(*(nn.Linear(16, 16) for _ in range(3)))
    sample = torch.randn(4, 16, requires_grad=True)  # every Linear sees an input with a gradient
    plans = set()
    for seed in range(8):
        _noisy(monkeypatch, seed)
        profile = measure.profile_layers(layers, sample, warmup=1, repeats=3)
        result = plan(profile, Topology.flat(2, 1e9), straight=True)
        plans.add(tuple(stage.nodes for stage in result.stages))
    assert plans == {(("layer0",), ("layer1", "layer2"))}
