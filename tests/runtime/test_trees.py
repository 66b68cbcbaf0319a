"""``runtime/trees.py``: the walks over nested tensors that every other module calls."""

from __future__ import annotations

from collections import OrderedDict, namedtuple

import torch

from pl_pipedream.runtime.trees import map_tensors

Pair = namedtuple("Pair", "left right")


def test_map_tensors_keeps_every_container_and_the_values_beside_the_tensors() -> None:
    a, b, c = torch.ones(1), torch.zeros(2), torch.arange(3)
    value = {"x": (a, [b, None, 3]), "y": Pair(c, "s"), "z": OrderedDict(w=a)}
    doubled = map_tensors(lambda t: t * 2, value)
    assert type(doubled["y"]) is Pair and type(doubled["z"]) is OrderedDict
    assert doubled["x"][1][1:] == [None, 3] and doubled["y"].right == "s"
    assert torch.equal(doubled["x"][0], a * 2) and torch.equal(doubled["y"].left, c * 2)
    assert torch.equal(map_tensors(torch.neg, a), -a)
    assert map_tensors(torch.neg, "text") == "text"
