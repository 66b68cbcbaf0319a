"""Plans for PipeDream's published profiles: complete, consistent, fast enough."""

from __future__ import annotations

import time

import pytest

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

NAMES = [
    "alexnet",
    "vgg16",
    "resnet18",
    "resnet50",
    "resnext50",
    "squeezenet1_0",
    "gnmt",
    "gnmt_large",
    "densenet121",
    "inception_v3",
]


@pytest.mark.parametrize("name", NAMES)
def test_every_node_lands_on_exactly_one_stage(profiles_dir, name: str) -> None:
    profile = Profile.load(profiles_dir / f"{name}.txt")
    result = plan(profile, Topology.flat(16, 1e9))
    placed = [node for stage in result.stages for node in stage.nodes]
    assert sorted(placed) == sorted(node.node_id for node in profile.nodes)
    assert result.num_workers == 16
    assert sorted(r for stage in result.stages for r in stage.ranks) == list(range(16))
    assert result.slowest_stage_time > 0
    assert result.meta["cuts"] == ("topological" if name == "inception_v3" else "antichain")
    assert Plan.from_json(result.to_json()) == result


def test_vgg16_on_four_workers_is_three_one(profiles_dir) -> None:
    result = plan(Profile.load(profiles_dir / "vgg16.txt"), Topology.flat(4, 1e9))
    assert result.shape == "3-1"
    assert result.noam == 2
    assert [stage.warmup for stage in result.stages] == [1, 0]


def test_straight_plans_have_one_replica_per_stage(profiles_dir) -> None:
    result = plan(Profile.load(profiles_dir / "resnet50.txt"), Topology.flat(4, 1e9), straight=True)
    assert result.shape == "1-1-1-1"
    assert [stage.warmup for stage in result.stages] == [3, 2, 1, 0]


def test_memory_limit_changes_or_refuses_the_plan(profiles_dir) -> None:
    """PipeDream's stash estimate is ceil(workers after the stage / replicas) x (activations +
    parameters): zero for data parallelism, so a tiny limit leaves only that, or nothing when
    replication is off."""
    profile = Profile.load(profiles_dir / "vgg16.txt")
    free = plan(profile, Topology.flat(4, 1e9))
    assert plan(profile, Topology.flat(4, 1e9), memory=1e6).shape == "4"
    with pytest.raises(PlanError, match="no pipeline fits"):
        plan(profile, Topology.flat(4, 1e9), memory=1e6, straight=True)
    roomy = plan(profile, Topology.flat(4, 1e9), memory=1e12)
    assert roomy.slowest_stage_time == free.slowest_stage_time


def test_hierarchical_ranks_keep_inner_replicas_together(profiles_dir) -> None:
    result = plan(
        Profile.load(profiles_dir / "vgg16.txt"), Topology.from_lists([4, 4], [1e10, 1.25e9])
    )
    assert result.num_workers == 16
    for stage in result.stages:
        servers = {rank // 4 for rank in stage.ranks}
        per_server = len(stage.ranks) // len(servers)
        for server in servers:
            mine = sorted(r for r in stage.ranks if r // 4 == server)
            assert len(mine) == per_server
            assert mine == list(range(mine[0], mine[0] + per_server))


def test_sixteen_workers_plan_within_two_seconds_each(profiles_dir) -> None:
    profile = Profile.load(profiles_dir / "gnmt_large.txt")
    start = time.perf_counter()
    plan(profile, Topology.flat(16, 1e9))
    # Generous bound for a shared CI machine; benchmarks/planner_speed.py measures properly.
    assert time.perf_counter() - start < 10.0
