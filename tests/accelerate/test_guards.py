"""The loop calls a pipeline makes meaningless are refused when made, naming what to do:
``accelerator.backward`` on the pipeline's loss, clipping its gradients, stepping its optimizer
outside ``train_step``; the same calls for anything else reach Accelerate unchanged."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from pl_pipedream.accelerate import guards


def _setup() -> tuple[SimpleNamespace, SimpleNamespace, torch.optim.Optimizer, list]:
    calls: list[Any] = []
    accelerator = SimpleNamespace(
        backward=lambda loss, **kw: calls.append(("backward", loss)),
        clip_grad_norm_=lambda params, max_norm, norm_type=2: calls.append(("norm", params)),
        clip_grad_value_=lambda params, value: calls.append(("value", params)),
    )
    layers = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 1))
    pipeline = SimpleNamespace(layers=layers, updates=SimpleNamespace(stepping=False))
    optimizer = torch.optim.SGD(layers.parameters(), lr=0.1)
    guards.install(accelerator, pipeline, optimizer)  # type: ignore[arg-type]
    return accelerator, pipeline, optimizer, calls


def test_backward_on_the_pipelines_loss_is_refused_naming_train_step() -> None:
    accelerator, _, _, calls = _setup()
    with pytest.raises(
        RuntimeError,
        match=r"^the pipeline's train_step runs the backward passes and the optimizer step "
        r"itself; its loss is detached \(loss: a tensor without grad_fn\); drop "
        r"accelerator.backward\(loss\) and optimizer.step\(\) from the loop",
    ):
        accelerator.backward(torch.tensor(0.5))
    other = (torch.ones(1, requires_grad=True) * 2).sum()
    accelerator.backward(other)  # another model's loss: Accelerate's backward
    assert calls == [("backward", other)]


def test_clipping_the_pipelines_gradients_is_refused() -> None:
    accelerator, pipeline, _, calls = _setup()
    for name in ("clip_grad_norm_", "clip_grad_value_"):
        with pytest.raises(RuntimeError, match=rf"\(accelerator.{name}: over the pipeline's"):
            getattr(accelerator, name)(pipeline.layers.parameters(), 1.0)
    other = [nn.Parameter(torch.ones(1))]
    accelerator.clip_grad_norm_(iter(other), 1.0)
    assert calls == [("norm", other)]


def test_the_optimizer_steps_only_inside_train_step() -> None:
    _, pipeline, optimizer, _ = _setup()
    with pytest.raises(RuntimeError, match=r"\(optimizer: SGD stepped outside train_step\)"):
        optimizer.step()
    pipeline.updates.stepping = True  # what OptimizerUpdate sets around its step
    optimizer.step()
