"""benchmarks/replan_sim.py: on a small chain, re-planning beats the first plan when a rank
slows, stays near the best static plan, and keeps the plan when nothing changes."""

from __future__ import annotations

import pytest
import replan_sim

from pl_pipedream.planner import Topology
from pl_pipedream.planner.speeds import plan_with_speeds
from pl_pipedream.profile.graph import Profile

PROFILE = Profile.chain([1.0] * 12, [2.0] * 12, [1.0] * 12, [100.0] * 12)
TOPOLOGY = Topology.flat(3, 1e9)
FIRST = plan_with_speeds(PROFILE, TOPOLOGY, [1.0] * 3, cuts="topological")


def test_a_slowed_rank_is_followed_and_the_move_paid() -> None:
    world = replan_sim.slow_rank(PROFILE, 1, 300, 3)
    off, _ = replan_sim.replay(world, FIRST, TOPOLOGY, 900, 100, False, 0.02, 0)
    auto, used = replan_sim.replay(world, FIRST, TOPOLOGY, 900, 100, True, 0.02, 0)
    static = replan_sim.hindsight(world, FIRST, TOPOLOGY, 900, 100)
    assert len(used) == 2
    assert off / auto > 1.3
    assert auto <= static * 1.1


def test_costs_that_do_not_change_keep_the_first_plan() -> None:
    world = replan_sim.slow_rank(PROFILE, 1, 10**9, 3)
    off, _ = replan_sim.replay(world, FIRST, TOPOLOGY, 900, 100, False, 0.02, 0)
    auto, used = replan_sim.replay(world, FIRST, TOPOLOGY, 900, 100, True, 0.02, 0)
    assert used == [FIRST]
    assert auto == pytest.approx(off)
