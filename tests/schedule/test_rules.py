"""The update rules' arguments: what the checks reject, how they say so, the fewest microbatches."""

from __future__ import annotations

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import CONTIGUOUS_MODES, SyncMode, build, rules

SHAPES = [[1], [1, 1], [1, 1, 1], [1] * 4, [2, 1], [1, 2], [2, 2], [3, 1], [1, 3, 3], [3, 2, 1]]


@pytest.mark.parametrize(
    ("balance", "replicas", "sync", "m", "words"),
    [
        ([1, 1], None, "bogus", 2, "sync must be one of"),
        ([1, 1], [2, 1], "async", 3, "split evenly"),
        ([1, 1, 1], None, "2bw", 2, "as many microbatches per batch as stages"),
        ([1, 1, 1], [1, 3, 3], "2bw", 3, "warm-up count"),
        ([1, 1], None, "async", 0, "positive integer"),
    ],
)
def test_bad_arguments_raise_value_error(
    balance: list[int], replicas: list[int] | None, sync: str, m: int, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        build(Plan.from_balance(balance, replicas=replicas), sync, 2, m)


@pytest.mark.parametrize(
    ("replicas", "sync", "m", "fix"),
    [
        ([2, 1], "async", 3, 4),
        ([3, 2], "flush", 4, 6),
        ([1, 1, 1], "2bw", 2, 3),
        ([1, 3, 3], "2bw", 3, 6),
    ],
)
def test_errors_name_the_users_fix(replicas: list[int], sync: str, m: int, fix: int) -> None:
    """The count to pass, as the strategy's argument and as the command line's flag."""
    plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
    with pytest.raises(ValueError) as error:
        rules.check_arguments(plan, sync, 1, m)
    text = str(error.value)
    assert f"use microbatches={fix} (pl-pipedream simulate" in text
    assert f"--microbatches {fix}" in text
    rules.check_arguments(plan, sync, 1, fix)


def test_check_arguments_returns_the_mode() -> None:
    plan = Plan.from_balance([1, 1])
    for name in CONTIGUOUS_MODES:
        assert rules.check_arguments(plan, name, 1, 2) is SyncMode(name)
        assert rules.check_arguments(plan, SyncMode(name), 1, 2) is SyncMode(name)


@pytest.mark.parametrize("replicas", SHAPES, ids=str)
def test_fewest_microbatches_is_the_smallest_accepted(replicas: list[int]) -> None:
    plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
    for mode in map(SyncMode, CONTIGUOUS_MODES):
        fewest = rules.fewest_microbatches(plan, mode)
        rules.check_arguments(plan, mode, 1, fewest)
        for m in range(1, fewest):
            with pytest.raises(ValueError):
                rules.check_arguments(plan, mode, 1, m)
        assert rules.fewest_microbatches(plan, mode, fewest + 1) > fewest


def test_stash_limits() -> None:
    """async keeps w_s + 1 versions, vertical sync the input stage's w_0 + 1, 2BW two."""
    plan = Plan.from_balance([1] * 4)
    limits = {mode: [rules.stash_limit(plan, mode, s) for s in range(4)] for mode in SyncMode}
    assert limits == {
        SyncMode.ASYNC: [4, 3, 2, 1],
        SyncMode.VERTICAL_SYNC: [4, 4, 4, 4],
        SyncMode.TWO_BW: [2, 2, 2, 2],
        SyncMode.FLUSH: [1, 1, 1, 1],
        SyncMode.GPIPE: [1, 1, 1, 1],
        SyncMode.ZERO_BUBBLE: [1, 1, 1, 1],
        SyncMode.INTERLEAVED: [1, 1, 1, 1],
        SyncMode.ZBV: [1, 1, 1, 1],
    }


def test_weight_lag_keeps_the_input_stages_peak() -> None:
    """zero_bubble holds back w_0 - w_s weight halves; the other modes split nothing."""
    plan = Plan.from_balance([1] * 4)
    assert [rules.weight_lag(plan, SyncMode.ZERO_BUBBLE, s) for s in range(4)] == [0, 1, 2, 3]
    for mode in SyncMode:
        if mode is not SyncMode.ZERO_BUBBLE:
            assert {rules.weight_lag(plan, mode, s) for s in range(4)} == {0}


def test_updates_per_mode() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    assert [rules.num_updates(plan, SyncMode.ASYNC, 3, 4, s) for s in (0, 1)] == [6, 12]
    assert [rules.num_updates(plan, SyncMode.TWO_BW, 3, 4, s) for s in (0, 1)] == [3, 3]
    assert [rules.update_of(plan, SyncMode.ASYNC, 4, 0, i) for i in range(4)] == [1, 1, 2, 2]
    assert [rules.update_of(plan, SyncMode.FLUSH, 4, 0, i) for i in (0, 3, 4)] == [1, 1, 2]


def test_a_mode_runs_the_placement_it_is_built_for() -> None:
    flat = Plan.from_balance([1] * 4)
    chunked = Plan.from_balance([1] * 4, placement="interleaved")
    v_shape = Plan.from_balance([1] * 4, placement="v")
    with pytest.raises(ValueError) as error:
        rules.check_arguments(chunked, "flush", 1, 2)
    assert str(error.value) == (
        "sync='flush' runs plans placed 'contiguous', and this plan is placed 'interleaved' (2 "
        "stage(s) per rank); use pl-pipedream simulate --sync interleaved for this plan, or a "
        "plan placed 'contiguous': Plan.from_balance([...], placement='contiguous')"
    )
    with pytest.raises(ValueError, match=r"placed 'v' \(2 stage\(s\) per rank\); use .* zbv for"):
        rules.check_arguments(v_shape, "zero_bubble", 1, 2)
    with pytest.raises(ValueError, match=r"or planner\.recut\.recut\(plan, 'interleaved'\)$"):
        rules.check_arguments(flat, "interleaved", 1, 2)
    with pytest.raises(
        ValueError, match=r"^sync='zbv' runs plans placed 'v', and this plan is pla"
    ):
        rules.check_arguments(chunked, "zbv", 1, 2)
    assert rules.check_arguments(chunked, "interleaved", 1, 2) is SyncMode.INTERLEAVED
    assert rules.check_arguments(v_shape, "zbv", 1, 1) is SyncMode.ZBV


def test_interleaved_takes_microbatches_in_groups_of_one_per_rank() -> None:
    plan = Plan.from_balance([1] * 6, placement="interleaved", num_ranks=3)
    assert rules.fewest_microbatches(plan, SyncMode.INTERLEAVED) == 3
    assert rules.fewest_microbatches(plan, SyncMode.INTERLEAVED, 4) == 6
    with pytest.raises(
        ValueError,
        match=r"microbatches: 4, ranks: 3\); use microbatches=6",
    ):
        rules.check_arguments(plan, "interleaved", 1, 4)
