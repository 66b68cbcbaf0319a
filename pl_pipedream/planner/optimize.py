"""``plan``: PipeDream's optimizer from a profile and a topology to a ``Plan`` (SOSP'19, 3.1).

Levels are solved innermost first. At level ``l`` a component of level ``l - 1`` counts as one
machine whose time for a segment is the best time of that segment on all workers of that
component. The outermost level's answer, walked back through the levels, gives the stages; the
replicas of a stage multiply across levels and a stage's ranks stay contiguous inside each
component.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np

from pl_pipedream.planner.admission import admits, divisors, factor_choices
from pl_pipedream.planner.advice import advise, slower_than_data_parallel
from pl_pipedream.planner.costs import stage_time
from pl_pipedream.planner.dp import RowSolution, every_row, row_times, solve_row, to_last
from pl_pipedream.planner.level import (
    LevelCosts,
    LevelPairs,
    all_pairs,
    ancestor_matrix,
    level_pairs,
)
from pl_pipedream.planner.plan import Plan, PlanError, Stage, with_warmup
from pl_pipedream.planner.states import MAX_STATES, PlanningGraph, StateSpaceError, planning_graph
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["plan", "data_parallel_time"]

_DENSE_LIMIT = 40_000_000  # floats (320 MB): gnmt_large (1,495 states) on 8 workers is 18 M


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
    """Each state's sums over its member layers (``math.fsum``: exact, in any order)."""
    compute = [n.compute_ms for n in graph.nodes]
    forward = [n.forward_ms for n in graph.nodes]
    backward = [n.backward_ms for n in graph.nodes]
    params = [n.parameter_bytes for n in graph.nodes]
    outputs = [n.output_bytes for n in graph.nodes]
    rows = []
    for state in graph.states:
        members = _indices(state.members)
        rows.append(
            (
                math.fsum(map(compute.__getitem__, members)) / 1000.0,
                math.fsum(map(forward.__getitem__, members)),
                math.fsum(map(backward.__getitem__, members)),
                math.fsum(map(params.__getitem__, members)),
                math.fsum(map(outputs.__getitem__, members)),
                math.fsum(map(outputs.__getitem__, state.augmented)),
            )
        )
    columns = np.array(rows, dtype=np.float64).T
    return _Prefix(*columns)


def _indices(mask: int) -> list[int]:
    """The positions of a bit set's ones, lowest first (the binary digits read backwards)."""
    return [i for i, bit in enumerate(reversed(bin(mask)[2:])) if bit == "1"]


def _base_compute(prefix: _Prefix, precedes: np.ndarray) -> np.ndarray:
    """compute[r, j]: seconds of the segment from row r to state j (inf if it is no segment)."""
    count = precedes.shape[0]
    table = np.full((count + 1, count), math.inf)
    table[0] = prefix.compute
    differences = prefix.compute[None, :] - prefix.compute[:, None]
    table[1:] = np.where(precedes, differences, math.inf)
    return table


def _inner(costs: LevelCosts, pairs: LevelPairs, top_workers: float) -> np.ndarray:
    """The level above's compute table: every row's best time on all of this level's workers.

    ``top_workers`` is the workers of the level above when that level is the top one (``inf``
    otherwise). With at most two workers on top, a pipeline of the top level has at most two
    stages: one from the model's input and one that ends the model. Only row 0 and the segments
    ending the model are then needed, and ``to_last`` gives the latter for every row in one pass
    (the rest of the table stays ``inf``, which the top level never reads on its way to the
    answer). Otherwise every row is needed, and only its times, not its choices: ``every_row``
    solves all rows at once in a table of ``workers x rows x states`` floats, or ``row_times``
    one row after another when that table would exceed ``_DENSE_LIMIT`` floats.
    """
    count = costs.params.shape[0]
    if top_workers <= 2:
        table = np.full((count + 1, count), math.inf)
        table[0] = solve_row(costs, 0, pairs).time[:, -1]
        table[1:, -1] = to_last(costs)[1:]
        return table
    if costs.workers * (count + 1) * count <= _DENSE_LIMIT:
        return every_row(costs, pairs)
    return np.array([row_times(costs, row, pairs) for row in range(count + 1)])


