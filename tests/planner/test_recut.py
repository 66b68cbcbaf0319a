"""A plan of one stage per rank recut into chunks: same ranks, same work per rank."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.recut import recut


def timed() -> Plan:
    plan = Plan.from_balance([2, 3, 3])
    stages = tuple(
        dataclasses.replace(s, forward_ms=1.0 + s.index, backward_ms=2.0, output_bytes=10.0)
        for s in plan.stages
    )
    return dataclasses.replace(plan, stages=stages)


def test_each_rank_keeps_its_work_split_over_its_chunks() -> None:
    plan = timed()
    for placement in ("interleaved", "v"):
        chunked = recut(plan, placement)
        assert chunked.placement == placement and chunked.num_workers == 3
        for rank in range(3):
            mine = chunked.stages_of_rank(rank)
            assert sum(s.forward_ms for s in mine) == pytest.approx(1.0 + rank)
            assert sum(s.backward_ms for s in mine) == pytest.approx(2.0)
        layers = [node for stage in chunked.stages for node in stage.nodes]
        assert layers == [str(i) for i in range(8)]
        assert [len(s.nodes) for s in chunked.stages] == [2, 2, 1, 1, 1, 1]
        assert [s.output_bytes for s in chunked.stages] == [10.0] * 5 + [0.0]


def test_three_chunks_per_rank_interleaved() -> None:
    plan = dataclasses.replace(timed(), stages=Plan.from_balance([3, 3, 3]).stages)
    chunked = recut(plan, "interleaved", 3)
    assert (chunked.chunks_per_rank, chunked.num_stages) == (3, 9)
    assert [s.ranks[0] for s in chunked.stages] == [0, 1, 2] * 3


def test_what_cannot_be_recut_is_refused() -> None:
    with pytest.raises(PlanError, match=r"needs a layer per chunk \(layers: 8, chunks: 12\)"):
        recut(timed(), "interleaved", 4)
    with pytest.raises(PlanError, match=r"\(shape: 2-1, placement: contiguous\); plan with"):
        recut(Plan.from_balance([1, 1], replicas=[2, 1]), "v")
