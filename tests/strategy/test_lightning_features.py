"""Lightning features through PipeDreamStrategy, launched with spawn from pytest.

A flushed pipeline must equal ordinary single-device Lightning training, with gradient
accumulation, gradient clipping by norm and an LR scheduler; an async run must stop at
``max_steps`` drained, with the training loss reaching rank 0.
"""

from __future__ import annotations

import math

import pytest
import torch
from lightning.pytorch import LightningModule, Trainer
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model


class Net(LightningModule):
    def __init__(self, optimizer: str = "adam", schedule: bool = False) -> None:
        super().__init__()
        self.net = make_model()
        self.optimizer_name = optimizer
        self.schedule = schedule

    def configure_pipeline(self) -> torch.nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return loss_fn(self(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        optimizer = OPTIMIZERS[self.optimizer_name](self.parameters())
        if not self.schedule:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
        return {
            "optimizer": optimizer,
            "lr_scheduler": {"scheduler": scheduler, "interval": "step"},
        }


def loader(m: int) -> DataLoader:
    batches = make_batches(m)
    data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    return DataLoader(data, batch_size=2 * m, shuffle=False)


def trainer(**kwargs) -> Trainer:  # type: ignore[no-untyped-def]
    settings = {
        "accelerator": "cpu",
        "max_epochs": 1,
        "use_distributed_sampler": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "logger": False,
        "enable_checkpointing": "callbacks" in kwargs,
    }
    return Trainer(**{**settings, **kwargs})


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "balance"), [("flush", [3, 3]), ("zbv", [2, 1, 2, 1]), ("interleaved", [1, 2, 1, 2])]
)
def test_flush_equals_single_device_with_accumulation_clipping_and_scheduler(
    sync: str, balance: list[int]
) -> None:
    """The chunked modes (several stages per rank) too: the rank steps once per batch."""
    settings = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05, "max_steps": 2}
    reference = Net(schedule=True)
    trainer(devices=1, **settings).fit(reference, loader(2))
    pipelined = Net(schedule=True)
    strategy = PipeDreamStrategy(
        sync=sync, balance=balance, microbatches=2, start_method="fork", timeout=60
    )
    run = trainer(devices=2, strategy=strategy, **settings)
    run.fit(pipelined, loader(2))
    for key, tensor in reference.state_dict().items():
        diff = (pipelined.state_dict()[key] - tensor).abs().max().item()
        assert diff <= 1e-5, f"{key}: {diff}"


@pytest.mark.slow
def test_async_stops_at_max_steps_drained_and_rank_zero_sees_the_loss(tmp_path) -> None:
    model = Net(optimizer="sgd")
    strategy = PipeDreamStrategy(
        sync="async",
        balance=[3, 3],
        microbatches=2,
        start_method="fork",
        timeout=60,
        timeline=tmp_path / "trace.json",
    )
    run = trainer(devices=2, strategy=strategy, max_steps=3)
    run.fit(model, loader(2))
    assert math.isfinite(float(run.callback_metrics["train_loss"]))
    assert_async_three_steps_equal_the_oracle(model, OPTIMIZERS["sgd"])
    assert (tmp_path / "trace.json").is_file()


def assert_async_three_steps_equal_the_oracle(model: Net, make_optimizer) -> None:  # type: ignore[no-untyped-def]
    expected = oracle.train(
        make_model(),
        Plan.from_balance([3, 3]),
        "async",
        make_batches(2)[:3],
        2,
        loss_fn,
        make_optimizer,
    )
    for key, tensor in expected.items():
        diff = (model.state_dict()[f"net.{key}"] - tensor).abs().max().item()
        assert diff <= 1e-5, f"{key}: {diff}"


def optimizer_without_first_weight(params) -> torch.optim.Optimizer:  # type: ignore[no-untyped-def]
    return OPTIMIZERS["sgd"]([p for p in params if p.shape != (8, 6)])


class PartlyOptimized(Net):
    """The first layer's weight gets gradients, but no optimizer steps it."""

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        return optimizer_without_first_weight(self.parameters())


@pytest.mark.slow
def test_async_keeps_a_parameter_no_optimizer_steps_and_stashes_the_rest() -> None:
    model = PartlyOptimized()
    before = model.net[0].weight.detach().clone()
    strategy = PipeDreamStrategy(
        sync="async", balance=[3, 3], microbatches=2, start_method="fork", timeout=60
    )
    trainer(devices=2, strategy=strategy, max_steps=3).fit(model, loader(2))
    assert_async_three_steps_equal_the_oracle(model, optimizer_without_first_weight)
    assert torch.equal(model.net[0].weight, before)
