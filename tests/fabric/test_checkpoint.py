"""``loop_state`` / ``restore``: the loop's own entries of ``fabric.save``'s state, beside the
pipeline's module and optimizer (which the engine's sharded checkpoint holds)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.fabric.checkpoint import loop_state, restore


class Counter:
    def __init__(self, value: int = 0) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, state: dict) -> None:
        self.value = state["value"]


def test_the_loop_state_leaves_the_pipelines_objects_out_and_converts_the_rest() -> None:
    module, optimizer = nn.Linear(1, 1), object()
    other = nn.Linear(1, 1)
    state = {"model": module, "opt": optimizer, "step": 3, "counter": Counter(5), "ema": other}
    saved = loop_state(state, [module, optimizer])
    assert saved.keys() == {"step", "counter", "ema"}
    assert saved["step"] == 3 and saved["counter"] == {"value": 5}
    assert torch.equal(saved["ema"]["weight"], other.weight)


def test_saving_without_the_pipelines_module_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(state keys: \['step'\]\); write fabric.save\(path"):
        loop_state({"step": 1}, [nn.Linear(1, 1)])


def test_restore_fills_the_state_and_returns_what_it_did_not_ask_for() -> None:
    module = nn.Linear(1, 1)
    counter = Counter()
    state = {"model": module, "step": 0, "counter": counter}
    saved = {"step": 4, "counter": {"value": 7}, "epoch": 1}
    assert restore(state, saved, [module], strict=True) == {"epoch": 1}
    assert state["step"] == 4 and counter.value == 7 and state["model"] is module


def test_restore_refuses_a_missing_entry_unless_not_strict() -> None:
    module = nn.Linear(1, 1)
    with pytest.raises(KeyError, match=r"missing: \['step'\]"):
        restore({"model": module, "step": 0}, {}, [module], strict=True)
    state = {"model": module, "step": 0}
    assert restore(state, {}, [module], strict=False) == {}
    assert state["step"] == 0
