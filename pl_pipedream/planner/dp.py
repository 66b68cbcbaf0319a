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

__all__ = [
    "LevelCosts",
    "RowSolution",
    "all_pairs",
    "ancestor_matrix",
    "pair_starts",
    "solve_row",
    "to_last",
]

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


def pair_starts(pairs: tuple[np.ndarray, np.ndarray], count: int) -> np.ndarray:
    """``starts[j]:starts[j + 1]`` is the slice of ``pairs`` whose later state is ``j``."""
    return np.r_[0, np.cumsum(np.bincount(pairs[1], minlength=count))].astype(np.int64)


def solve_row(
    costs: LevelCosts,
    row: int,
    limit: np.ndarray | None = None,
    starts: np.ndarray | None = None,
) -> RowSolution:
    """Fill the DP table of one row for every end state and every worker count of the level.

    ``limit[j]`` (optional) says that the caller needs ``time[j, -1]`` only where it is at most
    ``limit[j]``, and that ``limit`` does not grow along the DAG (``limit[j] >= limit[j']`` when
    ``j`` precedes ``j'``). A segment to ``j`` on ``m + 1`` workers takes at least its compute over
    ``m + 1`` (the slowest of stages sharing that compute), so where that bound exceeds
    ``limit[j]`` no split of ``(j, m)`` is tried; such entries keep an over-estimate that is
    itself above the limit, and every entry at or under it is the exact one, chosen with the
    same ties. ``starts`` is ``pair_starts(costs.pairs, ...)``, computed here if not given.
    """
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
    if workers == 1:
        return RowSolution(time, split, replicas)

    # The row's pairs (k, j), grouped by j (groups ordered by the first worker count that needs
    # them when there is a limit), k ascending inside a group; k inside the row's segment and k
    # preceding j put j inside it too.
    if starts is None:
        starts = pair_starts(costs.pairs, count)
    ends = np.flatnonzero(allowed)
    first_m = np.zeros(ends.size, dtype=np.int64)
    if limit is not None:
        bound = base_compute[ends] / (limit[ends] * (1.0 + 1e-9))
        with np.errstate(invalid="ignore"):
            first_m = np.where(
                limit[ends] > 0, np.maximum(np.ceil(bound) - 1.0, 0.0), float(workers)
            )
        first_m = np.minimum(first_m, float(workers)).astype(np.int64)
        keep = first_m < workers
        ends, first_m = ends[keep], first_m[keep]
        order = np.argsort(first_m, kind="stable")
        ends, first_m = ends[order], first_m[order]
    lengths = starts[ends + 1] - starts[ends]
    total = int(lengths.sum())
    if total == 0:
        return RowSolution(time, split, replicas)
    index = np.repeat(starts[ends] - np.cumsum(lengths) + lengths, lengths) + np.arange(total)
    ks, js = costs.pairs[0][index], costs.pairs[1][index]
    pair_m = np.repeat(first_m, lengths)
    if row > 0:
        inside = allowed[ks]
        ks, js, pair_m = ks[inside], js[inside], pair_m[inside]
    if ks.size == 0:
        return RowSolution(time, split, replicas)
    group_starts = np.flatnonzero(np.r_[True, js[1:] != js[:-1]])
    group_j = js[group_starts]
    group_m = pair_m[group_starts]
    max_prime = 1 if costs.straight else workers - 1
    primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
    stage, stash_bytes = _appended(costs, ks, js, primes)
    by_workers = np.ascontiguousarray(time.T)  # by_workers[m, k]
    positions = np.arange(ks.size)
    for m in range(1, workers):
        groups = int(np.searchsorted(group_m, m, side="right"))
        if groups == 0:
            continue
        size = int(group_starts[groups]) if groups < group_starts.size else ks.size
        kk = ks[:size]
        width = min(m, max_prime)
        # candidate[r' - 1, p]: the rest of the pipeline, up to cut k, on m + 1 - r' workers,
        # against the appended stage on r' replicas.
        candidate = np.maximum(by_workers[m - 1 :: -1][:width][:, kk], stage[:width, :size])
        if costs.memory is not None:
            stash = stash_bytes[:size] * np.ceil((workers - (m + 1)) / primes[:width])
            candidate = np.where(stash > costs.memory, INF, candidate)
        if width == 1:
            best_prime = np.zeros(size, dtype=np.int64)
            best = candidate[0]
        else:
            best_prime = np.argmin(candidate, axis=0)
            best = candidate[best_prime, positions[:size]]
        heads = group_starts[:groups]
        group_best = np.minimum.reduceat(best, heads)
        sizes = np.diff(np.r_[heads, size])
        hits = np.where(best == np.repeat(group_best, sizes), positions[:size], size)
        chosen = np.minimum.reduceat(hits, heads)
        targets = group_j[:groups]
        better = group_best < by_workers[m, targets]
        targets, chosen, values = targets[better], chosen[better], group_best[better]
        by_workers[m, targets] = values
        split[targets, m] = ks[chosen]
        replicas[targets, m] = best_prime[chosen] + 1
    return RowSolution(by_workers.T.copy(), split, replicas)


