"""One replica's order: 1F1B as warm-up, steady state and drain; GPipe; updates inserted."""

from __future__ import annotations

from pl_pipedream.schedule import order


def test_one_f_one_b_pieces() -> None:
    minibatches = [0, 2, 4, 6, 8]  # a replica's share under round robin
    assert order.warmup(minibatches, 2) == [("F", 0), ("F", 2)]
    assert order.steady(minibatches, 2) == [
        ("F", 4), ("B", 0), ("F", 6), ("B", 2), ("F", 8), ("B", 4),
    ]  # fmt: skip
    assert order.drain(minibatches, 2) == [("B", 6), ("B", 8)]
    assert order.one_f_one_b(minibatches, 2) == (
        order.warmup(minibatches, 2) + order.steady(minibatches, 2) + order.drain(minibatches, 2)
    )


def test_warmup_longer_than_the_list() -> None:
    assert order.one_f_one_b([0, 1], 5) == [("F", 0), ("F", 1), ("B", 0), ("B", 1)]
    assert order.one_f_one_b([0, 1], 0) == [("F", 0), ("B", 0), ("F", 1), ("B", 1)]


def test_forwards_first() -> None:
    assert order.forwards_first([3, 4, 5]) == [
        ("F", 3), ("F", 4), ("F", 5), ("B", 3), ("B", 4), ("B", 5),
    ]  # fmt: skip


def test_updates_follow_the_last_backward_they_need() -> None:
    tokens = order.one_f_one_b([0, 1, 2, 3], 1)
    per_pair = order.with_updates(tokens, lambda i: i // 2 + 1)
    assert per_pair == [
        ("F", 0), ("F", 1), ("B", 0), ("F", 2), ("B", 1), ("U", 1),
        ("F", 3), ("B", 2), ("B", 3), ("U", 2),
    ]  # fmt: skip


def test_split_one_f_one_b_holds_back_lag_weight_halves() -> None:
    assert order.split_one_f_one_b([0, 1, 2, 3], 1, 0) == [
        ("F", 0), ("F", 1), ("I", 0), ("W", 0), ("F", 2), ("I", 1), ("W", 1),
        ("F", 3), ("I", 2), ("W", 2), ("I", 3), ("W", 3),
    ]  # fmt: skip
    assert order.split_one_f_one_b([0, 1, 2], 0, 2) == [
        ("F", 0), ("I", 0), ("F", 1), ("I", 1), ("F", 2), ("I", 2), ("W", 0), ("W", 1), ("W", 2),
    ]  # fmt: skip
    tokens = order.split_one_f_one_b([4, 5], 1, 1)
    assert sorted(tokens) == sorted([(k, i) for k in "FIW" for i in (4, 5)])


def test_updates_follow_the_last_weight_half() -> None:
    tokens = order.split_one_f_one_b([0, 1], 0, 1)
    assert order.with_updates(tokens, lambda i: 1)[-2:] == [("W", 1), ("U", 1)]
