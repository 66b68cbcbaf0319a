"""DigitsDataModule: scikit-learn's 8x8 digits as (1, 8, 8) images scaled to 0..1, labels 0..9."""

from __future__ import annotations

import sys

import numpy as np
import pytest
import torch
from sklearn.datasets import load_digits

from pl_pipedream.data.digits import DigitsDataModule


def test_the_images_are_the_bundled_digits_scaled_to_one() -> None:
    images, labels = DigitsDataModule().tensors()
    digits = load_digits()
    assert images.shape == (1797, 1, 8, 8) and images.dtype == torch.float32
    assert labels.shape == (1797,) and labels.dtype == torch.long
    np.testing.assert_allclose(images[:, 0].numpy(), digits.images / 16.0, rtol=0, atol=1e-7)
    assert labels.tolist() == digits.target.tolist()
    assert (images.min().item(), images.max().item()) == (0.0, 1.0)
    assert sorted(set(labels.tolist())) == list(range(10))


def test_what_the_model_is_told_matches_the_tensors() -> None:
    module = DigitsDataModule()
    images, labels = module.tensors()
    assert tuple(images.shape[1:]) == module.input_shape == (1, 8, 8)
    assert module.num_classes == 10 == int(labels.max()) + 1


def test_the_split_is_the_same_in_every_process_and_disjoint() -> None:
    first, second = DigitsDataModule(), DigitsDataModule()
    first.setup("fit")
    second.setup("fit")
    assert first.splits["val"].indices == second.splits["val"].indices
    seen = [set(first.splits[name].indices) for name in ("train", "val", "test")]
    assert [len(s) for s in seen] == [1257, 270, 270]  # 15 % of 1797 is 269.55
    assert len(set().union(*seen)) == 1797
    batches = [next(iter(module.train_dataloader())) for module in (first, second)]
    assert torch.equal(batches[0][0], batches[1][0]) and torch.equal(batches[0][1], batches[1][1])
    assert batches[0][0].shape == (64, 1, 8, 8)


def test_without_scikit_learn_the_error_says_what_to_do(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match=r"needs scikit-learn.*data=synthetic"):
        DigitsDataModule().tensors()
