"""PipeDream's DP on one level, against tables worked out by hand.

The model is a chain of three layers (states 0, 1, 2 are the cuts after each) on a level of two
workers joined at 1e9 bytes/s:

    layer           0      1      2
    compute (s)     1      2      3     prefix: 1, 3, 6
    params (bytes)  0      0      2.5e8 prefix: 0, 0, 2.5e8
    output (bytes)  5e8    1e9    0     (what a cut after the layer sends on)
    stash (bytes)   5e8    1.5e9  1.5e9 (prefix of the activations kept for the backward pass)

One stage on r replicas takes (C + 4 (r - 1) W / (r B)) / r; a stage appended after cut k also
pays 2 a(k) / (B r) to receive and, unless it ends the model, 2 a(j) / (B r) to send.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest

from pl_pipedream.planner import optimize
from pl_pipedream.planner.dp import RowSolution, every_row, row_times, solve_row, to_last
from pl_pipedream.planner.level import LevelCosts, all_pairs, ancestor_matrix, level_pairs
from pl_pipedream.profile.graph import Profile

INF = math.inf
CHAIN = (0b0, 0b1, 0b11)  # ancestors of states 0, 1, 2 of a chain


def chain_costs(**changes: object) -> LevelCosts:
    precedes = ancestor_matrix(CHAIN)
    compute = np.array(
        [
            [1.0, 3.0, 6.0],  # row 0: from the model's input
            [INF, 2.0, 5.0],  # row 1: after state 0
            [INF, INF, 3.0],  # row 2: after state 1
            [INF, INF, INF],  # row 3: after state 2 (nothing is left)
        ]
    )
    costs = LevelCosts(
        compute=compute,
        params=np.array([0.0, 0.0, 2.5e8]),
        activations=np.array([5e8, 1.5e9, 1.5e9]),
        outputs=np.array([5e8, 1e9, 0.0]),
        precedes=precedes,
        pairs=all_pairs(precedes),
        workers=2,
        bandwidth=1e9,
        within=1,
        straight=False,
        memory=None,
        transfers=True,
    )
    return dataclasses.replace(costs, **changes)


# ----- one row of the DP --------------------------------------------------------------------


def test_the_first_row_by_hand() -> None:
    """Two workers: layers 0-1 on one, layer 2 on the other (3 s) beats replicating the whole
    model (6 s of compute plus 0.5 s of all-reduce, halved: 3.25 s)."""
    row = solve_row(chain_costs(), 0)
    # time[j, m]: the prefix up to state j on m + 1 workers
    assert row.time[:, 0].tolist() == [1.0, 3.0, 6.0]
    # j = 1: one stage replicated (3 / 2) beats 0 | 1 (layer 1 sends 1e9 bytes: 2 s)
    assert row.time[:, 1].tolist() == pytest.approx([0.5, 1.5, 3.0], rel=1e-15)
    assert row.split[:, 1].tolist() == [-1, -1, 1]
    assert row.replicas[:, 1].tolist() == [2, 2, 1]
    assert row.split[:, 0].tolist() == [-1, -1, -1]
    assert row.replicas[:, 0].tolist() == [1, 1, 1]
    assert row.stages(0, 2, 2) == [(0, 1, 1), (2, 2, 1)]
    assert row.stages(0, 1, 2) == [(0, 1, 2)]


def test_transfers_can_make_replication_win() -> None:
    """With 4e9 bytes out of layer 1 the cut after it costs 8 s; after layer 0 the second
    stage computes 5 s; replicating everything (3.25 s) wins. Ignoring transfers, the cut after
    layer 1 wins again (3 s)."""
    heavy = chain_costs(outputs=np.array([5e8, 4e9, 0.0]))
    row = solve_row(heavy, 0)
    assert row.time[2, 1] == pytest.approx(3.25, rel=1e-15)
    assert (row.split[2, 1], row.replicas[2, 1]) == (-1, 2)
    row = solve_row(dataclasses.replace(heavy, transfers=False), 0)
    assert row.time[2, 1] == 3.0
    assert (row.split[2, 1], row.replicas[2, 1]) == (1, 1)


def test_straight_pipelines_never_replicate() -> None:
    row = solve_row(chain_costs(straight=True), 0)
    assert row.time[:, 0].tolist() == [1.0, 3.0, 6.0]
    # two workers need two stages: none for one layer, 0 | 1 for two (2 s), 01 | 2 for three
    assert row.time[:, 1].tolist() == [INF, 2.0, 3.0]
    assert row.split[:, 1].tolist() == [-1, 0, 1]
    assert row.replicas.max() == 1


def test_memory_rules_out_stages_whose_stash_does_not_fit() -> None:
    """A stage on r of W workers stashes ceil((W - r) / r) x (activations + parameters); the
    last stage and full replication stash nothing. With 1e9 bytes, layers 0-1 (1.5e9) no longer
    fit on one worker of two, so the 3 s plan is gone; replication 3.25 s. Layer 0 alone
    (5e8) would fit but for the frames of its 5e8-byte output (``costs.frame_bytes``: two sent,
    one gradient receive posted)."""
    row = solve_row(chain_costs(memory=1e9), 0)
    assert row.time[:, 0].tolist() == [INF, INF, INF]
    assert solve_row(chain_costs(memory=2e9), 0).time[:, 0].tolist() == [1.0, INF, 6.0]
    assert row.time[2, 1] == pytest.approx(3.25, rel=1e-15)
    assert (row.split[2, 1], row.replicas[2, 1]) == (-1, 2)


def test_the_first_stage_all_reduce_is_divided_by_the_component_size() -> None:
    row = solve_row(chain_costs(within=2, outputs=np.array([5e8, 4e9, 0.0])), 0)
    assert row.time[2, 1] == pytest.approx((6.0 + 0.5 / 2) / 2, rel=1e-15)


def test_an_inner_row_starts_after_its_state() -> None:
    """Row 1 is the segment after state 0: layers 1-2. Nothing ends at state 0 there; layer 2
    alone would wait on layer 1 (2 s) and itself (3 s), worse than replicating both (2.75 s)."""
    row = solve_row(chain_costs(), 1)
    assert row.time[0].tolist() == [INF, INF]
    assert row.time[1].tolist() == pytest.approx([2.0, 1.0], rel=1e-15)
    assert row.time[2].tolist() == pytest.approx([5.0, (5.0 + 4 * 2.5e8 / 2e9) / 2], rel=1e-15)
    assert row.split[:, 1].tolist() == [-1, -1, -1]
    assert row.stages(1, 2, 2) == [(1, 2, 2)]


def test_one_worker_is_one_stage() -> None:
    row = solve_row(chain_costs(workers=1), 0)
    assert row.time.shape == (3, 1)
    assert row.time[:, 0].tolist() == [1.0, 3.0, 6.0]
    assert row.stages(0, 2, 1) == [(0, 2, 1)]


def test_walking_back_the_choices() -> None:
    """Three workers: the last stage starts after state 1 on one worker, the one before it
    after state 0 on one worker, the first is alone."""
    split = np.full((3, 3), -1)
    replicas = np.ones((3, 3), dtype=int)
    split[2, 2], split[1, 1] = 1, 0
    solution = RowSolution(np.zeros((3, 3)), split, replicas)
    assert solution.stages(0, 2, 3) == [(0, 0, 1), (1, 1, 1), (2, 2, 1)]
    replicas[2, 2] = 2  # the last stage replicated twice leaves one worker: state 1 on it
    assert solution.stages(0, 2, 3) == [(0, 1, 1), (2, 2, 2)]


# ----- every row at once: the same times as one row after another ---------------------------


def published_costs(profiles_dir, name: str, **changes: object) -> LevelCosts:
    """Level costs of a published profile's antichain states at 1e9 bytes/s."""
    graph = optimize._graph(Profile.load(profiles_dir / f"{name}.txt"), 4000, "antichain")
    prefix = optimize._prefix(graph)
    precedes = ancestor_matrix(graph.ancestors)
    costs = LevelCosts(
        compute=optimize._base_compute(prefix, precedes),
        params=prefix.params,
        activations=prefix.activations,
        outputs=prefix.outputs,
        precedes=precedes,
        pairs=all_pairs(precedes),
        workers=4,
        bandwidth=1e9,
        within=1,
        straight=False,
        memory=None,
        transfers=True,
    )
    return dataclasses.replace(costs, **changes)


