"""``plan_chunks``: a profiled chain of layers cut into ``p v`` stages, ``v`` per rank.

The chunked sync modes (interleaved 1F1B, Narayanan et al., SC'21 section 2.2; ZB-V, Qi et al.,
ICLR'24 section 6) run a fixed stage-to-rank mapping (module ``chunks``), so the plan is a straight
pipeline of exactly ``p v`` single-replica stages placed by that mapping. Each stage is priced
by the cost model (``costs.stage_time``: its compute, at least the time to move what it receives
and sends; a message between two stages of one rank, the turn of a V, costs nothing). A rank
runs every one of its stages for each minibatch, so the plan's predicted time per minibatch is
the slowest rank's total over its stages, and that is what the cut minimises first, then the
slowest stage (the bubbles). A rank's stages are not contiguous, so no interval DP gives that
optimum: two DPs over the chain's contiguous segments (the slowest stage least; the sum of
squared stage times least) each give a balanced start, and single cuts moved by one layer
while that improves (slowest rank, slowest stage) refine both; the better one is kept.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from pl_pipedream.planner.chunks import V_SHAPE, stage_ranks
from pl_pipedream.planner.costs import stage_time
from pl_pipedream.planner.optimize import data_parallel_time
from pl_pipedream.planner.plan import Plan, PlanError, Stage, with_warmup
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

__all__ = ["plan_chunks"]


def plan_chunks(profile: Profile, topology: Topology, placement: str, chunks: int = 2) -> Plan:
    """The chain ``profile`` as ``chunks`` stages on each of ``topology``'s workers, placed
    ``placement`` (``"interleaved"`` or ``"v"``: then 2 chunks), the slowest stage as fast as
    the cut allows."""
    if placement == V_SHAPE:
        chunks = 2
    ranks = topology.num_workers
    count = ranks * chunks
    if not profile.is_chain():
        raise PlanError(
            f"a chunked plan cuts a chain of layers (an nn.Sequential) into consecutive stages "
            f"(profile: a graph of {len(profile.nodes)} layers that is not a chain); profile the "
            "model as the nn.Sequential the pipeline runs"
        )
    if len(profile.nodes) < count:
        raise PlanError(
            f"a chunked plan needs a layer per stage (layers: {len(profile.nodes)}, stages: "
            f"{count} = {ranks} ranks x {chunks} chunks); use fewer devices, fewer chunks per "
            "rank, or split the model into more layers"
        )
    order = {node_id: i for i, node_id in enumerate(profile.topological_order())}
    nodes = sorted(profile.nodes, key=lambda node: order[node.node_id])
    mapping = stage_ranks(placement, ranks, chunks)
    bandwidth = topology.levels[-1].bandwidth
    sums = _prefix_sums([node.compute_ms / 1000.0 for node in nodes])
    outputs = [node.output_bytes for node in nodes]

    def seconds(stage: int, start: int, stop: int) -> float:
        """Stage ``stage`` over nodes ``start .. stop - 1``."""
        apart = lambda other: 0 <= other < count and mapping[other] != mapping[stage]  # noqa: E731
        received = outputs[start - 1] if apart(stage - 1) else 0.0
        sent = outputs[stop - 1] if apart(stage + 1) else 0.0
        return float(stage_time(sums[stop] - sums[start], 0.0, 1, bandwidth, 1, received, sent))

    def worst(ends: list[int]) -> tuple[float, float]:
        """(slowest rank's total, slowest stage) of the cut ending its stages at ``ends``."""
        times = [
            seconds(i, a, b) for i, (a, b) in enumerate(zip([0, *ends[:-1]], ends, strict=True))
        ]
        totals = [0.0] * ranks
        for index, time in enumerate(times):
            totals[mapping[index]] += time
        return max(totals), max(times)

    starts = (_cut(len(nodes), count, seconds, square) for square in (False, True))
    ends = min((_refine(cut, worst) for cut in starts), key=worst)
    stages = []
    for index, (start, stop) in enumerate(zip([0, *ends[:-1]], ends, strict=True)):
        members = nodes[start:stop]
        stages.append(
            Stage(
                index=index,
                nodes=tuple(node.node_id for node in members),
                replicas=1,
                ranks=(mapping[index],),
                forward_ms=math.fsum(node.forward_ms for node in members),
                backward_ms=math.fsum(node.backward_ms for node in members),
                parameter_bytes=math.fsum(node.parameter_bytes for node in members),
                input_bytes=outputs[start - 1] if start > 0 else 0.0,
                output_bytes=outputs[stop - 1] if stop < len(nodes) else 0.0,
                activation_bytes=math.fsum(outputs[start:stop]),
            )
        )
    params = math.fsum(node.parameter_bytes for node in nodes)
    meta = {"chunks": f"{placement}, {chunks} stages per rank, cut by the slowest rank"}
    return Plan(
        with_warmup(stages),
        topology,
        straight=True,
        slowest_stage_time=worst(ends)[0],
        data_parallel_time=data_parallel_time(sums[-1], params, topology),
        single_worker_time=sums[-1],
        meta=meta,
    )


def _prefix_sums(values: list[float]) -> list[float]:
    sums = [0.0]
    for value in values:
        sums.append(sums[-1] + value)
    return sums


def _cut(
    length: int, count: int, price: Callable[[int, int, int], float], square: bool
) -> list[int]:
    """The ends of ``count`` non-empty consecutive segments of ``length`` items whose slowest
    ``price(stage, start, stop)`` is least, or with ``square`` the sum of squared prices (ties:
    the earliest cut found)."""
    best = [[math.inf] * (length + 1) for _ in range(count + 1)]
    choice = [[0] * (length + 1) for _ in range(count + 1)]
    best[0][0] = 0.0
    for stage in range(1, count + 1):
        for stop in range(stage, length - (count - stage) + 1):
            for start in range(stage - 1, stop):
                cost = price(stage - 1, start, stop)
                before = best[stage - 1][start]
                value = before + cost * cost if square else max(before, cost)
                if value < best[stage][stop]:
                    best[stage][stop], choice[stage][stop] = value, start
    ends, stop = [], length
    for stage in range(count, 0, -1):
        ends.append(stop)
        stop = choice[stage][stop]
    return ends[::-1]


def _refine(ends: list[int], worst: Callable[[list[int]], tuple[float, float]]) -> list[int]:
    """``ends`` with single cuts moved by one item while that lowers ``worst`` (a local
    optimum: each move strictly improves, so it ends)."""
    current = worst(ends)
    moved = True
    while moved:
        moved = False
        for cut in range(len(ends) - 1):
            for step in (-1, 1):
                trial = [*ends[:cut], ends[cut] + step, *ends[cut + 1 :]]
                low = trial[cut - 1] if cut > 0 else 0
                if not low < trial[cut] < trial[cut + 1]:
                    continue
                if (value := worst(trial)) < current:
                    ends, current, moved = trial, value, True
    return ends
