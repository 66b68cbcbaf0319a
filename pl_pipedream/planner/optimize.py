"""``plan``: PipeDream's optimizer from a profile and a topology to a ``Plan`` (SOSP'19, 3.1).

Levels are solved innermost first. At level ``l`` a component of level ``l - 1`` counts as one
machine whose time for a segment is the best time of that segment on all workers of that
component. The outermost level's answer, walked back through the levels, gives the stages; the
replicas of a stage multiply across levels and a stage's ranks stay contiguous inside each
component.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pl_pipedream.planner.dp import (
    LevelCosts,
    RowSolution,
    all_pairs,
    ancestor_matrix,
    solve_row,
)
from pl_pipedream.planner.plan import Plan, PlanError, Stage, with_warmup
from pl_pipedream.planner.states import MAX_STATES, PlanningGraph, StateSpaceError, planning_graph
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["plan", "data_parallel_time"]


@dataclass(frozen=True)
class _Prefix:
    """Per-state prefix sums over the states' member layers."""

    compute: np.ndarray  # seconds, forward + backward
    forward: np.ndarray  # milliseconds
    backward: np.ndarray  # milliseconds
    params: np.ndarray
    activations: np.ndarray
    outputs: np.ndarray


def _prefix(graph: PlanningGraph) -> _Prefix:
    rows = []
    for state in graph.states:
        members = [graph.nodes[i] for i in _indices(state.members)]
        rows.append(
            (
                math.fsum(n.compute_ms for n in members) / 1000.0,
                math.fsum(n.forward_ms for n in members),
                math.fsum(n.backward_ms for n in members),
                math.fsum(n.parameter_bytes for n in members),
                math.fsum(n.output_bytes for n in members),
                math.fsum(graph.nodes[i].output_bytes for i in state.augmented),
            )
        )
    columns = np.array(rows, dtype=np.float64).T
    return _Prefix(*columns)


def _indices(mask: int) -> list[int]:
    return [i for i in range(mask.bit_length()) if mask >> i & 1]


def _base_compute(prefix: _Prefix, precedes: np.ndarray) -> np.ndarray:
    """compute[r, j]: seconds of the segment from row r to state j (inf if it is no segment)."""
    count = precedes.shape[0]
    table = np.full((count + 1, count), math.inf)
    table[0] = prefix.compute
    differences = prefix.compute[None, :] - prefix.compute[:, None]
    table[1:] = np.where(precedes, differences, math.inf)
    return table


def data_parallel_time(total_compute: float, total_params: float, topology: Topology) -> float:
    """Time per minibatch of one stage replicated on every worker, under the same cost model."""
    time = total_compute
    within = 1
    for level in topology.levels:
        allreduce = 4 * (level.workers - 1) * total_params / (level.bandwidth * level.workers)
        time = (time + allreduce / within) / level.workers
        within = level.workers
    return time


