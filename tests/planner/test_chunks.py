"""The stage-to-rank mappings of several stages per rank, and naming a plan's mapping."""

from __future__ import annotations

from pl_pipedream.planner.chunks import (
    interleaved_ranks,
    placement_of,
    stage_ranks,
    v_ranks,
)


def test_interleaved_puts_stage_s_on_rank_s_mod_p() -> None:
    assert interleaved_ranks(2, 2) == (0, 1, 0, 1)
    assert interleaved_ranks(3, 3) == (0, 1, 2, 0, 1, 2, 0, 1, 2)


def test_a_v_puts_rank_r_on_stages_r_and_2p_minus_1_minus_r() -> None:
    assert v_ranks(3) == (0, 1, 2, 2, 1, 0)
    ranks = v_ranks(4)
    for r in range(4):
        assert [s for s, rank in enumerate(ranks) if rank == r] == [r, 7 - r]


def test_stage_ranks_by_name() -> None:
    assert stage_ranks("interleaved", 2, 3) == interleaved_ranks(2, 3)
    assert stage_ranks("v", 2, 2) == v_ranks(2)
    assert stage_ranks("contiguous", 3, 1) == (0, 1, 2)


def test_placement_of_names_the_mapping() -> None:
    assert placement_of([(0,), (1, 2), (3,)]) == "contiguous"
    assert placement_of([(0,), (1,), (0,), (1,)]) == "interleaved"
    assert placement_of([(0,), (1,), (1,), (0,)]) == "v"
    assert placement_of([(0,), (0,)]) == "interleaved"  # one rank: both coincide


def test_any_other_mapping_has_no_name() -> None:
    assert placement_of([(0,), (1,), (1,)]) is None  # uneven chunks
    assert placement_of([(0,), (0,), (1,), (1,)]) is None  # neither interleaved nor a V
    assert placement_of([(0, 1), (0,)]) is None  # a replicated stage among chunks
    assert placement_of([(0,), (1,), (2,), (0,), (1,), (2,), (2,), (1,), (0,)]) is None
