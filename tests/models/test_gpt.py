"""CharGPT: a small decoder LM whose head is tied to its token embedding."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.core.materialize import EmptyBuild, materialize
from pl_pipedream.models.gpt import Block, CharGPT, Head


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


def test_the_values_are_those_of_gpt2_style_initialisation_in_construction_order() -> None:
    # Built independently of CharGPT's code: both embeddings drawn by nn.Embedding, then redrawn
    # with std 0.02, then the blocks and the head, all from one seeded generator.
    net = make(blocks=3)
    torch.manual_seed(0)
    wte, wpe = nn.Embedding(40, 16), nn.Embedding(12, 16)
    nn.init.normal_(wte.weight, std=0.02)
    nn.init.normal_(wpe.weight, std=0.02)
    blocks = [Block(16, 2) for _ in range(3)]
    head = Head(40, 16)
    expected = {"embed.wte.weight": wte.weight, "embed.wpe.weight": wpe.weight}
    for i, block in enumerate(blocks):
        expected |= {f"blocks.{i}.{n}": t for n, t in block.state_dict().items()}
    expected |= {f"head.{n}": t for n, t in head.state_dict().items() if n != "out.weight"}
    state = net.state_dict()
    assert set(state) == set(expected) | {"head.out.weight"}
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name


@pytest.mark.parametrize("local", [[0], [1, 2], [4], [0, 4]])
def test_an_empty_build_gives_each_stage_the_values_of_the_whole_build(local: list[int]) -> None:
    # The strategy's empty build (configure_model / init_module(empty_init=True)) replays only
    # reset methods: the embeddings' GPT-2 initialisation must be one.
    whole = make(blocks=3)
    torch.manual_seed(0)
    build = EmptyBuild()
    with build.record():
        net = CharGPT(input_shape=[12], num_classes=40, width=16, heads=2, blocks=3)
    layers = net.configure_pipeline()
    materialize(net, layers, local, torch.device("cpu"), build)
    kept = {id(t) for i in local for t in layers[i].parameters()}
    expected = dict(whole.named_parameters())
    compared = 0
    for name, tensor in net.named_parameters():
        assert tensor.is_meta == (id(tensor) not in kept), name
        if id(tensor) in kept:
            assert torch.equal(tensor, expected[name]), name
            compared += 1
    assert compared == len(kept) > 0
    assert net.head.out.weight is net.embed.wte.weight
