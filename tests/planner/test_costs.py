"""The cost model: a stage's time and its memory fit, for scalars and arrays alike."""

from __future__ import annotations

import math

import numpy as np

from pl_pipedream.planner.costs import (
    fits,
    fitting_time,
    frame_bytes,
    held_bytes,
    stage_time,
    stashed_bytes,
)
from pl_pipedream.planner.optimize import data_parallel_time
from pl_pipedream.planner.topology import Topology


def test_a_stage_pays_its_compute_and_its_replicas_all_reduce() -> None:
    assert stage_time(6.0, 100.0, 1, 10.0) == 6.0  # no replicas, no all-reduce
    # (6 + 4 (2 - 1) 100 / (2 x 10)) / 2 = (6 + 20) / 2
    assert stage_time(6.0, 100.0, 2, 10.0) == 13.0
    assert stage_time(6.0, 100.0, 2, 10.0, within=4) == (6.0 + 5.0) / 2


def test_an_appended_stage_takes_at_least_its_transfers() -> None:
    assert stage_time(1.0, 0.0, 1, 10.0, received=50.0, sent=20.0) == 10.0  # 2 x 50 / 10
    assert stage_time(20.0, 0.0, 1, 10.0, received=50.0, sent=20.0) == 20.0


def test_arrays_of_replica_counts_give_the_scalar_answers_bit_for_bit() -> None:
    replicas = np.arange(1, 6, dtype=np.float64)[:, None]
    compute, params = np.array([1.5, 3.25]), np.array([7e6, 1.3e8])
    block = stage_time(compute, params, replicas, 1.25e9, 1, np.array([1e6, 0.0]), np.zeros(2))
    for r in range(1, 6):
        for p in range(2):
            one = stage_time(compute[p], params[p], r, 1.25e9, 1, [1e6, 0.0][p], 0.0)
            assert block[r - 1, p] == one


def test_a_stage_stashes_one_minibatch_per_replica_round_of_the_workers_after_it() -> None:
    assert stashed_bytes(10.0, 0, 1) == 0.0  # the last stage stashes nothing beyond its own
    assert stashed_bytes(10.0, 3, 1) == 30.0
    assert stashed_bytes(10.0, 3, 2) == 20.0  # ceil(3 / 2)
    after = np.array([3.0, 2.0, 1.0])
    assert list(stashed_bytes(10.0, after, np.array([2.0, 2.0, 2.0]))) == [20.0, 10.0, 10.0]


def test_a_stage_fits_up_to_the_memory_and_else_costs_infinite_time() -> None:
    assert fits(10.0, None) and fits(10.0, 10.0) and not fits(10.5, 10.0)
    times = fitting_time(np.array([1.0, 2.0]), np.array([5.0, 15.0]), 10.0)
    assert list(times) == [1.0, math.inf]


def test_data_parallel_is_one_stage_on_every_worker_of_each_level() -> None:
    topology = Topology.from_lists([4, 2], [1e10, 1.25e9])
    inner = stage_time(8.0, 1e8, 4, 1e10)
    assert data_parallel_time(8.0, 1e8, topology) == stage_time(inner, 1e8, 2, 1.25e9, 4)


def test_a_stage_holds_the_frames_of_its_messages_in_flight() -> None:
    # 3 workers after, no replicas: 4 activations sent and 5 gradients sent back in flight (the
    # minibatches in flight at it and at the stage before it), one receive posted each way
    assert frame_bytes(10.0, 100.0, 3, 1) == 4 * 100.0 + 5 * 10.0 + 100.0 + 10.0
    assert frame_bytes(0.0, 0.0, 3, 1) == 0.0  # a stage that exchanges nothing
    assert frame_bytes(10.0, 0.0, 0, 1) == 2 * 10.0 + 10.0  # the last stage sends no activation
    assert held_bytes(7.0, 3, 1, 10.0, 100.0) == stashed_bytes(7.0, 3, 1) + 560.0
    block = held_bytes(np.array([7.0, 8.0]), np.array([3.0, 1.0]), 2, np.ones(2), np.ones(2))
    assert block.tolist() == [held_bytes(7.0, 3, 2, 1.0, 1.0), held_bytes(8.0, 1, 2, 1.0, 1.0)]
