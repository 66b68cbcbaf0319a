"""StageCall against torch.func.functional_call: outputs, gradients, ties, restoration, cost."""

from __future__ import annotations

import sys
from collections import OrderedDict

import pytest
import torch
from torch import nn
from torch.func import functional_call

from pl_pipedream.profile.handoff import HandoffError
from pl_pipedream.runtime.functional import ParameterSlots, StageCall


class Tied(nn.Module):
    """A Linear used twice through two names (one Parameter), and a BatchNorm's buffers."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.second = nn.Linear(4, 4)
        self.second.weight = self.first.weight  # tied: "second.weight" is "first.weight"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.norm(self.first(x))))


def _versions(module: nn.Module) -> dict[str, torch.Tensor]:
    """Another weight version: detached leaves with other values, as a stashed snapshot."""
    return {n: (p.detach() * 1.5 + 0.1).requires_grad_() for n, p in module.named_parameters()}


@pytest.mark.parametrize("make", [Tied, lambda: nn.Sequential(nn.Linear(3, 5), nn.ReLU())])
def test_outputs_and_gradients_equal_functional_calls(make) -> None:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    module = make()
    before = list(module.parameters())
    x = torch.randn(6, 4 if isinstance(module, Tied) else 3)
    params = _versions(module)
    expected = functional_call(module, params, (x,))
    want = torch.autograd.grad(expected.square().sum(), list(params.values()))
    got_params = {n: t.detach().clone().requires_grad_() for n, t in params.items()}
    got = StageCall(module)(got_params, x)
    found = torch.autograd.grad(got.square().sum(), list(got_params.values()))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    for a, b in zip(found, want, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # the module keeps its own parameters, untouched, and gets no gradient
    assert all(p.grad is None for p in module.parameters())
    assert all(p is q for p, q in zip(module.parameters(), before, strict=True))


def test_a_parameter_not_given_keeps_the_modules_own_and_a_failure_restores_all() -> None:
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    own = [p.detach().clone() for p in module.parameters()]
    only_first = {"0.weight": torch.zeros(2, 2), "0.bias": torch.ones(2)}
    out = StageCall(module)(only_first, torch.ones(1, 2))
    expected = functional_call(module, only_first, (torch.ones(1, 2),), strict=False)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    with pytest.raises(RuntimeError):
        StageCall(module)(only_first, torch.ones(1, 3))  # wrong width: the forward raises
    for p, q in zip(module.parameters(), own, strict=True):
        assert isinstance(p, nn.Parameter) and torch.equal(p, q)


def _python_calls(fn) -> int:  # type: ignore[no-untyped-def]
    """The Python function calls ``fn()`` makes: a measure of fixed cost that load cannot move."""
    count = [0]

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if event == "call":
            count[0] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return count[0]


def test_a_call_makes_under_half_the_python_calls_of_functional_call() -> None:
    module = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.ReLU()) for _ in range(4)])
    params = _versions(module)
    x = torch.randn(2, 8)
    call = StageCall(module)
    direct = _python_calls(lambda: module(x))  # the forward itself, in both
    ours = _python_calls(lambda: call(params, x)) - direct
    theirs = _python_calls(lambda: functional_call(module, params, (x,))) - direct
    assert ours < 0.5 * theirs, (ours, theirs)


def test_parameter_slots_read_what_named_parameters_gives_from_slots_found_once() -> None:
    """The same pairs in the same order (a tied parameter once, by its first name), read without
    walking the module tree: a parameter replaced in its slot is the one read."""
    module = nn.Sequential(Tied(), nn.Linear(4, 2))
    slots = ParameterSlots(module)
    assert [(n, id(p)) for n, p in slots.named()] == [
        (n, id(p)) for n, p in module.named_parameters()
    ]
    module[1].weight = nn.Parameter(torch.zeros(2, 4))
    assert slots.by_name()["1.weight"] is module[1].weight
    calls: list[str] = []
    original = nn.Module.named_modules

    def counted(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append("named_modules")
        return original(self, *args, **kwargs)

    nn.Module.named_modules = counted  # type: ignore[method-assign]
    try:
        names = list(slots.by_name())
    finally:
        nn.Module.named_modules = original  # type: ignore[method-assign]
    assert calls == []
    assert names == [n for n, _ in module.named_parameters()]


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def test_a_stage_whose_layer_cannot_take_the_one_before_names_both_the_rank_and_the_value() -> None:
    """A stage module as ``core.stage`` cuts it: children named by their pipeline index."""
    stage = nn.Sequential(OrderedDict([("4", nn.Linear(3, 5)), ("5", _Pair()), ("6", nn.ReLU())]))
    module = nn.Sequential(OrderedDict([*stage.named_children(), ("7", nn.Linear(5, 2))]))
    call = StageCall(module, "rank 1 (stage 1)", "layer 3 (the last of stage 0)")
    with pytest.raises(HandoffError) as caught:
        call(_versions(module), torch.ones(2, 3))
    assert "(layer 6: ReLU, after layer 5: _Pair, on rank 1 (stage 1); passed: tuple(" in str(
        caught.value
    )
    assert type(caught.value.__cause__) is TypeError
    assert all(isinstance(p, nn.Parameter) for p in module.parameters())  # put back
    with pytest.raises(
        HandoffError, match=r"layer 4: Linear, after layer 3 \(the last of stage 0\)"
    ):
        call(_versions(module), (torch.ones(2, 3),))
