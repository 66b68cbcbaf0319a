"""Planning for workers of unequal speed: a DP over ranks in order, and a plan's time on them.

PipeDream's optimizer (``planner.optimize``) assumes equal workers, so which rank serves which
stage does not matter. When rank ``w`` runs at ``speeds[w]`` times the profiled speed (a slower
or shared device: 0.5 is twice as slow), a stage's compute on it takes ``compute / speeds[w]``,
and a replicated stage, served round robin, goes at its slowest replica's pace. The DP here keeps
the stages on consecutive ranks (rank ``w`` is position ``w``) and solves, for every prefix of
the model's states and every count ``m`` of the first ranks, the smallest slowest-stage time; a
stage on ranks ``a..m-1`` is priced with ``costs.stage_time`` on ``compute / min(speeds[a:m])``,
its all-reduce at the bandwidth of the smallest topology component holding those ranks, its
input at the bandwidth of its worst-connected replica's link from its best-connected rank of the
stage before (rank ``a - 1`` here), and fits memory by ``costs.held_bytes``.

``plan_time`` prices any plan (the hierarchical DP's too) with the same terms, so a plan in use
and a candidate are compared on one scale. The plan's ``data_parallel_time`` is data
parallelism's on the same workers, at the slowest one's pace (a replica of every layer on it).
With every speed 1 ``planner.plan`` is the answer and this solver is not used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from pl_pipedream.planner.costs import fitting_time, held_bytes, stage_time
from pl_pipedream.planner.dp import TIE
from pl_pipedream.planner.level import all_pairs, ancestor_matrix
from pl_pipedream.planner.optimize import _graph, _Prefix, _prefix, _stages, data_parallel_time
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.states import MAX_STATES, planning_graph
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["check_speeds", "plan_time", "plan_with_speeds", "span_bandwidth"]


def check_speeds(speeds: Sequence[float], topology: Topology) -> tuple[float, ...]:
    """``speeds`` as a tuple, one positive float per worker of ``topology``."""
    out = tuple(float(s) for s in speeds)
    if len(out) != topology.num_workers or not all(s > 0 and math.isfinite(s) for s in out):
        raise PlanError(
            f"give one positive speed per worker (workers: {topology.num_workers}, speeds: "
            f"{list(out)}); 1.0 is the profiled speed"
        )
    return out


def span_bandwidth(topology: Topology, ranks: Sequence[int]) -> float:
    """The bandwidth joining ``ranks``: that of the innermost level one of whose components holds
    them all (levels innermost first; one rank alone gets the innermost level's)."""
    size = 1
    for level in topology.levels:
        size *= level.workers
        if len({rank // size for rank in ranks}) <= 1:
            return level.bandwidth
    return topology.levels[-1].bandwidth


def _stage_seconds(
    compute: np.ndarray | float,
    params: np.ndarray | float,
    replicas: int,
    allreduce_bandwidth: float,
    link_bandwidth: float,
    received: np.ndarray | float | None,
    sent: np.ndarray | float | None,
) -> np.ndarray | float:
    """One stage: ``costs.stage_time`` for its compute (already divided by its speed) and its
    all-reduce, at least the time to move its messages over its input link."""
    time = stage_time(compute, params, replicas, allreduce_bandwidth)
    if received is None or sent is None:
        return time
    return np.maximum(time, stage_time(0.0, 0.0, replicas, link_bandwidth, 1, received, sent))


def plan_time(
    plan: Plan, profile: Profile, topology: Topology, speeds: Sequence[float] | None = None
) -> float:
    """Seconds per minibatch of ``plan``'s slowest stage with ``profile``'s layer costs on
    workers of ``speeds`` (default all 1), transfers included."""
    rates = check_speeds(speeds or [1.0] * topology.num_workers, topology)
    counted = {n.node_id for n in planning_graph(profile, cuts="topological").nodes}
    slowest = 0.0
    previous: tuple[int, ...] = ()
    for stage in plan.stages:
        nodes = [profile.node(n) for n in stage.nodes if n in counted]  # inputs cost nothing
        compute = math.fsum(n.compute_ms for n in nodes) / 1000.0
        params = math.fsum(n.parameter_bytes for n in nodes)
        speed = min(rates[r] for r in stage.ranks)
        link = _link(topology, previous, stage.ranks) if previous else 1.0
        received, sent = (stage.input_bytes, stage.output_bytes) if previous else (None, None)
        bandwidth = span_bandwidth(topology, stage.ranks)
        time = _stage_seconds(
            compute / speed, params, stage.replicas, bandwidth, link, received, sent
        )
        slowest = max(slowest, float(time))
        previous = stage.ranks
    return slowest


def _link(topology: Topology, previous: Sequence[int], ranks: Sequence[int]) -> float:
    """The input link of a stage: each replica receives from its best-connected rank of the
    stage before, and the stage goes at its worst-connected replica's pace."""
    return min(max(span_bandwidth(topology, (p, r)) for p in previous) for r in ranks)


def plan_with_speeds(
    profile: Profile,
    topology: Topology,
    speeds: Sequence[float],
    straight: bool = False,
    memory: float | None = None,
    max_states: int = MAX_STATES,
    cuts: str = "auto",
    microbatches: int | None = None,
) -> Plan:
    """The plan with the smallest slowest-stage time on workers of ``speeds``, stages on
    consecutive ranks; the other arguments as ``planner.plan`` (``microbatches``: every replica
    count divides it)."""
    rates = check_speeds(speeds, topology)
    graph = _graph(profile, max_states, cuts)
    prefix = _prefix(graph)
    precedes = ancestor_matrix(graph.ancestors)
    ks, js = all_pairs(precedes)  # grouped by j, k ascending
    count, workers = len(graph.states), topology.num_workers
    last = count - 1
    best = np.full((count, workers + 1), math.inf)
    choice: dict[tuple[int, int], tuple[int, int]] = {}  # (j, m) -> (k or -1, replicas)
    pairs = _Pairs(ks, js, prefix.outputs[ks], np.where(js < last, prefix.outputs[js], 0.0))
    for m in range(1, workers + 1):
        for r in _replica_counts(m, straight, microbatches):
            a = m - r
            speed, bandwidth = min(rates[a:m]), span_bandwidth(topology, range(a, m))
            if a == 0:
                time = _first_stages(prefix, speed, r, bandwidth, workers - m, memory)
                _improve(best, choice, np.arange(count), time, m, -1, r)
            elif ks.size:
                link = _link(topology, (a - 1,), range(a, m))
                time = _appended_stages(
                    prefix, pairs, speed, r, bandwidth, link, workers - m, memory
                )
                group, first = pairs.best_per_end(np.maximum(best[ks, a], time))
                _improve(best, choice, pairs.ends, group, m, ks[first], r)
    slowest = float(best[last, workers])
    if not math.isfinite(slowest):
        raise PlanError(
            f"no pipeline fits the constraints (workers: {workers}, memory per worker: "
            f"{memory}, straight: {straight}, speeds: {list(rates)}); allow more memory, "
            "replication, or more microbatches"
        )
    segments = _walk(choice, last, workers)
    result = Plan(
        _stages(graph, prefix, segments),
        topology,
        straight,
        memory,
        slowest,
        data_parallel_time(
            float(prefix.compute[-1]) / min(rates), float(prefix.params[-1]), topology
        ),
        float(prefix.compute[-1]),
        {"cuts": graph.cuts, "states": str(count), "speeds": ",".join(f"{s:g}" for s in rates)},
    )
    return result


@dataclass(frozen=True)
class _Pairs:
    """The DP's pairs (state ``k`` preceding state ``j``), grouped by ``j`` with ``k`` ascending,
    and the bytes a stage from after ``k`` to ``j`` receives and sends."""

    ks: np.ndarray
    js: np.ndarray
    received: np.ndarray
    sent: np.ndarray

    @property
    def heads(self) -> np.ndarray:
        return np.flatnonzero(np.r_[True, self.js[1:] != self.js[:-1]])

    @property
    def ends(self) -> np.ndarray:
        return self.js[self.heads]

    def best_per_end(self, candidate: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per end state: the least candidate, and the position of the earliest ``k`` tied
        with it."""
        heads = self.heads
        group = np.minimum.reduceat(candidate, heads)
        sizes = np.diff(np.r_[heads, candidate.size])
        tied = candidate <= np.repeat(group, sizes) * (1 + TIE)
        positions = np.where(tied, np.arange(candidate.size), candidate.size)
        return group, np.minimum.reduceat(positions, heads)


def _first_stages(
    prefix: _Prefix, speed: float, replicas: int, bandwidth: float, after: int, memory: float | None
) -> np.ndarray:
    """A first stage from the model's input to every state, on ``replicas`` ranks."""
    last = prefix.compute.shape[0] - 1
    sent = np.where(np.arange(last + 1) < last, prefix.outputs, 0.0)
    stash = prefix.activations + prefix.params
    compute = prefix.compute / speed
    time = _stage_seconds(compute, prefix.params, replicas, bandwidth, 1.0, None, None)
    return _fit(time, stash, after, replicas, 0.0, sent, memory)


def _appended_stages(
    prefix: _Prefix,
    pairs: _Pairs,
    speed: float,
    replicas: int,
    bandwidth: float,
    link: float,
    after: int,
    memory: float | None,
) -> np.ndarray:
    """A stage from after ``k`` to ``j`` for every pair, on ``replicas`` ranks."""
    ks, js = pairs.ks, pairs.js
    compute = (prefix.compute[js] - prefix.compute[ks]) / speed
    params = prefix.params[js] - prefix.params[ks]
    stash = prefix.activations[js] - prefix.activations[ks] + params
    time = _stage_seconds(compute, params, replicas, bandwidth, link, pairs.received, pairs.sent)
    return _fit(time, stash, after, replicas, pairs.received, pairs.sent, memory)


def _replica_counts(m: int, straight: bool, microbatches: int | None) -> list[int]:
    """Replica counts of a stage ending at rank ``m - 1``: all ``m`` (one stage) first, then
    the lowest first; a straight pipeline has one replica per stage."""
    counts = [1] if straight else [m, *range(1, m)]
    return [r for r in counts if microbatches is None or microbatches % r == 0]


def _fit(
    time: np.ndarray | float,
    stash: np.ndarray,
    after: int,
    replicas: int,
    received: np.ndarray | float,
    sent: np.ndarray | float,
    memory: float | None,
) -> np.ndarray:
    """``time``, infinite where the stage's ``costs.held_bytes`` exceed ``memory``."""
    if memory is None:
        return np.asarray(time)
    return fitting_time(time, held_bytes(stash, after, replicas, received, sent), memory)


def _improve(
    best: np.ndarray,
    choice: dict[tuple[int, int], tuple[int, int]],
    targets: np.ndarray,
    times: np.ndarray,
    m: int,
    splits: np.ndarray | int,
    replicas: int,
) -> None:
    """Keep ``times`` where they beat ``best[:, m]`` by more than a tie: one stage first, then
    the lowest replica count and the earliest cut win ties."""
    better = times < best[targets, m] * (1 - TIE)
    better |= np.isinf(best[targets, m]) & np.isfinite(times)
    splits = np.broadcast_to(splits, targets.shape)
    for j, k, t in zip(targets[better], splits[better], times[better], strict=True):
        best[j, m] = t
        choice[(int(j), m)] = (int(k), replicas)


def _walk(
    choice: dict[tuple[int, int], tuple[int, int]], end: int, workers: int
) -> list[tuple[int, int, list[int]]]:
    """``(start_row, end_state, ranks)`` per stage in pipeline order."""
    out = []
    j, m = end, workers
    while m > 0:
        k, r = choice[(j, m)]
        out.append((k + 1, j, list(range(m - r, m))))
        j, m = k, m - r
    if j != -1:
        raise PlanError(f"the speed DP's walk must end at the model's input (state: {j})")
    out.reverse()
    return out
