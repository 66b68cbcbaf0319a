"""Batches in the pipeline: microbatch slices, the first stage's input, ``self(x)`` on the last."""

from __future__ import annotations

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from pl_pipedream.strategy.batches import (
    TrainingBatch,
    first_stage_input,
    forward_returns,
    shape_forward,
)


class Split(nn.Module):
    def pipeline_split_batch(self, batch: dict) -> tuple:
        return batch["image"], batch["label"]


def test_first_stage_input_follows_one_rule() -> None:
    x, y = torch.zeros(2, 3), torch.ones(2)
    assert first_stage_input(Split(), {"image": x, "label": y}) is x
    assert first_stage_input(nn.Identity(), (x, y)) is x
    assert first_stage_input(nn.Identity(), [x, y]) is x
    assert first_stage_input(nn.Identity(), x) is x


def test_a_dict_without_pipeline_split_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(got: dict\); .* define pipeline_split_batch"):
        first_stage_input(nn.Identity(), {"image": torch.zeros(2, 3)})


class Regression(LightningModule):
    """``training_step`` as a user writes it: ``self(x)``, then the loss."""

    def __init__(self, returns: str = "loss") -> None:
        super().__init__()
        self.layer = nn.Linear(3, 1)
        self.returns = returns

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the pipeline's output stands in for forward on the last stage")

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = ((self(x) - y) ** 2).mean()
        if self.returns == "dict":
            return {"loss": loss}
        if self.returns == "float":
            return float(loss)
        if self.returns == "nan":
            return loss * float("nan")
        return loss


def _attached(module: LightningModule) -> LightningModule:
    module.trainer = Trainer(accelerator="cpu", devices=1, logger=False, barebones=True)
    return module


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    return torch.arange(8.0).reshape(4, 2), torch.tensor([[1.0], [2.0], [3.0], [4.0]])


def test_training_batch_gives_each_microbatchs_inputs() -> None:
    batch = _batch()
    work = TrainingBatch(Regression(), batch, 0, 2, "rank 0 (stage 0)")
    assert torch.equal(work.inputs(1), batch[0][2:])


@pytest.mark.parametrize("returns", ["loss", "dict"])
def test_loss_runs_training_step_with_self_x_returning_the_output(returns: str) -> None:
    batch = _batch()
    work = TrainingBatch(_attached(Regression(returns)), batch, 7, 2, "rank 1 (stage 1)")
    output = torch.tensor([[1.0], [5.0]])  # microbatch 1 has targets 3 and 4
    loss = work.loss(output, 1)
    assert loss.item() == pytest.approx(((1.0 - 3.0) ** 2 + (5.0 - 4.0) ** 2) / 2)
    assert "forward" not in vars(work.module)  # the module's own forward is back


def test_loss_must_be_a_tensor() -> None:
    work = TrainingBatch(_attached(Regression("float")), _batch(), 0, 2, "rank 1 (stage 1)")
    with pytest.raises(ValueError, match=r"return the loss tensor .* \(returned: float\)"):
        work.loss(torch.zeros(2, 1), 0)


def test_a_nan_loss_travels_on_unread() -> None:
    """The divergence watch acts on the logged mean (core.divergence), on every rank."""
    work = TrainingBatch(_attached(Regression("nan")), _batch(), 0, 2, "rank 1 (stage 1)")
    assert torch.isnan(work.loss(torch.zeros(2, 1), 0))


def test_log_loss_returns_nan_unlogged_while_no_batch_has_finished() -> None:
    work = TrainingBatch(Regression(), _batch(), 0, 2, "rank 0 (stage 0)")
    assert torch.isnan(work.log_loss(None, torch.device("cpu")))


def test_forward_returns_restores_the_forward_it_replaced() -> None:
    module = nn.Linear(2, 2)
    with forward_returns(module, "output"):
        assert module(torch.zeros(1, 2)) == "output"
    assert "forward" not in vars(module) and module(torch.zeros(1, 2)).shape == (1, 2)

    module.forward = lambda x: "own"  # type: ignore[method-assign]
    with pytest.raises(KeyError), forward_returns(module, "output"):
        raise KeyError("the hook failed")
    assert module(torch.zeros(1, 2)) == "own"


def test_shape_forward_runs_every_layer_on_meta() -> None:
    layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))
    layers[2].to("meta")  # another stage's layer
    weight = layers[0].weight.detach().clone()
    out = shape_forward(layers)(torch.ones(5, 4))
    assert out.device.type == "meta" and out.shape == (5, 3)
    assert layers[0].weight.device.type == "cpu" and torch.equal(layers[0].weight, weight)


class OnDevice(Regression):
    """A loss on a device the host would have to wait for (``meta`` stands in for a GPU: any
    read of its value fails)."""

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = torch.zeros((), device="meta")
        return loss if self.returns == "loss" else loss * float("nan")


def test_a_loss_on_a_device_is_not_read_per_microbatch() -> None:
    work = TrainingBatch(_attached(OnDevice()), _batch(), 0, 2, "rank 1 (stage 1)")
    assert work.loss(torch.zeros(2, 1), 0).device.type == "meta"  # returned unread
