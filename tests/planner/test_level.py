"""One level of the DP as data (planner/level.py): the antichain DAG as arrays, the pairs priced
once, and the rules every solver applies to a candidate stage (memory fit, admission, bytes
crossing the cuts). The solvers themselves: test_dp.py."""

from __future__ import annotations

import math

import numpy as np

from pl_pipedream.planner.costs import held_bytes
from pl_pipedream.planner.level import (
    admit,
    all_pairs,
    ancestor_matrix,
    crossing,
    first_crossing,
    fit,
    level_pairs,
)
from tests.planner.test_dp import chain_costs

INF = math.inf
DIAMOND = (0b0, 0b1, 0b1, 0b111, 0b1111)  # a; a->b; a->c; (b, c); d


# ----- the antichain DAG as arrays ----------------------------------------------------------


def test_ancestor_matrix_reads_the_bit_sets() -> None:
    matrix = ancestor_matrix(DIAMOND)
    expected = np.zeros((5, 5), dtype=bool)
    for k, j in [(0, 1), (0, 2), (0, 3), (1, 3), (2, 3), (0, 4), (1, 4), (2, 4), (3, 4)]:
        expected[k, j] = True  # k precedes j
    assert matrix.dtype == bool
    assert np.array_equal(matrix, expected)
    assert ancestor_matrix(()).shape == (0, 0)


def test_ancestor_matrix_past_one_byte_of_states() -> None:
    count = 11
    matrix = ancestor_matrix(tuple((1 << j) - 1 for j in range(count)))
    assert np.array_equal(matrix, np.triu(np.ones((count, count), dtype=bool), k=1))


def test_all_pairs_are_grouped_by_the_later_state() -> None:
    ks, js = all_pairs(ancestor_matrix(DIAMOND))
    assert list(zip(ks.tolist(), js.tolist(), strict=True)) == [
        (0, 1),
        (0, 2),
        (0, 3),
        (1, 3),
        (2, 3),
        (0, 4),
        (1, 4),
        (2, 4),
        (3, 4),
    ]


# ----- the rules a candidate stage meets ----------------------------------------------------


def test_a_stage_receives_its_first_states_output_and_sends_its_last_but_the_models_end() -> None:
    costs = chain_costs()  # outputs 5e8, 1e9, 0 (state 2 ends the model)
    received, sent = crossing(costs, np.array([0, 0]), np.array([1, 2]))
    assert received.tolist() == [5e8, 5e8]
    assert sent.tolist() == [1e9, 0.0]
    first_received, first_sent = first_crossing(costs)
    assert first_received.tolist() == [0.0, 5e8, 1e9, 0.0]  # row 0 is the model's input
    assert first_sent.tolist() == [5e8, 1e9, 0.0]


def test_admission_prices_other_replica_counts_infinite() -> None:
    times = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]])
    replicas = np.array([[1.0], [2.0], [3.0]])
    assert np.array_equal(admit(chain_costs(), times, replicas), times)  # any count
    got = admit(chain_costs(replicas=(1, 3)), times, replicas)
    assert got.tolist() == [[1.0, 2.0], [INF, INF], [5.0, 6.0]]


def test_the_fit_applies_the_held_bytes_of_the_cost_model_and_nothing_without_a_limit() -> None:
    time = np.array([1.0, 2.0])
    stash = np.array([1e9, 4e9])
    assert np.array_equal(fit(chain_costs(), time, stash, 1, 1, 5e8, 5e8), time)
    held = held_bytes(stash, 1, 1, 5e8, 5e8)
    limit = float((held[0] + held[1]) / 2)  # the first stage fits, the second does not
    got = fit(chain_costs(memory=limit), time, stash, 1, 1, 5e8, 5e8)
    assert got.tolist() == [1.0, INF]


def test_level_pairs_group_the_pairs_by_their_first_state() -> None:
    pairs = level_pairs(chain_costs())
    assert list(zip(pairs.ks.tolist(), pairs.js.tolist(), strict=True)) == [(0, 1), (0, 2), (1, 2)]
    assert pairs.starts.tolist() == [0, 2, 3, 3]
    assert pairs.received.tolist() == [5e8, 5e8, 1e9]
    assert pairs.sent.tolist() == [1e9, 0.0, 0.0]
