"""Optimizer steps that leave a stashed version's storage alone: plain SGD out of place, equal
bit for bit to torch's in-place step; any other optimizer through a copy."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from pl_pipedream.runtime import update

SGD_OPTIONS = {
    "plain": {},
    "momentum": {"momentum": 0.9},
    "dampening": {"momentum": 0.9, "dampening": 0.3},
    "nesterov": {"momentum": 0.9, "nesterov": True},
    "weight decay": {"momentum": 0.5, "weight_decay": 0.01},
    "maximize": {"momentum": 0.9, "maximize": True},
}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 2))


def _train(make_optimizer, out_of_place: bool, steps: int = 4):  # type: ignore[no-untyped-def]
    """Steps on fixed gradients; every parameter goes to a fresh tensor when ``out_of_place``.
    Returns the final weights, every stored old storage, and the bytes copied."""
    model = _model()
    optimizer = make_optimizer(model.parameters())
    generator = torch.Generator().manual_seed(1)
    kept, copied = [], 0
    for _ in range(steps):
        for param in model.parameters():
            param.grad = torch.randn(param.shape, generator=generator)
        if out_of_place:
            old = {p: p.data for p in model.parameters()}
            values = {p: p.detach().clone() for p in model.parameters()}
            copied += update.step(optimizer, {p: torch.empty_like(p) for p in old})
            kept += [(old[p], values[p]) for p in old]
        else:
            optimizer.step()
    return [p.detach().clone() for p in model.parameters()], kept, copied


@pytest.mark.parametrize("label", list(SGD_OPTIONS))
def test_sgd_out_of_place_equals_torch_bit_for_bit_and_copies_nothing(label: str) -> None:
    options = SGD_OPTIONS[label]

    def make(params):  # type: ignore[no-untyped-def]
        return torch.optim.SGD(params, lr=0.1, **options)

    expected, _, _ = _train(make, out_of_place=False)
    got, kept, copied = _train(make, out_of_place=True)
    assert copied == 0
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    for old, values in kept:  # the storage a stashed version shares was never written
        assert torch.equal(old, values)


def test_other_optimizers_copy_and_step_in_place() -> None:
    def make(params):  # type: ignore[no-untyped-def]
        return torch.optim.Adam(params, lr=0.01)

    expected, _, _ = _train(make, out_of_place=False)
    got, kept, copied = _train(make, out_of_place=True, steps=4)
    size = sum(p.numel() * p.element_size() for p in _model().parameters())
    assert copied == 4 * size
    for a, b in zip(got, expected, strict=True):
        assert torch.equal(a, b)
    for old, values in kept:
        assert torch.equal(old, values)


def test_sgd_with_a_step_hook_takes_the_copy_so_the_hook_runs() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = []
    optimizer.register_step_post_hook(lambda *args: calls.append(1))
    assert not update.has_out_of_place_step(optimizer)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    assert update.step(optimizer, {p: torch.empty_like(p) for p in model.parameters()}) > 0
    assert calls == [1]


def test_an_lr_scheduler_sees_the_out_of_place_step() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    assert update.has_out_of_place_step(optimizer)
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    update.step(optimizer, {p: torch.empty_like(p) for p in model.parameters()})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        scheduler.step()
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.05)


def test_no_new_storage_steps_in_place() -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    pointers = [p.data_ptr() for p in model.parameters()]
    for param in model.parameters():
        param.grad = torch.ones_like(param)
    assert update.step(optimizer, {}) == 0
    assert [p.data_ptr() for p in model.parameters()] == pointers


def test_one_name_for_the_update_protocol() -> None:
    """``Update`` is declared once, in ``runtime/update.py``: no alias beside it (``Apply =
    Callable[...]``) and no second protocol; every module imports that one."""
    import ast
    from pathlib import Path

    package = Path(update.__file__).resolve().parents[1]
    found = []
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            alias = isinstance(node, ast.Assign) and ast.unparse(node.value).startswith(
                "Callable[[dict[str"
            )
            protocol = isinstance(node, ast.ClassDef) and node.name == "Update"
            if alias or protocol:
                found.append(str(path.relative_to(package)))
    assert found == ["runtime/update.py"]