def _appended(
    costs: LevelCosts, ks: np.ndarray, js: np.ndarray, primes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``stage[r' - 1, p]``: time of a stage from state ``ks[p]`` to ``js[p]`` appended after
    another, on ``r'`` replicas (``primes``), transfers included; and its stashed bytes."""
    seg_params = costs.params[js] - costs.params[ks]
    stage = costs.compute[ks + 1, js] + 4 * (primes - 1) * seg_params / (costs.bandwidth * primes)
    stage = stage / primes
    if costs.transfers:
        in_bytes = costs.outputs[ks]
        out_bytes = np.where(js < costs.params.shape[0] - 1, costs.outputs[js], 0.0)
        stage = np.maximum(
            stage, 2.0 * np.maximum(in_bytes, out_bytes) / (costs.bandwidth * primes)
        )
    return stage, costs.activations[js] - costs.activations[ks] + seg_params


def to_last(costs: LevelCosts) -> np.ndarray:
    """``best[row]``: the best time from every row to the last state on all workers of the level.

    Equal to ``solve_row(costs, row).time[-1, -1]`` for every row, but for all rows at once: the
    pipelines that end the model are solved from the end. ``after[m, k]`` is the best time of
    stages covering everything after state ``k`` on exactly ``m`` workers, each priced as an
    appended stage (its memory counting the ``m - r`` workers after it); a row's answer is its
    first stage, priced as ``solve_row`` prices a row's first stage, against ``after`` for the
    rest. Both are minima over the same pipelines of the same per-stage times as ``solve_row``,
    and a maximum or minimum of floats is exact, so the values are identical. Only values: the
    choices (and ties) come from ``solve_row`` when a segment is walked back.
    """
    count = costs.params.shape[0]
    workers = costs.workers
    last = count - 1
    after = np.full((workers, count), INF)
    after[0, last] = 0.0
    max_prime = 1 if costs.straight else workers - 1
    by_k = np.argsort(costs.pairs[0], kind="stable")
    ks, js = costs.pairs[0][by_k], costs.pairs[1][by_k]
    if ks.size and workers > 1:
        primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
        stage, stash_bytes = _appended(costs, ks, js, primes)
        heads = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        for m in range(1, workers):
            width = min(m, max_prime)
            candidate = np.maximum(stage[:width], after[m - 1 :: -1][:width][:, js])
            if costs.memory is not None:
                stash = stash_bytes * np.ceil((m - primes[:width]) / primes[:width])
                candidate = np.where(stash > costs.memory, INF, candidate)
            after[m, ks[heads]] = np.minimum.reduceat(candidate.min(axis=0), heads)
    params = costs.params[None, :] - np.r_[0.0, costs.params][:, None]
    acts = costs.activations[None, :] - np.r_[0.0, costs.activations][:, None]
    allowed = np.vstack([np.ones((1, count), dtype=bool), costs.precedes])
    best = np.full(count + 1, INF)
    for r in range(1, 2 if costs.straight else workers + 1):
        m = r - 1
        allreduce = 4 * m * params / (costs.bandwidth * r) / costs.within
        first = (costs.compute + allreduce) / r
        if costs.memory is not None:
            stashed = math.ceil((workers - r) / r) * (acts + params)
            first = np.where(stashed > costs.memory, INF, first)
        first = np.where(allowed, first, INF)
        best = np.minimum(best, np.maximum(first, after[workers - r]).min(axis=1))
    return best
