"""Linear gradient sums: fused accumulation against plain autograd summed over microbatches."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch
import torch.utils.checkpoint
from torch import nn
from torch.func import functional_call

from pl_pipedream.runtime.linear_sums import (
    FUSED_FROM_ACCELERATOR,
    FUSED_FROM_CPU,
    HeldProducts,
    LinearGradientSums,
    fused_from,
    pays,
)

Forward = Callable[[torch.Tensor], torch.Tensor]
Params = Mapping[str, torch.Tensor]
Grads = dict[str, torch.Tensor | None]

TOLERANCE: dict[torch.dtype, dict[str, Any]] = {
    torch.float32: {"rtol": 1e-6, "atol": 1e-6},
    torch.float64: {"rtol": 1e-12, "atol": 1e-12},
}


class _Twice(nn.Module):
    """One Linear layer applied twice: its weight is used twice in one forward."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 5, dtype=dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(torch.tanh(self.linear(x)))


def _mlp(dtype: torch.dtype, bias: bool = True) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(5, 7, bias=bias, dtype=dtype),
        nn.Tanh(),
        nn.Linear(7, 6, bias=bias, dtype=dtype),
        nn.Tanh(),
        nn.Linear(6, 3, bias=bias, dtype=dtype),
    )


def _inputs(
    num: int, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = True
) -> list[torch.Tensor]:
    return [torch.randn(shape, dtype=dtype).requires_grad_(requires_grad) for _ in range(num)]


def _snapshot(module: nn.Module) -> tuple[Params, Forward]:
    """Detached copies of the parameters, run through ``functional_call`` (as the executor does)."""
    params = {n: p.detach().clone().requires_grad_() for n, p in module.named_parameters()}
    return params, lambda x: functional_call(module, params, (x,))


def _run(
    forward: Forward, params: Params, xs: list[torch.Tensor]
) -> tuple[list[Grads], list[torch.Tensor | None]]:
    """Per microbatch, what ``autograd.grad`` returns for the parameters and for the input."""
    param_grads: list[Grads] = []
    input_grads: list[torch.Tensor | None] = []
    for x in xs:
        loss = forward(x).square().sum()
        wanted = [*params.values(), *([x] if x.requires_grad else [])]
        found = torch.autograd.grad(loss, wanted, allow_unused=True)
        param_grads.append(dict(zip(params, found[: len(params)], strict=True)))
        input_grads.append(found[len(params)] if x.requires_grad else None)
    return param_grads, input_grads


def _captured(sums: LinearGradientSums, tensors: Params, forward: Forward) -> Forward:
    """``forward`` inside ``sums.capture(tensors)``; the backward runs outside, as in a pipeline."""

    def run(x: torch.Tensor) -> torch.Tensor:
        with sums.capture(tensors):
            return forward(x)

    return run


def _summed(param_grads: list[Grads]) -> dict[str, torch.Tensor]:
    """Each parameter's gradients (all given, by plain autograd) summed over microbatches."""
    sums: dict[str, torch.Tensor] = {}
    for grads in param_grads:
        for name, grad in grads.items():
            assert grad is not None, f"plain autograd gave no gradient for {name}"
            sums[name] = sums[name] + grad if name in sums else grad
    return sums


