"""Modes side by side on one plan: the figures are each mode's own simulation, and a mode that
cannot serve the counts is left out with its reason."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import SyncMode, build, simulate
from pl_pipedream.schedule.compare import compare, plan_for, render_comparison

CONTIGUOUS = [mode for mode in SyncMode if not mode.chunked]


def timed(p: int) -> Plan:
    plan = Plan.from_balance([1] * p)
    stages = tuple(dataclasses.replace(s, forward_ms=1.0, backward_ms=2.0) for s in plan.stages)
    return dataclasses.replace(plan, stages=stages)


def test_each_row_is_the_modes_own_simulation() -> None:
    plan = timed(4)
    rows = compare(plan, CONTIGUOUS, 4, 8, weight_share=0.5)
    assert [row.sync for row in rows] == CONTIGUOUS
    for row in rows:
        assert row.result == simulate(build(plan, row.sync, 4, 8), weight_share=0.5)
    by_mode = {row.sync: row.result for row in rows}
    flush, zero = by_mode[SyncMode.FLUSH], by_mode[SyncMode.ZERO_BUBBLE]
    assert flush is not None and zero is not None
    assert flush.total_ms == pytest.approx(4 * (8 * 3.0 + 3 * 3.0))  # (p - 1)(F + B)
    assert zero.total_ms == pytest.approx(4 * (8 * 3.0 + 3 * 1.0))  # (p - 1)(F + B - 2W)
    assert zero.peak_in_flight == (4, 4, 4, 4) and max(flush.peak_in_flight) == 4


def test_a_mode_that_cannot_serve_the_counts_is_left_out_with_the_reason() -> None:
    rows = compare(timed(4), ["flush", "2bw"], 1, 2)
    assert rows[0].result is not None and rows[0].skipped is None
    assert rows[1].result is None
    assert rows[1].skipped is not None and "2bw needs at least as many microbatches" in (
        rows[1].skipped
    )
    table = render_comparison(rows)
    assert "2bw             left out: 2bw needs" in table
    assert rows[1].to_dict()["result"] is None


def test_one_line_per_mode_under_the_header() -> None:
    table = render_comparison(compare(timed(2), ["flush", "zero_bubble"], 1, 4))
    lines = table.splitlines()
    assert len(lines) == 3 and lines[0].startswith("mode            ms/minibatch")
    assert lines[1].split() == ["flush", "3.7500", "15.000", "0.200", "0.200", "2", "1"]
    assert lines[2].split() == ["zero_bubble", "3.2500", "13.000", "0.077", "0.077", "2", "1"]


def test_the_modes_of_several_stages_per_rank_run_the_plan_recut() -> None:
    plan = dataclasses.replace(
        timed(4),
        stages=tuple(
            dataclasses.replace(s, nodes=(f"{s.index}a", f"{s.index}b")) for s in timed(4).stages
        ),
    )
    rows = compare(plan, ["interleaved", "zbv"], 2, 8, weight_share=0.5)
    for row in rows:
        assert row.result == simulate(
            build(plan_for(plan, row.sync), row.sync, 2, 8), weight_share=0.5
        )
    interleaved, zbv = (row.result for row in rows)
    assert interleaved is not None and zbv is not None
    assert interleaved.total_ms == pytest.approx(2 * (8 * 3.0 + 3 * 3.0 / 2))  # (p-1)(F+B)/v
    assert zbv.total_ms == pytest.approx(2 * 8 * 3.0 + 3 * 0.5)  # its first fill only
    lines = render_comparison(rows).splitlines()
    assert lines[1].split()[-2:] == ["5.5", "1"]  # 11 chunk activations on rank 0: 5.5 stages
    assert lines[2].split()[-2:] == ["4", "1"]  # 2p chunks: 1F1B's p stages


def test_a_plan_that_cannot_be_recut_leaves_the_chunked_modes_out() -> None:
    rows = compare(timed(4), ["flush", "interleaved"], 1, 4)
    assert rows[0].result is not None
    assert rows[1].skipped is not None and "needs a layer per chunk" in rows[1].skipped
