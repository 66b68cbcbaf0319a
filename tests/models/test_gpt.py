"""CharGPT: a small decoder LM whose head is tied to its token embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.models.gpt import CharGPT


def make(**kwargs: object) -> CharGPT:
    torch.manual_seed(0)
    return CharGPT(input_shape=[12], num_classes=40, width=16, heads=2, **kwargs)  # type: ignore[arg-type]


def test_the_head_is_the_token_embedding() -> None:
    net = make()
    assert net.head.out.weight is net.embed.wte.weight
    names = [n for n, _ in net.named_parameters()]
    assert "head.out.weight" not in names  # one parameter, listed once
    assert {"embed.wte.weight", "head.out.weight"} <= set(net.state_dict())


def test_the_pipeline_is_the_forward() -> None:
    net = make(blocks=3)
    x = torch.randint(0, 40, (3, 12))
    layers = net.configure_pipeline()
    assert isinstance(layers, nn.Sequential) and len(layers) == 3 + 2
    assert torch.equal(layers(x), net(x))
    assert net(x).shape == (3, 12, 40)


def test_attention_is_causal() -> None:
    net = make().eval()
    x = torch.randint(0, 40, (1, 12))
    changed = x.clone()
    changed[0, 7] = (changed[0, 7] + 1) % 40
    before, after = net(x), net(changed)
    assert torch.allclose(before[0, :7], after[0, :7], atol=1e-6)
    assert not torch.allclose(before[0, 7:], after[0, 7:])


def test_training_step_is_next_token_cross_entropy() -> None:
    net = make()
    x, y = torch.randint(0, 40, (2, 12)), torch.randint(0, 40, (2, 12))
    expected = nn.functional.cross_entropy(net(x).reshape(-1, 40), y.reshape(-1))
    assert torch.allclose(net.training_step((x, y), 0), expected)


def test_bad_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match=r"width: 10, heads: 3\)"):
        CharGPT(input_shape=[12], num_classes=40, width=10, heads=3)
