"""``run_layers``: a layer that cannot take the previous layer's output gets an error naming both
layers, where they ran and what crossed, with torch's error chained; other errors pass as they
are."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pl_pipedream.profile.handoff import HandoffError, describe_value, run_layers


class Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x.sum(1)


def test_a_tuple_the_next_layer_cannot_take_names_both_layers_where_and_what_crossed() -> None:
    layers = nn.Sequential(nn.Linear(6, 8), Pair(), nn.Linear(8, 3))
    with pytest.raises(HandoffError) as caught:
        run_layers(layers, torch.randn(4, 6), "rank 0 (stage 0)")
    assert str(caught.value).startswith(
        "each layer of the pipeline takes the previous layer's output as its one argument, as "
        "in nn.Sequential (layer 2: Linear, after layer 1: Pair, on rank 0 (stage 0); passed: "
        "tuple(Tensor(4, 8) float32, Tensor(4,) float32); TypeError: linear(): argument"
    )
    assert "unpack it inside forward" in str(caught.value)
    assert type(caught.value.__cause__) is TypeError  # torch's own, chained
    assert isinstance(caught.value, TypeError)  # what callers caught before still matches


def test_a_stages_layers_are_named_by_their_index_and_the_first_by_what_fed_it() -> None:
    stage = nn.Sequential(OrderedDict([("3", nn.Linear(8, 3)), ("4", nn.Identity())]))
    pair = (torch.zeros(2, 8), {"mask": torch.ones(2, dtype=torch.bool)})
    before = "layer 2 (the last of stage 0)"
    with pytest.raises(HandoffError) as caught:
        run_layers(stage, pair, "rank 1 (stage 1)", before)
    assert (
        "(layer 3: Linear, after layer 2 (the last of stage 0), on rank 1 (stage 1); passed: "
        "tuple(Tensor(2, 8) float32, dict('mask': Tensor(2,) bool));"
    ) in str(caught.value)
    with pytest.raises(HandoffError, match=r"\(layer 0: Linear, after the pipeline's input, on"):
        run_layers(nn.Sequential(nn.Linear(8, 3)), pair, "rank 0 (stage 0)")


def test_other_errors_and_a_good_chain_pass_as_they_are() -> None:
    layers = nn.Sequential(nn.Linear(6, 8), nn.Linear(6, 3))  # wrong width: a RuntimeError
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        run_layers(layers, torch.randn(4, 6), "rank 0 (stage 0)")
    good = nn.Sequential(nn.Linear(6, 8), nn.Tanh())
    x = torch.randn(4, 6)
    assert torch.equal(run_layers(good, x, "rank 0 (stage 0)"), good(x))


def test_a_value_is_described_by_its_structure_and_shapes() -> None:
    assert describe_value([torch.zeros(2, dtype=torch.int64), None, 3]) == (
        "list(Tensor(2,) int64, None, 3)"
    )
    assert describe_value(tuple(range(8))) == "tuple(0, 1, 2, 3, 4, 5, ... 2 more)"
    assert describe_value(object()) == "a object"