VARIANTS = [
    {},
    {"workers": 2},
    {"workers": 3, "within": 2},
    {"workers": 8},
    {"straight": True},
    {"memory": 2e8},
    {"memory": 1e9, "workers": 8},
    {"transfers": False},
]


@pytest.mark.parametrize("changes", VARIANTS, ids=lambda c: ",".join(map(str, c.items())) or "-")
def test_all_rows_at_once_equal_row_by_row(profiles_dir, changes) -> None:
    """gnmt (99 states, branches): ``every_row`` and ``row_times`` give every row's times on all
    workers and ``to_last`` the column ending the model, bit for bit those of ``solve_row``."""
    costs = published_costs(profiles_dir, "gnmt", **changes)
    pairs = level_pairs(costs)
    rows = costs.compute.shape[0]
    reference = np.array([solve_row(costs, row).time[:, -1] for row in range(rows)])
    assert np.isfinite(reference).sum() > rows  # the comparison is not between infinities
    assert np.array_equal(every_row(costs, pairs), reference)
    assert np.array_equal(to_last(costs), reference[:, -1])
    for row in range(0, rows, 7):
        assert np.array_equal(row_times(costs, row, pairs), reference[row])


def test_all_rows_at_once_on_the_chain_by_hand() -> None:
    """The chain's rows on two workers: row 0 as worked out above (3 s for the whole model),
    row 1 (layers 1-2) 2.75 s, row 2 (layer 2) 1.75 s replicated, row 3 nothing."""
    costs = chain_costs()
    table = every_row(costs, level_pairs(costs))
    assert table[0].tolist() == pytest.approx([0.5, 1.5, 3.0], rel=1e-15)
    assert table[1].tolist() == pytest.approx([INF, 1.0, 2.75], rel=1e-15)
    assert table[2].tolist() == pytest.approx([INF, INF, (3.0 + 0.5) / 2], rel=1e-15)
    assert table[3].tolist() == [INF, INF, INF]
    assert to_last(costs).tolist() == pytest.approx([3.0, 2.75, 1.75, INF], rel=1e-15)