def data_parallel_time(total_compute: float, total_params: float, topology: Topology) -> float:
    """Time per minibatch of one stage replicated on every worker, under the same cost model."""
    time = total_compute
    within = 1
    for level in topology.levels:
        time = stage_time(time, total_params, level.workers, level.bandwidth, within)
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
    microbatches: int | None = None,
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

    ``microbatches``: only plans whose every replica count divides it (``planner.admission``),
    as the 1F1B-RR schedule needs when each batch is split into that many microbatches.
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
    if microbatches is not None and not (isinstance(microbatches, int) and microbatches >= 1):
        raise PlanError(
            f"microbatches must be a positive integer (microbatches: {microbatches!r}); pass >= 1"
        )
    if microbatches is not None:
        _check_workers_usable(len(profile.nodes), topology.num_workers, microbatches)
    graph = _graph(profile, max_states, cuts)
    solve = lambda replicas: _solve(graph, topology, straight, memory, transfers, replicas)  # noqa: E731
    chosen = solve(None) if microbatches is None else _admissible(solve, topology, microbatches)
    if slower_than_data_parallel(chosen):
        free = solve(None) if microbatches is not None else None
        because = "straight=True was asked for" if straight else None
        chosen.meta["advice"] = advise(chosen, free, microbatches, because) or ""
    return chosen


def _check_workers_usable(layers: int, workers: int, microbatches: int) -> None:
    """Every worker holds a stage or a replica of one, and a replica count divides the
    microbatches: more workers than ``layers`` times the largest such count cannot all work."""
    most = max(divisors(microbatches, workers))
    if layers * most < workers:
        raise PlanError(
            f"more devices than a plan can use: each holds a layer's stage or a replica of one, "
            f"and replica counts must divide the microbatches per batch (workers: {workers}, "
            f"layers: {layers}, microbatches: {microbatches}, so at most {layers * most} "
            f"devices); use at most {layers * most} devices, {-(-workers // layers)} or more "
            "microbatches per batch (so that stages can be replicated), or give a plan"
        )


def _admissible(
    solve: Callable[[tuple[tuple[int, ...], ...] | None], Plan],
    topology: Topology,
    microbatches: int,
) -> Plan:
    """The fastest plan whose replica counts divide ``microbatches`` (``planner.admission``)."""
    workers = [level.workers for level in topology.levels]
    superset = solve(tuple(divisors(microbatches, w) for w in workers))
    if admits(superset, microbatches):
        return superset
    plans = []
    for choice in factor_choices(microbatches, workers):
        with contextlib.suppress(PlanError):  # this split of the microbatches admits no plan
            plans.append(solve(choice))
    if not plans:
        raise PlanError(
            f"no plan's replica counts divide the microbatches per batch (microbatches: "
            f"{microbatches}, workers per level: {workers}); use more microbatches"
        )
    return min(plans, key=lambda p: p.slowest_stage_time)


def _solve(
    graph: PlanningGraph,
    topology: Topology,
    straight: bool,
    memory: float | None,
    transfers: bool,
    replicas: tuple[tuple[int, ...], ...] | None,
) -> Plan:
    """The DP over ``graph`` with ``replicas[l]`` the replica counts level ``l`` admits."""
    prefix = _prefix(graph)
    precedes = ancestor_matrix(graph.ancestors)
    compute = _base_compute(prefix, precedes)
    pairs = all_pairs(precedes)
    count = len(graph.states)
    levels: list[LevelCosts] = []
    within = 1
    for number, level in enumerate(topology.levels):
        levels.append(
            LevelCosts(
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
                replicas[number] if replicas is not None else None,
            )
        )
        within = level.workers
    pairs_of = [level_pairs(levels[0])]
    for number in range(1, len(levels)):
        # Only the top level's answer is read, so only the level below it may skip rows.
        above = levels[number].workers if number == len(levels) - 1 else math.inf
        table = _inner(levels[number - 1], pairs_of[-1], above)
        levels[number] = replace(levels[number], compute=table)
        pairs_of.append(level_pairs(levels[number]))
    top = solve_row(levels[-1], 0, pairs_of[-1])
    best = float(top.time[count - 1, -1])
    if not math.isfinite(best):
        raise PlanError(
            f"no pipeline fits the constraints (workers: {topology.num_workers}, memory per "
            f"worker: {memory}, straight: {straight}, replica counts per level: {replicas}); "
            + (
                "allow more memory, more workers, replication, or more microbatches"
                if memory is not None
                else "use fewer devices, allow replication, or use more microbatches"
            )
        )
    segments = _walk(levels, pairs_of, len(levels) - 1, top, 0, count - 1, 0)
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
    pairs_of: list[LevelPairs],
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
        below = solve_row(levels[level - 1], start, pairs_of[level - 1])
        per_component = [
            _walk(levels, pairs_of, level - 1, below, start, stop, c) for c in components
        ]
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
