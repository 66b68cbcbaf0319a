"""DigitsCNN: two conv blocks, then Flatten, Linear + ReLU, Linear; sizes from the input."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.models.cnn import DigitsCNN


def describe(layer: nn.Module) -> tuple[object, ...]:
    if isinstance(layer, nn.Conv2d):
        return ("Conv2d", layer.in_channels, layer.out_channels, layer.kernel_size, layer.padding)
    if isinstance(layer, nn.MaxPool2d):
        return ("MaxPool2d", layer.kernel_size)
    if isinstance(layer, nn.Linear):
        return ("Linear", layer.in_features, layer.out_features)
    return (type(layer).__name__,)


def test_the_layers_on_eight_by_eight_digits() -> None:
    model = DigitsCNN((1, 8, 8), 10)
    assert [describe(layer) for layer in model.configure_pipeline()] == [
        ("Conv2d", 1, 16, (3, 3), (1, 1)),
        ("ReLU",),
        ("MaxPool2d", 2),
        ("Conv2d", 16, 32, (3, 3), (1, 1)),
        ("ReLU",),
        ("MaxPool2d", 2),
        ("Flatten",),
        ("Linear", 32 * 2 * 2, 64),  # two poolings leave a 2x2 map
        ("ReLU",),
        ("Linear", 64, 10),
    ]
    assert model(torch.randn(5, 1, 8, 8)).shape == (5, 10)


@pytest.mark.parametrize(
    ("input_shape", "channels", "flat"),
    [
        ((3, 8, 8), (4, 6), 6 * 2 * 2),
        ((1, 7, 9), (16, 32), 32 * 1 * 2),  # 7 -> 3 -> 1, 9 -> 4 -> 2
        ((2, 16, 16), (4, 4, 8), 8 * 2 * 2),
        ((1, 8, 8), (), 1 * 8 * 8),
    ],
)
def test_the_flattened_size_is_what_the_convolutions_leave(
    input_shape: tuple[int, int, int], channels: tuple[int, ...], flat: int
) -> None:
    model = DigitsCNN(input_shape, 4, channels=channels, hidden=12)
    linears = [layer for layer in model.pipeline if isinstance(layer, nn.Linear)]
    assert [(layer.in_features, layer.out_features) for layer in linears] == [(flat, 12), (12, 4)]
    assert model(torch.randn(2, *input_shape)).shape == (2, 4)


def test_inputs_must_be_images() -> None:
    with pytest.raises(ValueError, match=r"\(channels, height, width\) \(input_shape: \[64\]\)"):
        DigitsCNN([64], 10)


def test_images_too_small_for_the_poolings_are_refused() -> None:
    with pytest.raises(ValueError, match=r"too small for 4 poolings \(input_shape: \[1, 8, 8\]\)"):
        DigitsCNN((1, 8, 8), 10, channels=[4, 4, 4, 4])
    assert DigitsCNN((1, 8, 8), 10, channels=[4, 4, 4])(torch.randn(1, 1, 8, 8)).shape == (1, 10)


def test_the_hyperparameters_rebuild_the_same_model() -> None:
    model = DigitsCNN([1, 8, 8], 10, channels=[4, 8], hidden=16, optimizer="sgd", lr=0.1)
    copy = DigitsCNN(**model.hparams)
    copy.load_state_dict(model.state_dict())
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(copy(x), model(x))
