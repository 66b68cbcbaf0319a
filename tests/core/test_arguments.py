"""The strategy's plain arguments: each bad one refused with its name and a fix."""

from __future__ import annotations

import pytest

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.core.arguments import (
    check_chunk_options,
    check_placement,
    check_planning_options,
)
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.schedule.modes import SyncMode


def test_good_arguments_pass() -> None:
    PipeDreamStrategy(microbatches=4, start_method="popen", divergence="error", timeout=300)
    PipeDreamStrategy(microbatches=1, start_method="spawn", divergence="off", timeout=0.5)


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        ({"microbatches": 0}, r"must be a positive integer \(microbatches: 0\)"),
        (
            {"microbatches": 2.0},
            r"\(microbatches: 2\.0\); for example PipeDreamStrategy\(microbatches=4\)$",
        ),
        ({"timeout": 0}, r"timeout must be a positive number of seconds \(timeout: 0\)"),
        ({"timeout": "5"}, r"\(timeout: '5'\)"),
        ({"start_method": "thread"}, r"start_method must be 'popen', 'spawn' or 'fork'"),
        ({"divergence": "raise"}, r"divergence must be one of error, strict, warn, off"),
        ({"sync": "fast"}, r"for example PipeDreamStrategy\(sync='flush'\)$"),
        ({"replan": "on"}, r'for example PipeDreamStrategy\(\.\.\., replan="auto"\)$'),
    ],
)
def test_each_bad_argument_is_named_with_a_fix(arguments: dict, message: str) -> None:
    """Checked by the one check of every front end (``engine.arguments.check_options``), each
    fix written as the strategy is."""
    with pytest.raises(ValueError, match=message):
        PipeDreamStrategy(**arguments)


def test_memory_or_a_topology_with_a_layout_given_by_hand_is_refused() -> None:
    # memory= and topology= only serve automatic planning: beside balance= they would go unused
    # without a word (a 1 KiB limit trained a stage of 85 KiB).
    check_planning_options({"memory": None}, [3, 3], None, False)
    check_planning_options({"memory": 1024.0}, None, None, False)
    with pytest.raises(ValueError, match=r"\(memory: 1024 bytes, balance: \[3, 3\]\); leave out"):
        PipeDreamStrategy(memory="1KiB", balance=[3, 3])
    with pytest.raises(ValueError, match=r"\(memory: 2048 bytes, plan: given\)"):
        PipeDreamStrategy(memory=2048, plan=Plan.from_balance([1, 1]))
    with pytest.raises(ValueError, match=r"^topology= only serves .*\(topology: given, balance"):
        PipeDreamStrategy(topology=Topology.flat(2, 1e9), balance=[3, 3])


def test_memory_or_a_topology_with_a_layout_given_by_hand_bound_re_planning() -> None:
    """With ``replan="auto"`` they bound the plans moved to: accepted beside balance=."""
    check_planning_options({"memory": 1024.0}, [3, 3], None, True)
    assert PipeDreamStrategy(memory="1KiB", balance=[3, 3], replan="auto").memory == 1024
    topology = Topology.flat(2, 1e9)
    assert PipeDreamStrategy(topology=topology, balance=[3, 3], replan="auto").topology is topology


@pytest.mark.parametrize(("placement", "mode"), [("interleaved", "interleaved"), ("v", "zbv")])
def test_a_plan_runs_in_the_sync_mode_of_its_placement(placement: str, mode: str) -> None:
    call = "Pipeline(..., sync='{sync}')"
    check_placement(Plan.from_balance([1, 1], replicas=[2, 1]), SyncMode.ASYNC, call)
    chunked = Plan.from_balance([1] * 4, placement=placement)
    check_placement(chunked, SyncMode(mode), call)
    with pytest.raises(ValueError) as error:
        check_placement(chunked, SyncMode.ZERO_BUBBLE, call)
    message = str(error.value)
    assert message.startswith(
        f"sync='zero_bubble' runs plans placed 'contiguous', and this plan is placed "
        f"{placement!r} (2 stage(s) per rank); use Pipeline(..., sync='{mode}') for this plan"
    )