def plan(
    profile: Profile,
    topology: Topology,
    straight: bool = False,
    memory: float | None = None,
    transfers: bool = True,
    max_states: int = MAX_STATES,
    cuts: str = "auto",
) -> Plan:
    """Partition ``profile`` over ``topology`` to minimise the slowest stage's time.

    ``straight`` forbids replication; ``memory`` (bytes per worker) rules out stages whose
    stashed weights and activations would not fit, with PipeDream's estimate of the stash;
    ``transfers=False`` ignores activation transfers (PipeDream's default when no activation
    compression ratio is given).

    ``cuts`` chooses the DP's states: ``"antichain"`` (every legal cut of the graph, exact, as
    PipeDream), ``"topological"`` (prefixes of one topological order: one state per layer), or
    ``"auto"``: antichains unless there are more than ``max_states`` of them (inception_v3 has
    over 20,000), then topological prefixes; ``plan.meta["cuts"]`` records which.
    """
    if memory is not None and not memory > 0:
        raise PlanError(
            f"memory per worker must be positive (memory: {memory}); omit it or raise it"
        )
    if straight and topology.num_workers > len(profile.nodes):
        layers = len(profile.nodes)
        raise PlanError(
            f"a straight pipeline has at most {layers} stages for {layers} layers (layers: "
            f"{layers}, workers: {topology.num_workers}); use fewer devices or more microbatches "
            "so stages can be replicated (each replica count must divide the microbatches per "
            "batch)"
        )
    graph = _graph(profile, max_states, cuts)
    prefix = _prefix(graph)
    precedes = ancestor_matrix(graph.ancestors)
    compute = _base_compute(prefix, precedes)
    pairs = all_pairs(precedes)
    count = len(graph.states)
    levels: list[LevelCosts] = []
    within = 1
    for number, level in enumerate(topology.levels):
        costs = LevelCosts(
            compute,
            prefix.params,
            prefix.activations,
            prefix.outputs,
            precedes,
            pairs,
            level.workers,
            level.bandwidth,
            within,
            straight,
            memory,
            transfers,
        )
        levels.append(costs)
        within = level.workers
        if number < len(topology.levels) - 1:
            compute = np.full((count + 1, count), math.inf)
            for row in range(count + 1):
                compute[row] = solve_row(costs, row).time[:, -1]
    top = solve_row(levels[-1], 0)
    best = float(top.time[count - 1, -1])
    if not math.isfinite(best):
        raise PlanError(
            f"no pipeline fits the constraints (workers: {topology.num_workers}, memory per "
            f"worker: {memory}, straight: {straight}); allow more memory, more workers, or "
            "replication"
        )
    segments = _walk(levels, len(levels) - 1, top, 0, count - 1, 0)
    stages = _stages(graph, prefix, segments)
    return Plan(
        stages,
        topology,
        straight,
        memory,
        best,
        data_parallel_time(float(prefix.compute[-1]), float(prefix.params[-1]), topology),
        float(prefix.compute[-1]),
        {"cuts": graph.cuts, "states": str(count)},
    )


def _graph(profile: Profile, max_states: int, cuts: str) -> PlanningGraph:
    if cuts != "auto":
        return planning_graph(profile, max_states, cuts)
    try:
        return planning_graph(profile, max_states, "antichain")
    except StateSpaceError:
        return planning_graph(profile, max_states, "topological")


def _walk(
    levels: list[LevelCosts],
    level: int,
    solution: RowSolution,
    row: int,
    end: int,
    first_rank: int,
) -> list[tuple[int, int, list[int]]]:
    """Final segments ``(start_row, end_state, ranks)`` of one level's choice, recursively."""
    inner = math.prod(levels[i].workers for i in range(level))
    out = []
    rank = first_rank
    for start, stop, replicas in solution.stages(row, end, levels[level].workers):
        components = [rank + c * inner for c in range(replicas)]
        rank += replicas * inner
        if level == 0:
            out.append((start, stop, components))
            continue
        below = solve_row(levels[level - 1], start)
        per_component = [_walk(levels, level - 1, below, start, stop, c) for c in components]
        for parts in zip(*per_component, strict=True):
            ranks = [r for part in parts for r in part[2]]
            out.append((parts[0][0], parts[0][1], ranks))
    return out


def _stages(
    graph: PlanningGraph, prefix: _Prefix, segments: list[tuple[int, int, list[int]]]
) -> tuple[Stage, ...]:
    last = len(graph.states) - 1
    owner: dict[str, int] = {}
    stages = []
    for index, (start, end, ranks) in enumerate(segments):
        before = graph.states[start - 1].members if start > 0 else 0
        nodes = graph.members(graph.states[end].members & ~before)
        nodes = (list(graph.inputs) if index == 0 else []) + nodes
        for node_id in nodes:
            owner[node_id] = index
        stages.append(
            Stage(
                index,
                tuple(nodes),
                len(ranks),
                tuple(ranks),
                _segment(prefix.forward, start, end),
                _segment(prefix.backward, start, end),
                _segment(prefix.params, start, end),
                float(prefix.outputs[start - 1]) if start > 0 else 0.0,
                float(prefix.outputs[end]) if end < last else 0.0,
                activation_bytes=_segment(prefix.activations, start, end),
            )
        )
    for node_id, producer in graph.dropped:
        index = owner.get(producer, len(stages) - 1)
        target = stages[index]
        stages[index] = Stage(**{**target.__dict__, "nodes": target.nodes + (node_id,)})
    return with_warmup(stages)


def _segment(prefix_sums: np.ndarray, start: int, end: int) -> float:
    """The sum over a segment from its start row to its end state."""
    return float(prefix_sums[end] - (prefix_sums[start - 1] if start > 0 else 0.0))
