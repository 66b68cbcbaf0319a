"""One level of PipeDream's DP (planner/dp.py) as data: what the level sees (``LevelCosts``), its
pairs of states (``k`` preceding ``j``) priced once for every row (``LevelPairs``), and the rules
every solver applies to a candidate stage the same way: the memory fit (``fit``, the one place
the solvers apply ``costs.held_bytes``), the replica counts a level admits (``admit``) and the
bytes crossing a stage's cuts (``crossing``). No torch import.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from pl_pipedream.planner.costs import fitting_time, held_bytes, stage_time

__all__ = [
    "LevelCosts",
    "LevelPairs",
    "admit",
    "all_pairs",
    "ancestor_matrix",
    "appended",
    "crossing",
    "first_crossing",
    "fit",
    "fit_pairs",
    "level_pairs",
]

INF = math.inf


@dataclass(frozen=True)
class LevelCosts:
    """What one level of the DP sees: per-state prefix sums and the level's worker counts.

    ``compute[r, j]`` is the time (seconds) of the segment from row ``r`` to state ``j`` on one
    machine of this level (``inf`` where no such segment exists); the other arrays are prefix
    sums over states (index ``j``), in bytes. ``precedes`` is ``ancestor_matrix`` of the states,
    ``pairs`` its ``all_pairs``; ``replicas`` the replica counts a stage may have (None: any).
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
    replicas: tuple[int, ...] | None = None


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


@dataclass(frozen=True)
class LevelPairs:
    """A level's pairs ``(k, j)`` (state ``k`` preceding state ``j``) grouped by ``k``, ``j``
    ascending, priced once for every row: ``stage[r' - 1, p]``, the time of pair ``p`` as a stage
    appended after another on ``r'`` replicas, transfers included, ``stash[p]``, its stashed
    bytes, and ``received[p]``, ``sent[p]``, the bytes crossing its cuts (``crossing``).
    ``starts[k]:starts[k + 1]`` are the pairs of ``k``; a row's pairs are those whose ``k`` lies
    inside its segment (``j`` then does too)."""

    ks: np.ndarray
    js: np.ndarray
    starts: np.ndarray
    stage: np.ndarray
    stash: np.ndarray
    received: np.ndarray
    sent: np.ndarray


def level_pairs(costs: LevelCosts) -> LevelPairs:
    """The pairs of ``costs.pairs`` regrouped by their first state, priced once."""
    count = costs.params.shape[0]
    by_k = np.argsort(costs.pairs[0], kind="stable")
    ks, js = costs.pairs[0][by_k], costs.pairs[1][by_k]
    starts = np.r_[0, np.cumsum(np.bincount(ks, minlength=count))].astype(np.int64)
    max_prime = 1 if costs.straight else max(costs.workers - 1, 1)
    primes = np.arange(1, max_prime + 1, dtype=np.float64)[:, None]
    stage, stash = appended(costs, ks, js, primes)
    # Sorting a row's pairs by j is a radix sort on 16-bit keys.
    narrow = js.astype(np.int16) if count < 2**15 else js
    return LevelPairs(ks, narrow, starts, stage, stash, *crossing(costs, ks, js))


def fit(
    costs: LevelCosts,
    time: np.ndarray,
    stage_bytes: np.ndarray,
    workers_after: int | np.ndarray,
    replicas: int | np.ndarray,
    received: np.ndarray | float,
    sent: np.ndarray | float,
) -> np.ndarray:
    """``time``, infinite where the stage does not fit the level's memory
    (``costs.fitting_time`` of its ``costs.held_bytes``)."""
    if costs.memory is None:
        return time
    held = held_bytes(stage_bytes, workers_after, replicas, received, sent)
    return fitting_time(time, held, costs.memory)


def fit_pairs(
    costs: LevelCosts,
    time: np.ndarray,
    pairs: LevelPairs,
    index: np.ndarray | slice,
    workers_after: int | np.ndarray,
    replicas: int | np.ndarray,
) -> np.ndarray:
    """``fit`` for the stages of ``pairs`` at ``index`` (their stash and the bytes crossing
    their cuts, priced once in ``level_pairs``)."""
    at = pairs.stash[index], pairs.received[index], pairs.sent[index]
    return fit(costs, time, at[0], workers_after, replicas, at[1], at[2])


def crossing(costs: LevelCosts, ks: np.ndarray, js: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The bytes a stage from after state ``ks[p]`` to ``js[p]`` receives and sends (nothing
    after the model's last state)."""
    last = costs.params.shape[0] - 1
    return costs.outputs[ks], np.where(js < last, costs.outputs[js], 0.0)


def first_crossing(costs: LevelCosts) -> tuple[np.ndarray, np.ndarray]:
    """For a row's first stage: ``received[row]`` (nothing from row 0, the model's input) and
    ``sent[j]``, for every row and end state."""
    count = costs.params.shape[0]
    received = np.r_[0.0, costs.outputs]
    sent = np.where(np.arange(count) < count - 1, costs.outputs, 0.0)
    return received, sent


def admit(costs: LevelCosts, time: np.ndarray, replicas: int | np.ndarray) -> np.ndarray:
    """``time``, infinite where ``replicas`` is not a count the level admits."""
    if costs.replicas is None:
        return time
    return np.where(np.isin(replicas, costs.replicas), time, INF)


def appended(
    costs: LevelCosts, ks: np.ndarray, js: np.ndarray, primes: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``stage[r' - 1, p]``: time of a stage from state ``ks[p]`` to ``js[p]`` appended after
    another, on ``r'`` replicas (``primes``), transfers included; and its stashed bytes."""
    seg_params = costs.params[js] - costs.params[ks]
    received = sent = None
    if costs.transfers:
        received = costs.outputs[ks]
        sent = np.where(js < costs.params.shape[0] - 1, costs.outputs[js], 0.0)
    compute = costs.compute[ks + 1, js]
    stage = stage_time(compute, seg_params, primes, costs.bandwidth, 1, received, sent)
    return admit(costs, stage, primes), costs.activations[js] - costs.activations[ks] + seg_params
