"""SyntheticDataModule: each class a random mean image, each example its mean plus noise."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pl_pipedream.data.synthetic import SyntheticDataModule


def class_means(inputs: Tensor, targets: Tensor, num_classes: int) -> Tensor:
    return torch.stack([inputs[targets == c].mean(dim=0) for c in range(num_classes)])


def nearest_mean_accuracy(module: SyntheticDataModule) -> float:
    """Fit class means on the training split, classify the validation split by the nearest."""
    module.setup("fit")
    inputs, targets = module.tensors()
    train = torch.tensor(module.splits["train"].indices)
    val = torch.tensor(module.splits["val"].indices)
    means = class_means(inputs[train], targets[train], module.num_classes).flatten(1)
    guess = torch.cdist(inputs[val].flatten(1), means).argmin(dim=1)
    return (guess == targets[val]).float().mean().item()


def test_shapes_and_types_follow_the_arguments() -> None:
    module = SyntheticDataModule(num_examples=300, input_shape=[3, 4, 5], num_classes=7)
    inputs, targets = module.tensors()
    assert module.input_shape == (3, 4, 5) and module.num_classes == 7
    assert inputs.shape == (300, 3, 4, 5) and inputs.dtype == torch.float32
    assert targets.shape == (300,) and targets.dtype == torch.long
    assert sorted(set(targets.tolist())) == list(range(7))


def test_without_noise_every_example_is_its_class_mean() -> None:
    inputs, targets = SyntheticDataModule(num_examples=200, noise=0.0).tensors()
    for c in range(10):
        members = inputs[targets == c]
        assert len(members) > 0
        assert torch.equal(members, members[:1].expand_as(members))
    means = class_means(inputs, targets, 10).flatten(1)
    assert torch.pdist(means).min() > 1.0  # the means differ


@pytest.mark.parametrize("noise", [0.5, 2.0])
def test_the_noise_around_each_mean_has_the_given_deviation(noise: float) -> None:
    inputs, targets = SyntheticDataModule(num_examples=4000, noise=noise).tensors()
    residuals = inputs - class_means(inputs, targets, 10)[targets]
    assert residuals.std().item() == pytest.approx(noise, rel=0.03)
    assert abs(residuals.mean().item()) < 0.01 * noise


def test_the_seed_fixes_the_data() -> None:
    first, again = SyntheticDataModule(seed=5).tensors(), SyntheticDataModule(seed=5).tensors()
    other = SyntheticDataModule(seed=6).tensors()
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[0], other[0])


def test_default_noise_is_learnable_and_more_noise_is_harder() -> None:
    assert nearest_mean_accuracy(SyntheticDataModule()) > 0.99
    assert nearest_mean_accuracy(SyntheticDataModule(noise=8.0)) < 0.8


def test_the_split_arguments_reach_the_split() -> None:
    module = SyntheticDataModule(
        num_examples=200, batch_size=10, val_fraction=0.1, test_fraction=0.2, shuffle=False
    )
    module.setup("fit")
    assert [len(module.splits[name]) for name in ("train", "val", "test")] == [140, 20, 40]
    assert (module.batch_size, module.shuffle) == (10, False)
    x, y = next(iter(module.train_dataloader()))
    assert x.shape == (10, 1, 8, 8) and y.shape == (10,)
