"""PipeDream's dynamic program over cuts, replica counts and topology levels (SOSP'19, 3.1).

For one level with ``M`` workers of bandwidth ``B`` the DP computes, for every prefix of the
model that ends at cut ``j`` and every worker count ``m``, the smallest possible time of the
slowest stage of a pipeline over that prefix on exactly ``m`` workers:

* one stage on ``r`` replicas takes ``(C + 4 (r - 1) W / (r B)) / r`` (compute ``C`` of its
  layers, plus the all-reduce of its ``W`` parameter bytes among the replicas); on the first
  stage the all-reduce term is divided by the worker count of one component of this level,
  exactly as PipeDream's optimizer does;
* a stage appended after cut ``k`` on ``r`` replicas also pays ``2 a(k) / (B r)`` to receive its
  input and, unless it ends the model, ``2 a(j) / (B r)`` to send its output;
* the pipeline's time is the slowest of those terms.

Rows of the DP are the start of a segment (row 0: the model's input; row ``a + 1``: after state
``a``). The outermost level needs only row 0; an inner level needs every row, because the level
above treats "this segment on one whole component" as one machine.

Two deliberate choices. Ties: among plans of equal time the DP keeps the single stage unless a
split is strictly better, then takes the lowest replica count and the earliest cut; PipeDream's
optimizer breaks ties in the iteration order of Python sets, which varies between runs, so on
ties the two may print different shapes of the same time. Inner rows: a segment that starts
after state ``a`` may only be split at states that follow ``a``; PipeDream's optimizer also tries
states unrelated to ``a`` and can then under-price an inner segment (never seen to change a final
answer). The README records how the DP's answers compare with PipeDream's own optimizer.

The arithmetic is vectorised over all (cut, cut) pairs of a row with numpy; no torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["LevelCosts", "RowSolution", "all_pairs", "ancestor_matrix", "solve_row"]

INF = math.inf


@dataclass(frozen=True)
class LevelCosts:
    """What one level of the DP sees: per-state prefix sums and the level's worker counts.

    ``compute[r, j]`` is the time (seconds) of the segment from row ``r`` to state ``j`` on one
    machine of this level (``inf`` where no such segment exists); the other arrays are prefix
    sums over states (index ``j``), in bytes. ``precedes`` is ``ancestor_matrix`` of the states,
    ``pairs`` its ``all_pairs``.
    """

    compute: np.ndarray
    params: np.ndarray
    activations: np.ndarray
    outputs: np.ndarray
    precedes: np.ndarray
    pairs: tuple[np.ndarray, np.ndarray]
    workers: int
    bandwidth: float
    within: int
    straight: bool
    memory: float | None
    transfers: bool


@dataclass(frozen=True)
class RowSolution:
    """Best times ``time[j, m]`` for segments from one row to state ``j`` on ``m + 1`` workers.

    ``split[j, m]`` is the state ``k`` after which the last stage starts (-1: one stage only),
    ``replicas[j, m]`` that last stage's replica count.
    """

    time: np.ndarray
    split: np.ndarray
    replicas: np.ndarray

    def stages(self, row: int, end: int, workers: int) -> list[tuple[int, int, int]]:
        """Walk the choices back: ``(start_row, end_state, replicas)`` in pipeline order."""
        out = []
        m = workers - 1
        j = end
        while True:
            k = int(self.split[j, m])
            r = int(self.replicas[j, m])
            if k < 0:
                out.append((row, j, r))
                break
            out.append((k + 1, j, r))
            m -= r
            j = k
        out.reverse()
        return out


def ancestor_matrix(ancestors: tuple[int, ...]) -> np.ndarray:
    """``matrix[k, j]`` is True when state ``k`` precedes state ``j`` in the antichain DAG."""
    count = len(ancestors)
    width = (count + 7) // 8
    rows = [
        np.unpackbits(
            np.frombuffer(mask.to_bytes(width, "little"), dtype=np.uint8), bitorder="little"
        )[:count]
        for mask in ancestors
    ]
    return np.array(rows, dtype=bool).T.copy() if rows else np.zeros((0, 0), dtype=bool)


def all_pairs(precedes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Every (k, j) with state k preceding state j, grouped by j with k ascending."""
    js, ks = np.nonzero(precedes.T)
    return ks.astype(np.int64), js.astype(np.int64)


