"""MLP: Flatten, then a Linear and a ReLU per hidden width, then a Linear scoring the classes."""

from __future__ import annotations

import torch
from torch import nn

from pl_pipedream.models.mlp import MLP


def layers(model: MLP) -> list[tuple[str, ...]]:
    out = []
    for layer in model.configure_pipeline():
        if isinstance(layer, nn.Linear):
            out.append(("Linear", layer.in_features, layer.out_features))
        else:
            out.append((type(layer).__name__,))
    return out


def test_every_linear_and_relu_is_its_own_layer() -> None:
    model = MLP((1, 8, 8), 10, hidden=[32, 16])
    assert layers(model) == [
        ("Flatten",),
        ("Linear", 64, 32),
        ("ReLU",),
        ("Linear", 32, 16),
        ("ReLU",),
        ("Linear", 16, 10),
    ]
    parameters = sum(p.numel() for p in model.parameters())
    assert parameters == (64 * 32 + 32) + (32 * 16 + 16) + (16 * 10 + 10)


def test_the_defaults_and_no_hidden_layer() -> None:
    assert [layer[1:] for layer in layers(MLP((3, 4), 5)) if layer[0] == "Linear"] == [
        (12, 128),
        (128, 128),
        (128, 64),
        (64, 5),
    ]
    assert layers(MLP((3, 4), 5, hidden=[])) == [("Flatten",), ("Linear", 12, 5)]


def test_forward_scores_each_example() -> None:
    model = MLP((1, 8, 8), 10, hidden=[8])
    x = torch.randn(5, 1, 8, 8)
    manual = x.flatten(1)
    for layer in model.pipeline[1:]:
        manual = layer(manual)
    assert model(x).shape == (5, 10)
    assert torch.allclose(model(x), manual)


def test_the_hyperparameters_rebuild_the_same_model() -> None:
    """What a checkpoint keeps (``hparams``) is enough to build the model again."""
    model = MLP([1, 8, 8], 10, hidden=[8, 4], optimizer="sgd", lr=0.5, momentum=0.9)
    copy = MLP(**model.hparams)
    copy.load_state_dict(model.state_dict())
    assert layers(copy) == layers(model)
    assert (copy.optimizer_name, copy.lr, copy.momentum) == ("sgd", 0.5, 0.9)
    x = torch.randn(3, 1, 8, 8)
    assert torch.equal(copy(x), model(x))
