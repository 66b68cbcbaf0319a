"""Microbatch slices: every tensor split along dim 0, structures kept, the rest repeated."""

from __future__ import annotations

from collections import namedtuple

import pytest
import torch

from pl_pipedream.core.microbatches import slice_batch


def test_slice_batch_splits_tuples_lists_and_dicts_and_repeats_the_rest() -> None:
    x, y = torch.arange(8.0).reshape(4, 2), torch.arange(4)
    pieces = slice_batch((x, [y, "tag"], {"y": y, "n": 3}), 2)
    assert len(pieces) == 2
    first = pieces[0]
    assert isinstance(first, tuple) and isinstance(first[1], list)
    assert torch.equal(first[0], x[:2]) and torch.equal(first[1][0], y[:2])
    assert first[1][1] == "tag" and first[2]["n"] == 3
    assert torch.equal(pieces[1][2]["y"], y[2:])


Pair = namedtuple("Pair", "inputs targets")


def test_slice_batch_keeps_a_named_tuple() -> None:
    pieces = slice_batch(Pair(torch.zeros(4, 1), torch.arange(4)), 2)
    assert isinstance(pieces[1], Pair) and torch.equal(pieces[1].targets, torch.arange(2, 4))


def test_batch_that_does_not_split_into_microbatches() -> None:
    with pytest.raises(ValueError, match=r"batch size: 5, microbatches: 2\)"):
        slice_batch((torch.zeros(5, 3), torch.zeros(5)), 2)


def test_a_scalar_tensor_does_not_split() -> None:
    with pytest.raises(ValueError, match=r"batch size: 0, microbatches: 1\)"):
        slice_batch(torch.tensor(1.0), 1)


def test_one_microbatch_is_the_batch_itself_checked_alike() -> None:
    """No tensor operation for one microbatch (a fixed cost per step); the batch is still
    checked as any split is."""
    batch = (torch.zeros(4, 3), {"y": torch.arange(4), "tag": "a"})
    assert slice_batch(batch, 1)[0] is batch
    with pytest.raises(ValueError, match=r"batch size: 0, microbatches: 1\)"):
        slice_batch((torch.zeros(4, 3), [torch.zeros(0)]), 1)
