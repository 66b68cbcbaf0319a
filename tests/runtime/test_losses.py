"""LossBook: the losses a rank knows per batch, the batch mean once complete, replicas sharing."""

from __future__ import annotations

from typing import Any

import pytest
import torch.distributed as dist

from pl_pipedream.runtime.frames import MinibatchLoss
from pl_pipedream.runtime.losses import LossBook
from tests.runtime import distributed


def losses(*pairs: tuple[int, float]) -> tuple[MinibatchLoss, ...]:
    return tuple(MinibatchLoss(i, v) for i, v in pairs)


def test_the_mean_waits_for_every_microbatch_of_the_batch() -> None:
    book = LossBook()
    book.add(1, losses((4, 1.0), (6, 3.0)))  # batch 1 of 4 microbatches: minibatches 4..7
    assert book.mean(1, 4) is None
    book.add(1, losses((5, 2.0), (7, 6.0)))
    assert book.mean(1, 4) == pytest.approx(3.0)
    assert book.mean(0, 4) is None


def test_a_message_carries_what_is_known_in_minibatch_order() -> None:
    book = LossBook()
    book.add(0, losses((1, 0.5), (0, 0.25)))
    book.add(0, losses((1, 0.5)))  # the same loss again changes nothing
    assert book.of(0) == losses((0, 0.25), (1, 0.5))
    assert book.of(3) == ()


def test_old_batches_are_forgotten() -> None:
    book = LossBook()
    for batch in range(3):
        book.add(batch, losses((batch, float(batch))))
    book.forget_before(2)
    assert book.of(0) == book.of(1) == () and book.of(2) == losses((2, 2.0))
    book.clear()
    assert book.of(2) == ()


def _share(rank: int, world: int) -> Any:
    book = LossBook()
    # Two replicas of the last stage: replica r computed minibatches r and r + 2 of batch 0.
    book.add(0, losses((rank, 1.0 + rank), (rank + 2, 3.0 + rank)))
    assert book.mean(0, 4) is None
    book.share(0, 4, dist.group.WORLD)
    return book.of(0), book.mean(0, 4)


@pytest.mark.slow
def test_replicas_share_their_losses_and_agree_on_the_mean() -> None:
    results = distributed.run(2, _share)
    assert {r: status for r, (status, _) in results.items()} == {0: "ok", 1: "ok"}
    expected = losses((0, 1.0), (1, 2.0), (2, 3.0), (3, 4.0))
    for rank in (0, 1):
        assert results[rank][1] == (expected, 2.5)


def test_what_was_logged_travels_with_each_loss_and_is_kept_per_batch() -> None:
    book = LossBook()
    book.add_later(0, 1, 0.5, (("acc", 0.75),))
    book.add(0, (MinibatchLoss(0, 0.25, (("acc", 1.0), ("n", 2.0))),))
    assert book.of(0) == (
        MinibatchLoss(0, 0.25, (("acc", 1.0), ("n", 2.0))),
        MinibatchLoss(1, 0.5, (("acc", 0.75),)),
    )
    assert book.logged(0, 2) == ((("acc", 1.0), ("n", 2.0)), (("acc", 0.75),))
    assert book.logged(1, 2) == ((), ())
    book.add(1, losses((2, 1.0)))
    book.forget_before(1)
    assert book.logged(0, 2) == ((), ())


def _share_logged(rank: int, world: int) -> Any:
    book = LossBook()
    # Replica r computed minibatch r of batch 0; only replica 1's step logged something.
    book.add(0, (MinibatchLoss(rank, 1.0 + rank, (("acc", 0.5),) if rank else ()),))
    book.share(0, 2, dist.group.WORLD)
    nothing = LossBook()  # nothing logged anywhere: no gather
    nothing.add(0, losses((rank, 1.0)))
    nothing.share(0, 2, dist.group.WORLD)
    return book.logged(0, 2), nothing.logged(0, 2)


@pytest.mark.slow
def test_replicas_share_what_their_steps_logged() -> None:
    results = distributed.run(2, _share_logged)
    for rank in (0, 1):
        status, (logged, nothing) = results[rank]
        assert status == "ok"
        assert logged == ((), (("acc", 0.5),)) and nothing == ((), ())