def _assert_close(actual: object, expected: object, dtype: torch.dtype) -> None:
    torch.testing.assert_close(actual, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("functional", [True, False], ids=["functional_call", "module"])
def test_sums_equal_autograd_gradients_summed_over_microbatches(
    dtype: torch.dtype, functional: bool
) -> None:
    torch.manual_seed(0)
    module = _mlp(dtype)
    params, forward = _snapshot(module) if functional else (dict(module.named_parameters()), module)
    xs = _inputs(4, (3, 5), dtype)
    expected, expected_inputs = _run(forward, params, xs)
    sums = LinearGradientSums()
    found, found_inputs = _run(_captured(sums, params, forward), params, xs)
    assert all(grad is None for grads in found for grad in grads.values())
    _assert_close(found_inputs, expected_inputs, dtype)
    assert sums.pending
    _assert_close(sums.take(), _summed(expected), dtype)
    assert not sums.pending


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_next_cycle_starts_new_sums_and_leaves_the_handed_out_ones_alone(
    dtype: torch.dtype,
) -> None:
    torch.manual_seed(1)
    params, forward = _snapshot(_mlp(dtype))
    sums = LinearGradientSums()
    _run(_captured(sums, params, forward), params, _inputs(3, (4, 5), dtype))
    first = sums.take()
    kept = {name: tensor.clone() for name, tensor in first.items()}
    xs = _inputs(2, (4, 5), dtype)
    expected, _ = _run(forward, params, xs)
    _run(_captured(sums, params, forward), params, xs)
    second = sums.take()
    assert all(second[name] is not first[name] for name in params)
    _assert_close(second, _summed(expected), dtype)
    for name, tensor in first.items():  # a receiver may keep what it was handed
        assert torch.equal(tensor, kept[name])


def test_activation_checkpointing_is_not_fused() -> None:
    """Its recomputation in backward would not go through the mode, so the forward does not
    either: the gradients come back from autograd."""
    torch.manual_seed(9)
    layer = torch.nn.Linear(4, 4).double()
    params = dict(layer.named_parameters())
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(layer(x).square().sum(), [x, *params.values()])
    sums = LinearGradientSums()
    with sums.capture(params):
        out = torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=False)
    found = torch.autograd.grad(out.square().sum(), [x, *params.values()])
    assert not sums.pending
    for a, b in zip(found, expected, strict=True):
        assert torch.allclose(a, b)


def test_hooks_that_pass_tensors_through_keep_the_fused_sums() -> None:
    """A pack hook marked ``passes_through`` (the memory meter's) sees the tensors autograd saves
    and the sums are still made in the backward; the same hook unmarked falls back."""
    torch.manual_seed(11)
    layer = torch.nn.Linear(4, 4).double()
    params = dict(layer.named_parameters())
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    expected = torch.autograd.grad(layer(x).square().sum(), [*params.values()])
    for marked in (True, False):
        seen: list[tuple[int, ...]] = []

        def pack(tensor: torch.Tensor, seen: list = seen) -> torch.Tensor:  # type: ignore[type-arg]
            seen.append(tuple(tensor.shape))
            return tensor

        if marked:
            pack.passes_through = True  # type: ignore[attr-defined]
        sums = LinearGradientSums()
        with sums.capture(params), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = layer(x)
        assert (3, 4) in seen  # the input, saved through the hook either way
        grads = torch.autograd.grad(out.square().sum(), [x, *params.values()], allow_unused=True)
        if marked:
            assert grads[1] is None and grads[2] is None  # the weight's went into the sums
            found = sums.take()
            assert torch.allclose(found["weight"], expected[0])
            assert torch.allclose(found["bias"], expected[1])
        else:
            assert not sums.pending
            assert torch.allclose(grads[1], expected[0]) and torch.allclose(grads[2], expected[1])


SHAPES = {
    "inputs with leading dimensions, flattened to rows": (lambda: _mlp(torch.float64), (2, 4, 5)),
    "layers without bias": (lambda: _mlp(torch.float64, bias=False), (4, 5)),
    "a weight used twice in one forward, both uses summed": (lambda: _Twice(torch.float64), (4, 5)),
}


@pytest.mark.parametrize("case", list(SHAPES))
def test_sums_and_input_gradients_equal_autograd(case: str) -> None:
    make, shape = SHAPES[case]
    torch.manual_seed(2)
    params, forward = _snapshot(make())
    xs = _inputs(3, shape, torch.float64)
    expected, expected_inputs = _run(forward, params, xs)
    sums = LinearGradientSums()
    _, found_inputs = _run(_captured(sums, params, forward), params, xs)
    _assert_close(found_inputs, expected_inputs, torch.float64)
    _assert_close(sums.take(), _summed(expected), torch.float64)


def test_an_uncaptured_bias_gets_its_gradient_from_autograd() -> None:
    torch.manual_seed(5)
    params, forward = _snapshot(_mlp(torch.float64))
    weights = {name: tensor for name, tensor in params.items() if name.endswith("weight")}
    xs = _inputs(3, (4, 5), torch.float64)
    expected, _ = _run(forward, params, xs)
    sums = LinearGradientSums()
    found, _ = _run(_captured(sums, weights, forward), params, xs)
    for expected_grads, found_grads in zip(expected, found, strict=True):
        for name in params:
            if name in weights:
                assert found_grads[name] is None
            else:
                _assert_close(found_grads[name], expected_grads[name], torch.float64)
    _assert_close(sums.take(), {name: _summed(expected)[name] for name in weights}, torch.float64)


