"""The planner's cost model: a stage's time and its memory fit, each written once.

Every solver of the DP (``planner.dp``), the data-parallel baseline (``planner.optimize``) and the
memory report call these; they take floats or numpy arrays alike, so a solver prices a whole
block of candidate stages in one call. PipeDream's optimizer (SOSP'19 3.1):

* time: one stage of compute ``C`` on ``r`` replicas takes ``(C + 4 (r - 1) W / (r B)) / r``,
  ``W`` its parameter bytes all-reduced among the replicas at bandwidth ``B`` (the all-reduce term
  divided by ``within``, the workers of one component of the level, for a stage that spans
  whole components); a stage that receives ``a_in`` bytes and sends ``a_out`` takes at least
  ``2 max(a_in, a_out) / (B r)``, the time to move them.
* memory: a stage on ``r`` replicas with ``n`` workers after it in the pipeline stashes
  ``ceil(n / r)`` minibatches' worth of its weights and activations, and holds the frames of
  the messages in flight on its links: ``f = ceil(n / r) + 1`` activations it sent, ``f + 1``
  gradients it sent back (the minibatches in flight at it and at the stage before it, as on a
  straight pipeline's links, ``schedule.memory.frames_in_flight``), and one receive posted
  ahead each way; it fits when all of that is at most the memory per worker.

The arithmetic is kept in this order so that every caller gets the same bits.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

__all__ = ["fits", "fitting_time", "frame_bytes", "held_bytes", "stage_time", "stashed_bytes"]

Number = Any  # a float, or a numpy array of candidates priced at once


def stage_time(
    compute: Number,
    parameter_bytes: Number,
    replicas: int | np.ndarray,
    bandwidth: float,
    within: int = 1,
    received: Number | None = None,
    sent: Number | None = None,
) -> Number:
    """Seconds per minibatch of a stage on ``replicas`` replicas: compute plus the replicas'
    all-reduce, shared among them; at least the time to move ``received`` and ``sent`` bytes
    when given (a stage appended after a cut)."""
    allreduce = 4 * (replicas - 1) * parameter_bytes / (bandwidth * replicas)
    if within != 1:
        allreduce = allreduce / within
    time = (compute + allreduce) / replicas
    if received is not None and sent is not None:
        time = np.maximum(time, 2.0 * np.maximum(received, sent) / (bandwidth * replicas))
    return time


def stashed_bytes(
    stage_bytes: Number, workers_after: int | np.ndarray, replicas: int | np.ndarray
) -> Number:
    """What a stage stashes: ``ceil(workers_after / replicas)`` minibatches of its weights and
    activations (``stage_bytes``), PipeDream's rule for the minibatches in flight after it."""
    return np.ceil(np.divide(workers_after, replicas)) * stage_bytes


def frame_bytes(
    received: Number, sent: Number, workers_after: int | np.ndarray, replicas: int | np.ndarray
) -> Number:
    """The message frames a stage holds that receives ``received`` bytes per minibatch and
    sends ``sent``: ``f = ceil(workers_after / replicas) + 1`` activations and ``f + 1``
    gradients in flight, and one receive posted ahead on each side."""
    flight = np.ceil(np.divide(workers_after, replicas)) + 1
    return flight * sent + (flight + 1) * received + sent + received


def held_bytes(
    stage_bytes: Number,
    workers_after: int | np.ndarray,
    replicas: int | np.ndarray,
    received: Number = 0.0,
    sent: Number = 0.0,
) -> Number:
    """All a stage holds by the planner's rule: ``stashed_bytes`` plus ``frame_bytes``."""
    stashed = stashed_bytes(stage_bytes, workers_after, replicas)
    return stashed + frame_bytes(received, sent, workers_after, replicas)


def fits(stashed: Number, memory: float | None) -> bool | np.ndarray:
    """Whether a stage holding ``stashed`` bytes (``held_bytes``) fits ``memory`` per worker
    (None: no limit)."""
    return True if memory is None else stashed <= memory


def fitting_time(time: Number, stashed: Number, memory: float | None) -> Number:
    """``time`` where the stage fits ``memory``, infinite where it does not."""
    return time if memory is None else np.where(fits(stashed, memory), time, math.inf)
