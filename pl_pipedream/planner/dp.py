"""PipeDream's dynamic program over cuts, replica counts and topology levels (SOSP'19, 3.1).

For one level with ``M`` workers of bandwidth ``B`` the DP computes, for every prefix of the
model that ends at cut ``j`` and every worker count ``m``, the smallest possible time of the
slowest stage of a pipeline over that prefix on exactly ``m`` workers:

* one stage on ``r`` replicas takes ``costs.stage_time`` (compute ``C`` of its layers, plus the
  all-reduce of its ``W`` parameter bytes among the replicas, ``(C + 4 (r - 1) W / (r B)) / r``);
  on the first stage the all-reduce term is divided by the worker count of one component of
  this level, exactly as PipeDream's optimizer does;
* a stage appended after cut ``k`` on ``r`` replicas also pays ``2 a(k) / (B r)`` to receive its
  input and, unless it ends the model, ``2 a(j) / (B r)`` to send its output;
* the pipeline's time is the slowest of those terms;
* with a memory limit, a stage that does not fit it (``costs.fits`` of ``costs.held_bytes``: its
  stash and the frames of its messages in flight) is priced infinite (``fit``, the one place
  the solvers apply the limit).

Rows of the DP are the start of a segment (row 0: the model's input; row ``a + 1``: after state
``a``). The outermost level needs only row 0; an inner level needs every row, because the level
above treats "this segment on one whole component" as one machine.

Ties: among plans whose times agree to a relative ``TIE`` (1e-9: far below any measured
difference, far above float rounding, so that equal layers summed in a different order still
tie) the DP keeps the single stage unless a split is better by more, then takes the lowest
replica count and the earliest cut. With the profiler's equal costs for identical layers
(``profile.alike``) the same model gives the same plan on every run. PipeDream's optimizer breaks
exact ties in the iteration order of Python sets, so on ties the two may print different shapes
of the same time. Inner rows: a segment that starts after state ``a`` may only be split at states
that follow ``a``; PipeDream's optimizer also tries states unrelated to ``a`` (never seen to
change a final answer). docs/planner.md compares the answers with PipeDream's optimizer.

``costs.replicas``, when given, is the only replica counts a level may use (the strategy admits
counts that divide the microbatches per batch); others are priced infinite (``admit``).

``solve_row`` solves one row with its choices (the top level, walking a plan back), pricing a
level's pairs once (``level_pairs``); the inner levels need only times: ``every_row`` solves all
rows at once cut by cut, ``to_last`` the segments that end the model for every row from the end.
All take minima and maxima of the same per-stage floats, so their times are the same bits. The
arithmetic is vectorised with numpy; no torch import.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from pl_pipedream.planner.costs import stage_time
from pl_pipedream.planner.level import (
    LevelCosts,
    LevelPairs,
    admit,
    appended,
    crossing,
    first_crossing,
    fit,
    fit_pairs,
    level_pairs,
)

__all__ = ["RowSolution", "TIE", "every_row", "row_times", "solve_row", "to_last"]

INF = math.inf
TIE = 1e-9  # times within this relative difference are a tie, broken by the fixed rule


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


def solve_row(costs: LevelCosts, row: int, pairs: LevelPairs | None = None) -> RowSolution:
    """Fill the DP table of one row for every end state and every worker count of the level.

    ``pairs`` is ``level_pairs(costs)``, built here when not given (pass it when solving many
    rows of one level).
    """
    count = costs.params.shape[0]
    workers = costs.workers
    allowed = np.ones(count, dtype=bool) if row == 0 else costs.precedes[row - 1]
    split = np.full((count, workers), -1, dtype=np.int64)
    replicas = np.zeros((count, workers), dtype=np.int64)
    single = 1 if costs.straight else workers
    replicas[:, :single] = np.arange(1, single + 1)
    by_workers = _first_stage(costs, row, allowed)  # by_workers[m, k]
    if workers == 1:
        return RowSolution(by_workers.T.copy(), split, replicas)
    if pairs is None:
        pairs = level_pairs(costs)
    index = _inside(pairs, allowed)
    if index.size == 0:
        return RowSolution(by_workers.T.copy(), split, replicas)
    # Grouped by j with k ascending: a stable sort of pairs listed by k.
    index = index[np.argsort(pairs.js[index], kind="stable")]
    ks = pairs.ks[index]
    js = pairs.js[index].astype(np.int64)
    stage = pairs.stage[:, index]
    heads = np.flatnonzero(np.r_[True, js[1:] != js[:-1]])
    targets_all = js[heads]
    sizes = np.diff(np.r_[heads, ks.size])

    max_prime = stage.shape[0]
    primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
    positions = np.arange(ks.size)
    # prefix[m, p]: by_workers[m, ks[p]], gathered once per worker count when it is final.
    prefix = np.empty((workers, ks.size))
    prefix[0] = by_workers[0, ks]
    for m in range(1, workers):
        width = min(m, max_prime)
        # candidate[r' - 1, p]: the rest of the pipeline, up to cut k, on m + 1 - r' workers,
        # against the appended stage on r' replicas.
        candidate = np.maximum(prefix[m - 1 :: -1][:width], stage[:width])
        candidate = fit_pairs(costs, candidate, pairs, index, workers - (m + 1), primes[:width])
        best = candidate[0] if width == 1 else candidate.min(axis=0)
        group_best = np.minimum.reduceat(best, heads)
        hits = np.where(best <= np.repeat(group_best, sizes) * (1 + TIE), positions, ks.size)
        chosen = np.minimum.reduceat(hits, heads)
        # Times stay exact minima (as every solver's); only the choices take ties.
        better = group_best < by_workers[m, targets_all] * (1 - TIE)
        by_workers[m, targets_all] = np.minimum(by_workers[m, targets_all], group_best)
        targets, chosen = targets_all[better], chosen[better]
        split[targets, m] = ks[chosen]
        # The lowest replica count among tied times.
        tied = candidate[:, chosen] <= candidate[:, chosen].min(axis=0) * (1 + TIE)
        replicas[targets, m] = np.argmax(tied, axis=0) + 1
        prefix[m] = by_workers[m, ks]
    return RowSolution(by_workers.T.copy(), split, replicas)


def _first_stage(costs: LevelCosts, row: int, allowed: np.ndarray) -> np.ndarray:
    """``first[m, j]``: one stage from ``row`` to ``j`` on ``m + 1`` replicas (``inf`` where that
    is no segment, does not fit, or is replicated in a straight pipeline)."""
    count = costs.params.shape[0]
    workers = costs.workers
    first = np.full((workers, count), INF)
    base_params = costs.params - (costs.params[row - 1] if row > 0 else 0.0)
    base_acts = costs.activations - (costs.activations[row - 1] if row > 0 else 0.0)
    base_compute = costs.compute[row]
    received, sent = first_crossing(costs)
    for m in range(1 if costs.straight else workers):
        r = m + 1
        value = stage_time(base_compute, base_params, r, costs.bandwidth, costs.within)
        value = fit(costs, value, base_acts + base_params, workers - r, r, received[row], sent)
        value = admit(costs, value, r)
        first[m] = np.where(allowed, value, INF)
    return first


def _inside(pairs: LevelPairs, allowed: np.ndarray) -> np.ndarray:
    """Positions in ``pairs`` of the pairs whose ``k`` is inside a row's segment (``allowed``);
    ``j`` then is too, since ``k`` precedes it."""
    inside = np.flatnonzero(allowed)
    lengths = pairs.starts[inside + 1] - pairs.starts[inside]
    total = int(lengths.sum())
    index = np.repeat(pairs.starts[inside] - np.cumsum(lengths) + lengths, lengths)
    return index + np.arange(total)


def row_times(costs: LevelCosts, row: int, pairs: LevelPairs) -> np.ndarray:
    """``solve_row(costs, row).time[:, -1]`` without the choices, for a level whose rows only
    feed the level above: the same candidates, folded into their end states in any order
    (``minimum.at``, a minimum of floats being exact), so the same values."""
    workers = costs.workers
    allowed = np.ones(costs.params.shape[0], dtype=bool) if row == 0 else costs.precedes[row - 1]
    by_workers = _first_stage(costs, row, allowed)
    index = _inside(pairs, allowed) if workers > 1 else np.zeros(0, dtype=np.int64)
    if index.size == 0:
        return by_workers[-1]
    ks, js = pairs.ks[index], pairs.js[index]
    stage = pairs.stage[:, index]
    max_prime = stage.shape[0]
    primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
    for m in range(1, workers):
        width = min(m, max_prime)
        candidate = np.maximum(by_workers[m - 1 :: -1][:width][:, ks], stage[:width])
        candidate = fit_pairs(costs, candidate, pairs, index, workers - (m + 1), primes[:width])
        np.minimum.at(by_workers[m], js, candidate.min(axis=0) if width > 1 else candidate[0])
    return by_workers[-1]


def to_last(costs: LevelCosts) -> np.ndarray:
    """``best[row]``: the best time from every row to the last state on all workers of the level.

    ``solve_row(costs, row).time[-1, -1]`` for every row at once, solved from the end:
    ``after[m, k]`` is the best time of stages covering everything after state ``k`` on exactly
    ``m`` workers, each priced as an appended stage (its memory counting the ``m - r`` workers
    after it); a row's answer is its first stage against ``after`` for the rest. Same minima
    over the same per-stage times, so the same values; the choices come from ``solve_row``.
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
        stage, stash_bytes = appended(costs, ks, js, primes)
        received, sent = crossing(costs, ks, js)
        heads = np.flatnonzero(np.r_[True, ks[1:] != ks[:-1]])
        rest = np.empty((workers, js.size))  # rest[m, p]: after[m, js[p]]
        rest[0] = after[0, js]
        for m in range(1, workers):
            width = min(m, max_prime)
            candidate = np.maximum(stage[:width], rest[m - 1 :: -1][:width])
            after_it = m - primes[:width]  # the workers after the appended stage
            candidate = fit(costs, candidate, stash_bytes, after_it, primes[:width], received, sent)
            after[m, ks[heads]] = np.minimum.reduceat(candidate.min(axis=0), heads)
            rest[m] = after[m, js]
    best = np.full(count + 1, INF)
    for m, first in _first_stage_tables(costs):
        best = np.minimum(best, np.maximum(first, after[workers - (m + 1)]).min(axis=1))
    return best


