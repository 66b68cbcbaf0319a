"""A rank's layer times from its timeline (core/stage_clock.py): the window's means split among
the stage's layers by the profile or by the layers' own forward times."""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

from pl_pipedream.core import stage_clock
from pl_pipedream.core.stage_clock import LayerClock, gather_rank_times, rank_times
from pl_pipedream.planner.measured import RankTimes
from pl_pipedream.profile.graph import Profile
from pl_pipedream.runtime.timeline import TimelineEvent
from tests.runtime.distributed import one_rank_group

PROFILE = Profile.chain([1.0, 3.0], [2.0, 6.0], [1.0, 1.0], [0.0, 0.0])
NODES = ["layer0", "layer1"]


def events(forward_s: list[float], backward_s: list[float], rank: int = 0) -> list[TimelineEvent]:
    out, clock = [], 0.0
    for i, (f, b) in enumerate(zip(forward_s, backward_s, strict=True)):
        out.append(TimelineEvent(rank, f"0F{i}", "FORWARD", clock, clock + f))
        clock += f
        out.append(TimelineEvent(rank, f"0B{i}", "BACKWARD", clock, clock + b))
        clock += b
        out.append(TimelineEvent(rank, "0S", "STEP", clock, clock + 1.0))
        clock += 1.0
    return out


def test_the_last_window_is_averaged_and_split_by_the_profile() -> None:
    timeline = events([1.0, 0.004, 0.004], [1.0, 0.008, 0.008])
    times = rank_times(timeline, NODES, PROFILE, rank=0, window=2)
    assert times.forward_ms == pytest.approx({"layer0": 1.0, "layer1": 3.0})
    assert times.backward_ms == pytest.approx({"layer0": 2.0, "layer1": 6.0})


def test_measured_forward_shares_show_a_layer_that_became_costly() -> None:
    timeline = events([0.010], [0.020])
    shares = {"layer0": 0.7, "layer1": 0.3}  # layer0 now takes 7 of 10 ms of forward
    times = rank_times(timeline, NODES, PROFILE, rank=0, window=5, forward_shares=shares)
    assert times.forward_ms == pytest.approx({"layer0": 7.0, "layer1": 3.0})
    # Backward follows each layer's forward ratio to the profile: 7x and 1x.
    assert times.backward_ms["layer0"] / times.backward_ms["layer1"] == pytest.approx(14.0 / 6.0)


def test_other_ranks_events_are_ignored() -> None:
    timeline = events([0.004], [0.008], rank=0) + events([1.0], [1.0], rank=1)
    times = rank_times(timeline, NODES, PROFILE, rank=0, window=10)
    assert sum(times.forward_ms.values()) == pytest.approx(4.0)


def test_the_layer_clock_times_each_layer_forward() -> None:
    class Slow(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            time.sleep(0.02)
            return x

    layers = {"fast": nn.Identity(), "slow": Slow()}
    clock = LayerClock(layers)
    x = torch.zeros(1)
    for layer in layers.values():
        layer(x)
    assert clock.shares()["slow"] > 0.9
    clock.reset()
    assert clock.shares() == {}
    clock.remove()
    layers["slow"](x)
    assert clock.shares() == {}


def test_every_ranks_times_are_gathered() -> None:
    mine = RankTimes(0, {"layer0": 1.0}, {"layer0": 2.0}, steps=3)
    with one_rank_group():
        assert gather_rank_times(mine) == [mine]


def test_an_action_slowed_by_losing_the_core_does_not_count() -> None:
    timeline = events([0.004, 0.004, 0.400], [0.008, 0.008, 0.008])
    times = rank_times(timeline, NODES, PROFILE, rank=0, window=3)
    assert sum(times.forward_ms.values()) == pytest.approx(4.0)  # the median, not 136 ms


def test_a_layer_call_slowed_by_losing_the_core_does_not_shift_the_shares() -> None:
    """Two layers of equal cost, one of whose five calls lost the core for 40 times its cost:
    the shares stay even, as the stage's total ignores such an action."""
    now = [0.0]

    class Tick(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.costs = [0.001] * 5

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            now[0] += self.costs.pop(0)
            return x

    layers = {"a": Tick(), "b": Tick()}
    layers["b"].costs[2] = 0.040
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(stage_clock.time, "perf_counter", lambda: now[0])
        clock = LayerClock(layers)
        for _ in range(5):
            for layer in layers.values():
                layer(torch.zeros(1))
    assert clock.shares() == pytest.approx({"a": 0.5, "b": 0.5})
    clock.remove()
