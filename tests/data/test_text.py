"""TextDataModule: windows of a stdlib module's source as tokens, targets shifted by one."""

from __future__ import annotations

import inspect
import textwrap

import pytest
import torch

from pl_pipedream.data.text import VOCAB, TextDataModule


def test_windows_are_the_source_and_targets_are_shifted_by_one() -> None:
    module = TextDataModule(modules=["textwrap"], length=16, num_examples=50)
    inputs, targets = module.tensors()
    assert inputs.shape == targets.shape == (50, 16)
    assert inputs.dtype == torch.long
    source = inspect.getsource(textwrap)
    first = "".join(chr(c) for c in inputs[0].tolist())
    assert first == source[:16]
    assert torch.equal(inputs[:, 1:], targets[:, :-1])
    last = "".join(chr(c) for c in targets[-1].tolist())
    assert source.endswith(last)


def test_every_token_is_in_the_vocabulary() -> None:
    inputs, targets = TextDataModule(length=32, num_examples=200).tensors()
    assert int(inputs.max()) < VOCAB and int(targets.min()) >= 0
    assert TextDataModule().num_classes == VOCAB


def test_the_same_data_in_every_process() -> None:
    first, second = TextDataModule(num_examples=64), TextDataModule(num_examples=64)
    assert all(torch.equal(a, b) for a, b in zip(first.tensors(), second.tensors(), strict=True))


def test_a_window_longer_than_the_text_is_refused() -> None:
    with pytest.raises(ValueError, match=r"length: 100000\).*data.length"):
        TextDataModule(modules=["string"], length=100_000).tensors()