def every_row(costs: LevelCosts, pairs: LevelPairs) -> np.ndarray:
    """``table[row] == row_times(costs, row, pairs)`` for every row, computed cut by cut.

    The pairs ``(k, j)`` of cut ``k`` serve every row whose segment contains ``k``. In the
    states' topological order a cut's best times are final for every row when it is reached,
    so its candidates go to all those rows and successors at once as one dense block. Same
    candidates, same minima, same values.
    """
    count = costs.params.shape[0]
    workers = costs.workers
    times = _first_stages(costs)
    if workers == 1:
        return times[0]
    max_prime = pairs.stage.shape[0]
    for k in range(count):
        low, high = int(pairs.starts[k]), int(pairs.starts[k + 1])
        if low == high:
            continue
        rows = np.r_[0, np.flatnonzero(costs.precedes[:, k]) + 1]
        # Flat positions of (row, j) in one worker count's table: 1-D take and put are the
        # fastest gather and scatter numpy has.
        flat = (rows * count)[:, None] + pairs.js[low:high][None, :]
        column = times[:, rows, k]
        for m in range(1, workers):
            best = None
            for prime in range(1, min(m, max_prime) + 1):
                stage = pairs.stage[prime - 1, low:high]
                stage = fit_pairs(costs, stage, pairs, slice(low, high), workers - (m + 1), prime)
                candidate = np.maximum(column[m - prime][:, None], stage[None, :])
                best = candidate if best is None else np.minimum(best, candidate)
            table = times[m]
            assert best is not None  # m >= 1 and max_prime >= 1: one prime at least
            table.put(flat, np.minimum(table.take(flat), best))
    return times[-1]


