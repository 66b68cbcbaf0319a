"""``trees.py``: the walks over nested tensors that every other module calls."""

from __future__ import annotations

import ast
from collections import OrderedDict, namedtuple
from pathlib import Path

import torch

from pl_pipedream.trees import map_tensors, tensors

PACKAGE = Path(__file__).resolve().parents[2] / "pl_pipedream"

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


def test_tensors_come_in_the_walks_order_or_by_key() -> None:
    a, b, c = torch.ones(1), torch.zeros(1), torch.full((1,), 2.0)
    value = {"z": a, "a": [b, "x", (c,)], "m": None}
    assert [t.item() for t in tensors(value)] == [1.0, 0.0, 2.0]
    assert [t.item() for t in tensors(value, sort_keys=True)] == [0.0, 2.0, 1.0]
    assert tensors(Pair(a, 3)) == [a] and tensors(7) == []


# Walks that are not a visit of every tensor: they serialise (boundary), split a batch into
# microbatches (batches), compare two outputs side by side (forward_check), build a hashable key
# (recompute's shapes), or sit in the profile, a layer below the runtime.
OTHER_WALKS = {
    "runtime/boundary.py": {"_describe"},
    "core/microbatches.py": {"slice_batch"},
    "strategy/forward_check.py": {"_difference"},
    "runtime/recompute.py": {"_shapes"},
    "profile/measure.py": {"_tensors", "_map_tensors", "_summarise"},
}


def _walks(path: Path) -> set[str]:
    """Functions of ``path`` that call themselves and test for a tuple, list or dict."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if not isinstance(node, ast.FunctionDef):
            continue
        calls = {
            n.func.id
            for n in ast.walk(node)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
        }
        containers = {"tuple", "list", "dict"} & {
            n.id for n in ast.walk(node) if isinstance(n, ast.Name)
        }
        if node.name in calls and "isinstance" in calls and containers:
            found.add(node.name)
    return found


def test_every_other_module_calls_these_walks_instead_of_its_own() -> None:
    own = {
        str(path.relative_to(PACKAGE)): _walks(path)
        for path in sorted(PACKAGE.rglob("*.py"))
        if path != PACKAGE / "runtime" / "trees.py"
    }
    extra = {name: sorted(walks - OTHER_WALKS.get(name, set())) for name, walks in own.items()}
    assert {name: walks for name, walks in extra.items() if walks} == {}
