"""SequenceDataModule: generated token sequences to reverse or copy, padded, seeded."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.data.sequences import PAD, START, SequenceDataModule


def test_targets_reverse_the_real_tokens_and_the_decoder_input_is_shifted() -> None:
    data = SequenceDataModule(num_examples=64, vocab=12, length=7, min_length=3)
    source, decoder_input, target = data.tensors()
    assert source.shape == decoder_input.shape == target.shape == (64, 7)
    for row in range(64):
        count = int((source[row] != PAD).sum())
        assert 3 <= count <= 7
        assert torch.all(source[row, count:] == PAD) and torch.all(source[row, :count] > START)
        assert torch.equal(target[row, :count], source[row, :count].flip(0))
    assert torch.all(decoder_input[:, 0] == START)
    assert torch.equal(decoder_input[:, 1:], target[:, :-1])
    assert (data.input_shape, data.num_classes, data.data_kind) == ((7,), 12, "sequences")


def test_copy_keeps_the_order_and_the_seed_fixes_the_examples() -> None:
    source, _, target = SequenceDataModule(num_examples=16, task="copy").tensors()
    assert torch.equal(source, target)
    again = SequenceDataModule(num_examples=16, task="copy").tensors()[0]
    assert torch.equal(source, again)
    assert not torch.equal(source, SequenceDataModule(num_examples=16, seed=1).tensors()[0])


def test_batches_are_source_decoder_input_and_target() -> None:
    data = SequenceDataModule(num_examples=256, batch_size=8)
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert len(batch) == 3 and all(t.shape == (8, 8) for t in batch)


@pytest.mark.parametrize(
    "settings", [{"task": "sort"}, {"vocab": 2}, {"min_length": 9}, {"min_length": 0}]
)
def test_impossible_settings_are_refused_with_their_values(settings: dict) -> None:
    with pytest.raises(ValueError, match=r"sequences need .*\(task: .*; for example data.task"):
        SequenceDataModule(**settings)