def test_chunks_per_rank_is_checked_at_construction() -> None:
    strategy = PipeDreamStrategy(sync="interleaved", chunks_per_rank=3)
    assert strategy.chunks_per_rank == 3 and PipeDreamStrategy(sync="zbv").chunks_per_rank is None
    with pytest.raises(ValueError, match=r"\(chunks_per_rank: 2, sync: 'flush'\); use Pipe"):
        PipeDreamStrategy(sync="flush", chunks_per_rank=2)
    with pytest.raises(ValueError, match=r"PipeDreamStrategy\(sync='interleaved', chunks_per"):
        PipeDreamStrategy(sync="zbv", chunks_per_rank=3)
    with pytest.raises(ValueError, match=r"at least 2, the stages each rank holds"):
        PipeDreamStrategy(sync="interleaved", chunks_per_rank=1)


def test_chunks_per_rank_must_agree_with_the_layout_given() -> None:
    with pytest.raises(ValueError) as error:
        PipeDreamStrategy(sync="interleaved", chunks_per_rank=3, balance=[1, 1, 1, 1])
    assert str(error.value) == (
        "a balance gives each rank chunks_per_rank stages, so it has a multiple of it "
        "(chunks_per_rank: 3, balance: [1, 1, 1, 1]); give devices x 3 layer counts, or leave "
        "out chunks_per_rank"
    )
    plan = Plan.from_balance([1] * 4, placement="interleaved")  # 2 ranks, 2 stages each
    with pytest.raises(ValueError, match=r"\(chunks_per_rank: 4, plan: 2 per rank\); leave out"):
        PipeDreamStrategy(sync="interleaved", chunks_per_rank=4, plan=plan)
    PipeDreamStrategy(sync="interleaved", chunks_per_rank=2, plan=plan)
    PipeDreamStrategy(sync="interleaved", chunks_per_rank=3, balance=[1] * 6)


def test_memory_with_a_chunked_mode_is_refused() -> None:
    """A chunked plan is cut by compute alone (planner.chunk_plan): a limit would go unfitted."""
    with pytest.raises(ValueError) as error:
        PipeDreamStrategy(sync="zbv", memory="1KiB")
    assert str(error.value) == (
        "memory= is the limit automatic planning fits, and a chunked mode's plan is cut by "
        "compute alone (memory: 1024 bytes, sync: 'zbv'); leave out memory=, or use "
        "PipeDreamStrategy(sync='zero_bubble', memory=...) to plan within it"
    )
    check_chunk_options(SyncMode.FLUSH, None, 1024.0, None, None, False)


def test_a_plan_must_have_the_chunks_per_rank_asked_for() -> None:
    call = "Pipeline(..., sync='{sync}')"
    plan = Plan.from_balance([1] * 6, placement="interleaved", num_ranks=2)  # 3 per rank
    check_placement(plan, SyncMode.INTERLEAVED, call, 3)
    check_placement(plan, SyncMode.INTERLEAVED, call)
    with pytest.raises(ValueError) as error:
        check_placement(plan, SyncMode.INTERLEAVED, call, 2)
    assert str(error.value) == (
        "the plan must give each rank the chunks_per_rank stages asked for (chunks_per_rank: 2, "
        "plan: 6 stages on 2 ranks); give 4 stages (balance= of 4 counts), or chunks_per_rank=3"
    )


def test_a_chunked_mode_with_re_planning_is_refused_when_the_strategy_is_made() -> None:
    """Before any process starts, as ``Pipeline`` refuses it."""
    with pytest.raises(ValueError, match=r"^sync='zbv' keeps the plan it starts with"):
        PipeDreamStrategy(sync="zbv", replan="auto")
