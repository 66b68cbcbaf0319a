"""``PipelineModule``: its call picks the engine's step by mode, and it holds Fabric's calls
around a pipeline step to their contract (one process, a stand-in engine)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from pl_pipedream.fabric.module import NoAccumulation, PipelineModule


class Engine:
    """Records which of ``Pipeline``'s steps ran, returning a fresh tensor as the engine does."""

    def __init__(self) -> None:
        self.module = nn.Sequential(nn.Linear(2, 2))
        self.device = torch.device("cpu")
        self.calls: list[str] = []

    def train_step(self, batch: Any) -> torch.Tensor:
        self.calls.append("train")
        return torch.tensor(1.0)

    def eval_step(self, batch: Any) -> torch.Tensor:
        self.calls.append("eval")
        return torch.tensor(2.0)

    def predict_step(self, inputs: Any) -> torch.Tensor:
        self.calls.append("predict")
        return inputs


def _module() -> tuple[PipelineModule, Engine]:
    engine = Engine()
    return PipelineModule(engine), engine  # type: ignore[arg-type]


def test_the_call_trains_in_train_mode_evaluates_in_eval_mode_and_predicts_by_keyword() -> None:
    module, engine = _module()
    batch = (torch.zeros(2, 2), torch.zeros(2, 2))
    assert module(batch).item() == 1.0
    module.eval()
    assert module(batch).item() == 2.0
    x = torch.ones(1, 2)
    assert module(inputs=x) is x
    assert engine.calls == ["train", "eval", "predict"]
    assert list(module.parameters()) == list(engine.module.parameters())  # the stage's only


def test_backward_accepts_only_the_newest_training_loss() -> None:
    module, _ = _module()
    with pytest.raises(RuntimeError, match=r"\(tensor: a tensor of shape \[\]\); write loss ="):
        module.accept_backward(torch.tensor(1.0))  # before any training call
    first = module((None, None))
    second = module((None, None))
    module.accept_backward(second)
    with pytest.raises(RuntimeError, match="takes the loss the training call returned"):
        module.accept_backward(first)
    with pytest.raises(RuntimeError, match=r"\(tensor: a tensor of shape \[3\], requires grad\)"):
        module.accept_backward(torch.zeros(3, requires_grad=True))


def test_step_confirms_one_training_call_and_a_loop_that_steps_steps_after_every_call() -> None:
    module, engine = _module()
    with pytest.raises(RuntimeError, match=r"\(training calls since the last step: 0\)"):
        module.confirm_step()
    module((None, None))
    module.confirm_step()
    with pytest.raises(RuntimeError, match=r"\(training calls since the last step: 0\)"):
        module.confirm_step()  # a second step without a training call
    module((None, None))
    with pytest.raises(RuntimeError, match=r"each training call of the pipeline applies its own"):
        module((None, None))  # accumulating: refused before it trains
    assert engine.calls == ["train", "train"]


def test_a_loop_that_never_steps_is_fine_but_a_late_step_after_several_calls_is_refused() -> None:
    module, engine = _module()
    for _ in range(3):
        module((None, None))
    with pytest.raises(RuntimeError, match=r"\(training calls since the last step: 3\)"):
        module.confirm_step()
    assert engine.calls == ["train"] * 3


def test_no_backward_sync_is_refused_naming_microbatches() -> None:
    control = NoAccumulation()
    with control.no_backward_sync(nn.Linear(1, 1), enabled=False):
        pass
    with pytest.raises(RuntimeError, match=r"PipeDreamFabricStrategy\(microbatches=...\)"):
        control.no_backward_sync(nn.Linear(1, 1), enabled=True)
