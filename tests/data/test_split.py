"""SplitDataModule: one seeded split, the same batches in every process, full training batches."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pl_pipedream.data.split import SplitDataModule


class Numbered(SplitDataModule):
    """Example i is the number i (label i % 2), so a batch shows which examples it holds."""

    input_shape = (1,)
    num_classes = 2

    def __init__(self, count: int = 100, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.count = count
        self.calls = 0

    def tensors(self) -> tuple[Tensor, Tensor]:
        self.calls += 1
        numbers = torch.arange(self.count)
        return numbers.float().unsqueeze(1), numbers % 2


def ready(**kwargs: object) -> Numbered:
    module = Numbered(**kwargs)  # type: ignore[arg-type]
    module.setup("fit")
    return module


def indices(module: Numbered, name: str) -> list[int]:
    return list(module.splits[name].indices)


def numbers(batches: list) -> list[list[int]]:
    return [x[:, 0].long().tolist() for x, _ in batches]


def test_the_split_sizes_follow_the_fractions() -> None:
    module = ready(count=100, val_fraction=0.15, test_fraction=0.25, batch_size=16)
    assert [len(module.splits[name]) for name in ("train", "val", "test")] == [60, 15, 25]
    every = indices(module, "train") + indices(module, "val") + indices(module, "test")
    assert sorted(every) == list(range(100))  # disjoint and complete


def test_validation_keeps_at_least_one_example_and_test_may_be_empty() -> None:
    module = ready(count=10, val_fraction=0.01, test_fraction=0.0, batch_size=4)
    assert [len(module.splits[name]) for name in ("train", "val", "test")] == [9, 1, 0]


def test_the_split_is_a_seeded_shuffle() -> None:
    first, again, other = ready(seed=3), ready(seed=3), ready(seed=4)
    assert indices(first, "val") == indices(again, "val")
    assert indices(first, "train") == indices(again, "train")
    assert indices(first, "val") != indices(other, "val")
    assert indices(first, "val") != sorted(indices(first, "val"))  # shuffled, not a range


def test_setup_splits_once() -> None:
    module = ready()
    splits = module.splits
    module.setup("validate")
    module.setup("test")
    assert module.splits is splits
    assert module.calls == 1


@pytest.mark.parametrize(
    ("val_fraction", "test_fraction"), [(0.0, 0.1), (-0.1, 0.1), (0.1, -0.1), (0.5, 0.5), (1.0, 0)]
)
def test_bad_fractions_are_refused(val_fraction: float, test_fraction: float) -> None:
    with pytest.raises(
        ValueError,
        match=rf"val_fraction: {val_fraction}, test_fraction: {test_fraction}\)",
    ):
        Numbered(val_fraction=val_fraction, test_fraction=test_fraction)


def test_a_training_split_smaller_than_a_batch_is_refused() -> None:
    module = Numbered(count=100, batch_size=71)
    for _ in range(2):  # a second setup() refuses as well
        with pytest.raises(
            ValueError, match=r"training examples: 70, batch_size: 71\).*data.batch_size"
        ):
            module.setup("fit")
    assert len(ready(count=100, batch_size=70).train_dataloader()) == 1


def test_training_batches_are_full_and_cover_the_split_once() -> None:
    module = ready(count=100, batch_size=32)  # 70 training examples: two batches, 6 left out
    batches = numbers(list(module.train_dataloader()))
    assert [len(batch) for batch in batches] == [32, 32]
    seen = [n for batch in batches for n in batch]
    assert len(set(seen)) == 64 and set(seen) <= set(indices(module, "train"))


def test_every_process_draws_the_same_batches_and_each_epoch_reshuffles() -> None:
    """Two modules stand for two ranks; each iterates its loader twice (two epochs)."""
    epochs = []
    for _ in range(2):
        loader = ready(count=100, batch_size=10, seed=7).train_dataloader()
        epochs.append([numbers(list(loader)), numbers(list(loader))])
    assert epochs[0] == epochs[1]
    first, second = epochs[0]
    assert first != second
    assert sorted(sum(first, [])) == sorted(sum(second, []))


def test_without_shuffle_batches_keep_the_split_order() -> None:
    module = ready(count=100, batch_size=10, shuffle=False)
    order = [n for batch in numbers(list(module.train_dataloader())) for n in batch]
    assert order == indices(module, "train")


def test_evaluation_loaders_keep_order_and_the_last_partial_batch() -> None:
    module = ready(count=100, batch_size=4)  # 15 validation and 15 test examples
    for loader, split in (
        (module.val_dataloader(), "val"),
        (module.test_dataloader(), "test"),
        (module.predict_dataloader(), "test"),
    ):
        batches = numbers(list(loader))
        assert [len(batch) for batch in batches] == [4, 4, 4, 3]
        assert [n for batch in batches for n in batch] == indices(module, split)


def test_labels_travel_with_their_examples() -> None:
    module = ready(count=100, batch_size=10)
    for x, y in module.train_dataloader():
        assert torch.equal(y, x[:, 0].long() % 2)


def test_a_subclass_must_give_the_examples() -> None:
    with pytest.raises(NotImplementedError):
        SplitDataModule().setup("fit")


def test_the_training_loader_resumes_mid_epoch_and_at_an_epoch_end_exactly() -> None:
    """Lightning hands a checkpoint's ``state_dict`` back to a new loader: mid-epoch it draws
    that epoch's order again and skips what was given out; at an epoch's end it goes on with
    the next epoch's order (data.resumable)."""
    whole = ready(count=100, batch_size=10, seed=3).train_dataloader()
    epochs = [numbers(list(whole)) for _ in range(3)]
    loader = ready(count=100, batch_size=10, seed=3).train_dataloader()
    first = numbers(list(loader))
    cut = iter(loader)
    given = [next(cut)[0][:, 0].long().tolist() for _ in range(3)]  # 3 batches of epoch 2
    state = loader.state_dict()
    resumed = ready(count=100, batch_size=10, seed=3).train_dataloader()
    resumed.load_state_dict(state)
    assert [first, given + numbers(list(resumed))] == epochs[:2]
    at_end = ready(count=100, batch_size=10, seed=3).train_dataloader()
    at_end.load_state_dict(resumed.state_dict())  # saved after the whole of epoch 2
    assert numbers(list(at_end)) == epochs[2]
