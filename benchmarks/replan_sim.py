"""Re-planning on drifting costs, replayed at 16 workers on the paper's clusters.

What it shows: ``planner.replan.decide`` run every ``--every`` minibatches on measurements made
from the true costs (each layer's time on its rank, times a noise of +-``--noise``), for two
scenarios: (1) ``slow-rank``: one rank runs 2x slower from a third of the run on; (2)
``costly-layer``: one layer's cost grows linearly to 3x over the run. Printed per model and
cluster: minibatches per second for ``off`` (the first plan throughout), ``auto`` (re-plan when
the decision says, paying each move's seconds) and the best static plan in hindsight (of every
plan the true costs called for at some check, the one with the least total time).

Time per minibatch is ``planner.speeds.plan_time`` of the plan in use on the true costs (the
planner's cost model: slowest stage, all-reduce and transfers), not a run on GPUs. Profiles:
PipeDream's published ones (``pl_pipedream/published``); clusters A (4 servers x 4 V100) and B
(2 x 8), as ``pl-pipedream reproduce`` reads them.

Command: ``python benchmarks/replan_sim.py`` (about a minute on one CPU core).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Callable
from dataclasses import replace

from pl_pipedream.planner.measured import RankTimes, measured_model
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import decide, move_bytes
from pl_pipedream.planner.speeds import plan_time, plan_with_speeds
from pl_pipedream.planner.states import planning_graph
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.published import load_profile
from pl_pipedream.reproduce.predict import cluster_topology

World = Callable[[int], tuple[Profile, tuple[float, ...]]]  # minibatch -> true costs, speeds


def slow_rank(profile: Profile, rank: int, start: int, workers: int) -> World:
    def world(step: int) -> tuple[Profile, tuple[float, ...]]:
        speeds = [1.0] * workers
        if step >= start:
            speeds[rank] = 0.5
        return profile, tuple(speeds)

    return world


def costly_layer(profile: Profile, node_id: str, total: int, workers: int) -> World:
    def world(step: int) -> tuple[Profile, tuple[float, ...]]:
        factor = 1.0 + 2.0 * step / total
        node = profile.node(node_id)
        grown = replace(
            node, forward_ms=node.forward_ms * factor, backward_ms=node.backward_ms * factor
        )
        nodes = [grown if n.node_id == node_id else n for n in profile.nodes]
        return profile.with_nodes(nodes), (1.0,) * workers

    return world


def measure(
    plan: Plan, profile: Profile, speeds: tuple[float, ...], noise: float, rng: random.Random
) -> list[RankTimes]:
    """What each rank's clock would report: its layers' true times on it, with noise."""
    out = []
    for stage in plan.stages:
        for rank in stage.ranks:
            jitter = lambda: 1.0 + rng.uniform(-noise, noise)  # noqa: E731
            nodes = [profile.node(n) for n in stage.nodes]
            forward = {n.node_id: n.forward_ms / speeds[rank] * jitter() for n in nodes}
            backward = {n.node_id: n.backward_ms / speeds[rank] * jitter() for n in nodes}
            out.append(RankTimes(rank, forward, backward))
    return out


def replay(
    world: World,
    first: Plan,
    topology: Topology,
    total: int,
    every: int,
    auto: bool,
    noise: float,
    seed: int,
) -> tuple[float, list[Plan]]:
    """Seconds to train ``total`` minibatches; the plans used, in order."""
    rng = random.Random(seed)
    plan, seconds, used = first, 0.0, [first]
    base = world(0)[0]
    for step in range(0, total, every):
        profile, speeds = world(step)
        if auto and step > 0:
            model = measured_model(
                base, measure(plan, profile, speeds, noise, rng), topology.num_workers
            )
            decision = decide(plan, model, topology, horizon=total - step, cuts="topological")
            if decision.move:
                bandwidth = min(level.bandwidth for level in topology.levels)
                seconds += move_bytes(plan, decision.plan, profile) / bandwidth
                plan = decision.plan
                used.append(plan)
        seconds += every * plan_time(plan, profile, topology, speeds)
    return seconds, used


def hindsight(world: World, first: Plan, topology: Topology, total: int, every: int) -> float:
    """The least total seconds of one plan kept throughout, among the plans the true costs call
    for at each check."""
    plans = {first.shape + str([s.nodes for s in first.stages]): first}
    for step in range(0, total, every):
        profile, speeds = world(step)
        best = plan_with_speeds(profile, topology, speeds, cuts="topological")
        plans.setdefault(best.shape + str([s.nodes for s in best.stages]), best)
    states = [world(step) for step in range(0, total, every)]
    return min(
        sum(every * plan_time(p, profile, topology, speeds) for profile, speeds in states)
        for p in plans.values()
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="vgg16,resnet50,alexnet")
    parser.add_argument("--clusters", default="A:4x4,B:2x8")
    parser.add_argument("--total", type=int, default=6000)
    parser.add_argument("--every", type=int, default=200)
    parser.add_argument("--noise", type=float, default=0.02)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    columns = ("off", "auto", "static", "auto/off")
    header = f"{'model':<10} {'cluster':<8} {'scenario':<13} " + " ".join(
        f"{c:>8}" for c in columns
    )
    header += f" {'auto/static':>11} moves"
    print("minibatches per second over", args.total, "minibatches, check every", args.every)
    print(header)
    print("-" * len(header))
    for name in args.models.split(","):
        profile = load_profile(name)
        for spec in args.clusters.split(","):
            cluster, shape = spec.split(":")
            servers, gpus = (int(x) for x in shape.split("x"))
            topology = cluster_topology(cluster, servers, gpus)
            workers = topology.num_workers
            first = plan_with_speeds(profile, topology, [1.0] * workers, cuts="topological")
            heaviest = max(first.stages, key=lambda s: s.compute_ms / s.replicas)
            layer = max(
                (n for n in heaviest.nodes if n in _counted(profile)),
                key=lambda n: profile.node(n).compute_ms,
            )
            worlds = {
                "slow-rank": slow_rank(profile, heaviest.ranks[0], args.total // 3, workers),
                "costly-layer": costly_layer(profile, layer, args.total, workers),
            }
            for scenario, world in worlds.items():
                off, _ = replay(
                    world, first, topology, args.total, args.every, False, args.noise, args.seed
                )
                auto, used = replay(
                    world, first, topology, args.total, args.every, True, args.noise, args.seed
                )
                static = hindsight(world, first, topology, args.total, args.every)
                rate = lambda s: args.total / s  # noqa: E731
                print(
                    f"{name:<10} {spec:<8} {scenario:<13} {rate(off):>8.1f} {rate(auto):>8.1f} "
                    f"{rate(static):>8.1f} {off / auto:>8.2f} {static / auto:>11.2f} "
                    f"{len(used) - 1}"
                )


def _counted(profile: Profile) -> set[str]:
    return {n.node_id for n in planning_graph(profile, cuts="topological").nodes}


if __name__ == "__main__":
    main()