def solve_row(costs: LevelCosts, row: int) -> RowSolution:
    """Fill the DP table of one row for every end state and every worker count of the level."""
    count = costs.params.shape[0]
    workers = costs.workers
    bandwidth = costs.bandwidth
    allowed = np.ones(count, dtype=bool) if row == 0 else costs.precedes[row - 1]
    time = np.full((count, workers), INF)
    split = np.full((count, workers), -1, dtype=np.int64)
    replicas = np.zeros((count, workers), dtype=np.int64)

    base_params = costs.params - (costs.params[row - 1] if row > 0 else 0.0)
    base_acts = costs.activations - (costs.activations[row - 1] if row > 0 else 0.0)
    base_compute = costs.compute[row]
    for m in range(1 if costs.straight else workers):
        r = m + 1
        allreduce = 4 * m * base_params / (bandwidth * r) / costs.within
        value = (base_compute + allreduce) / r
        if costs.memory is not None:
            stashed = math.ceil((workers - r) / r) * (base_acts + base_params)
            value = np.where(stashed > costs.memory, INF, value)
        value = np.where(allowed, value, INF)
        time[:, m] = value
        replicas[:, m] = r

    # k inside the row's segment and k preceding j put j inside it too.
    inside = allowed[costs.pairs[0]]
    ks, js = costs.pairs[0][inside], costs.pairs[1][inside]
    if ks.size == 0 or workers == 1:
        return RowSolution(time, split, replicas)
    order_j = js
    starts = np.flatnonzero(np.r_[True, order_j[1:] != order_j[:-1]])
    group_j = order_j[starts]
    seg_compute = costs.compute[ks + 1, js]
    seg_params = costs.params[js] - costs.params[ks]
    seg_acts = costs.activations[js] - costs.activations[ks]
    last = count - 1
    in_bytes = costs.outputs[ks]
    out_bytes = np.where(js < last, costs.outputs[js], 0.0)

    max_prime = 1 if costs.straight else workers - 1
    primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
    # stage[r' - 1, p]: time of the appended stage of pair p on r' replicas, transfers included.
    stage = (seg_compute + 4 * (primes - 1) * seg_params / (bandwidth * primes)) / primes
    if costs.transfers:
        stage = np.maximum(stage, 2.0 * np.maximum(in_bytes, out_bytes) / (bandwidth * primes))
    stash_bytes = seg_acts + seg_params
    group_of_pair = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, ks.size]))
    by_workers = np.ascontiguousarray(time.T)  # by_workers[m, k]
    pair_index = np.arange(ks.size)
    for m in range(1, workers):
        width = min(m, max_prime)
        # prefix[r' - 1, p]: the rest of the pipeline, up to cut k, on m + 1 - r' workers.
        prefix = by_workers[m - 1 :: -1][:width][:, ks]
        candidate = np.maximum(prefix, stage[:width])
        if costs.memory is not None:
            stash = stash_bytes * np.ceil((workers - (m + 1)) / primes[:width])
            candidate = np.where(stash > costs.memory, INF, candidate)
        best_prime = np.argmin(candidate, axis=0)
        best = candidate[best_prime, pair_index]
        group_best = np.minimum.reduceat(best, starts)
        hits = np.flatnonzero(best == group_best[group_of_pair])
        first_groups, first_index = np.unique(group_of_pair[hits], return_index=True)
        chosen = hits[first_index]
        targets = group_j[first_groups]
        values = best[chosen]
        better = values < by_workers[m, targets]
        targets, chosen, values = targets[better], chosen[better], values[better]
        by_workers[m, targets] = values
        split[targets, m] = ks[chosen]
        replicas[targets, m] = best_prime[chosen] + 1
    return RowSolution(by_workers.T.copy(), split, replicas)