def test_a_first_layer_whose_input_needs_no_grad_still_sums_its_weights() -> None:
    torch.manual_seed(6)
    params, forward = _snapshot(_mlp(torch.float64))
    xs = _inputs(3, (4, 5), torch.float64, requires_grad=False)
    expected, _ = _run(forward, params, xs)
    sums = LinearGradientSums()
    _run(_captured(sums, params, forward), params, xs)
    _assert_close(sums.take(), _summed(expected), torch.float64)


def test_autograd_grad_skips_layers_that_lead_to_no_requested_tensor() -> None:
    """Only the last layer's tensors are requested: autograd never runs the layers below it."""
    torch.manual_seed(7)
    params, forward = _snapshot(_mlp(torch.float64))
    last = {name: params[name] for name in ("4.weight", "4.bias")}
    sums = LinearGradientSums()
    _run(_captured(sums, params, forward), last, _inputs(2, (4, 5), torch.float64, False))
    assert sorted(sums.take()) == sorted(last)


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("requires_grad", [True, False], ids=["input grad", "no input grad"])
def test_held_products_added_later_equal_the_sums(bias: bool, requires_grad: bool) -> None:
    """A split backward: the backward (asked for the input and the anchor only) holds the
    products; added later, they are the sums autograd's gradients make, and the input's gradient
    is autograd's. The anchor makes autograd run the first layer even where its input needs no
    gradient."""
    torch.manual_seed(12)
    params, forward = _snapshot(_mlp(torch.float64, bias=bias))
    xs = _inputs(3, (2, 4, 5), torch.float64, requires_grad)
    expected, expected_inputs = _run(forward, params, xs)
    sums = LinearGradientSums()
    for k, (x, expected_input) in enumerate(zip(xs, expected_inputs, strict=True)):
        held = HeldProducts()
        with sums.capture(params, held):
            loss = forward(x).square().sum()
        assert held.anchor is not None and not held.products
        wanted = [*([x] if requires_grad else []), held.anchor]
        found = torch.autograd.grad(loss, wanted, allow_unused=True)
        assert found[-1] is None and len(held.products) == 3
        assert sums.pending == (k > 0)  # nothing added before ``add_into``
        if requires_grad:
            _assert_close(found[0], expected_input, torch.float64)
        held.add_into(sums)
        assert not held.products
    _assert_close(sums.take(), _summed(expected), torch.float64)


def test_calls_outside_the_context_are_untouched() -> None:
    torch.manual_seed(8)
    params, forward = _snapshot(_mlp(torch.float32))
    xs = _inputs(2, (4, 5), torch.float32)
    expected = _run(forward, params, xs)
    sums = LinearGradientSums()
    with sums.capture(params):
        pass
    assert _equal(_run(forward, params, xs), expected)
    assert not sums.pending


def test_uncaptured_weights_get_their_gradients_from_autograd() -> None:
    torch.manual_seed(9)
    params, forward = _snapshot(_mlp(torch.float32))
    xs = _inputs(2, (4, 5), torch.float32)
    expected = _run(forward, params, xs)
    sums = LinearGradientSums()
    strangers = {name: tensor.detach().clone().requires_grad_() for name, tensor in params.items()}
    assert _equal(_run(_captured(sums, strangers, forward), params, xs), expected)
    assert not sums.pending


def test_backward_leaves_grad_unset_only_for_captured_parameters() -> None:
    torch.manual_seed(10)
    module = _mlp(torch.float64)
    params = dict(module.named_parameters())
    captured = {name: params[name] for name in ("0.weight", "0.bias")}
    x = torch.randn(4, 5, dtype=torch.float64)
    module(x).square().sum().backward()
    expected = {name: param.grad for name, param in params.items()}
    module.zero_grad(set_to_none=True)
    sums = LinearGradientSums()
    with sums.capture(captured):
        out = module(x)
    out.square().sum().backward()
    found = {name: param.grad for name, param in params.items() if param.grad is not None}
    _assert_close(found, {n: g for n, g in expected.items() if n not in captured}, torch.float64)
    _assert_close(sums.take(), {name: expected[name] for name in captured}, torch.float64)