def _first_stages(costs: LevelCosts) -> np.ndarray:
    """``first[m, row, j]``: ``_first_stage(costs, row, ...)[m, j]`` for every row at once."""
    count = costs.params.shape[0]
    first = np.full((costs.workers, count + 1, count), INF)
    for m, table in _first_stage_tables(costs):
        first[m] = table
    return first


def _first_stage_tables(costs: LevelCosts) -> Iterator[tuple[int, np.ndarray]]:
    """``(m, table)`` with ``table[row, j]`` as ``_first_stage(costs, row, ...)[m, j]``, for
    every worker count a first stage may have, one table at a time."""
    count = costs.params.shape[0]
    workers = costs.workers
    params = costs.params[None, :] - np.r_[0.0, costs.params][:, None]
    allowed = np.vstack([np.ones((1, count), dtype=bool), costs.precedes])
    stash = params
    if costs.memory is not None:
        stash = costs.activations[None, :] - np.r_[0.0, costs.activations][:, None] + params
    received, sent = first_crossing(costs)
    for m in range(1 if costs.straight else workers):
        r = m + 1
        value = stage_time(costs.compute, params, r, costs.bandwidth, costs.within)
        value = fit(costs, value, stash, workers - r, r, received[:, None], sent[None, :])
        value = admit(costs, value, r)
        yield m, np.where(allowed, value, INF)