def test_autocast_falls_back_to_autograd() -> None:
    torch.manual_seed(11)
    params, forward = _snapshot(_mlp(torch.float32))

    def autocast(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return forward(x)

    xs = _inputs(2, (4, 5), torch.float32)
    expected = _run(autocast, params, xs)
    sums = LinearGradientSums()
    found = _run(_captured(sums, params, autocast), params, xs)
    assert not sums.pending
    assert all(grad is not None for grads in found[0] for grad in grads.values())
    assert _equal(found, expected)


def test_no_grad_calls_are_not_fused() -> None:
    params, forward = _snapshot(_mlp(torch.float32))
    sums = LinearGradientSums()
    with torch.no_grad(), sums.capture(params):
        out = forward(torch.randn(4, 5))
    assert not out.requires_grad and not sums.pending


def test_a_sum_that_changes_shape_before_take_is_an_error() -> None:
    sums = LinearGradientSums()
    for rows in (3, 4):
        weight = torch.randn(rows, 2, requires_grad=True)
        with sums.capture({"weight": weight}):
            out = nn.functional.linear(torch.randn(5, 2), weight)
        if rows == 3:
            torch.autograd.grad(out.sum(), [weight], allow_unused=True)
        else:
            with pytest.raises(ValueError, match=r"\(name: weight, .*call take\(\)"):
                torch.autograd.grad(out.sum(), [weight], allow_unused=True)


def _equal(actual: tuple[list[Grads], list], expected: tuple[list[Grads], list]) -> bool:
    """Whether two ``_run`` results hold the same tensors bit for bit (None where None)."""
    pairs = [
        *(
            (found[name], wanted[name])
            for found, wanted in zip(actual[0], expected[0], strict=True)
            for name in wanted
        ),
        *zip(actual[1], expected[1], strict=True),
    ]
    return all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in pairs
    )


def test_a_fused_layer_binds_no_signature_per_call(monkeypatch: pytest.MonkeyPatch) -> None:
    # An autograd.Function with a separate setup_context binds every apply's arguments through
    # inspect.signature: a fixed cost per layer and microbatch that the fused layer avoids.
    import inspect

    module = _mlp(torch.float32)
    params, forward = _snapshot(module)
    sums = LinearGradientSums()
    calls = []
    original = inspect.signature
    monkeypatch.setattr(inspect, "signature", lambda *a, **k: calls.append(a) or original(*a, **k))
    _run(_captured(sums, params, forward), params, _inputs(2, (4, 5), torch.float32))
    assert calls == []
    assert sums.pending  # the three layers were fused


def test_fusing_pays_from_a_two_dimensional_weight_of_the_threshold_size() -> None:
    """Only 2-D weights that require a gradient count (those ``F.linear`` may take); 0 is
    always."""
    small, large = nn.Linear(16, 16), nn.Linear(64, 64)  # 256 and 4096 elements
    assert not pays(small.parameters(), 4096)
    assert pays([*small.parameters(), *large.parameters()], 4096)
    assert not pays([torch.zeros(4096, requires_grad=True)], 4096)  # a bias, a norm's weight
    assert not pays([large.weight.detach()], 4096)  # frozen
    assert pays(small.parameters(), 0) and pays([], 0)


def test_the_default_threshold_is_the_devices() -> None:
    """On a GPU the pass fusing saves is cheaper against the same CPU cost: a larger default.
    A 1024 x 1024 weight pays on CPU and not elsewhere (meta stands in for an accelerator)."""
    assert FUSED_FROM_CPU < 1024 * 1024 < FUSED_FROM_ACCELERATOR <= 4096 * 4096
    assert fused_from(torch.device("cpu")) == FUSED_FROM_CPU
    assert fused_from(torch.device("meta")) == FUSED_FROM_ACCELERATOR
    assert pays([torch.zeros(1024, 1024, requires_grad=True)])
    assert not pays([torch.zeros(1024, 1024, device="meta", requires_grad=True)])
    assert pays([torch.zeros(4096, 4096, device="meta", requires_grad=True)])
