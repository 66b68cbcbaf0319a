"""The training step's pieces in one process: the divergence watch per fit, when a step drains,
Lightning's backward. The step itself runs end to end in ``test_fit.py`` and
``test_lightning_features.py``."""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from lightning.pytorch import Trainer

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.step import TrainingSteps, backward, must_drain
from tests.runtime.test_executor import loss_fn
from tests.strategy.test_lightning_features import Net, loader


def test_bad_thresholds_are_refused_when_the_steps_are_made() -> None:
    with pytest.raises(ValueError):
        TrainingSteps("error", (0.9, 0, 5))


@pytest.mark.parametrize(("divergence", "watches"), [("error", True), ("off", False)])
def test_each_fit_starts_a_fresh_watch_unless_divergence_is_off(
    divergence: str, watches: bool
) -> None:
    steps = TrainingSteps(divergence, (0.9, 3, 5))
    assert steps.watch is None
    steps.start_fit()
    assert (steps.watch is not None) == watches


def test_a_step_drains_in_the_flushed_modes_and_at_max_steps() -> None:
    trainer = Trainer(accelerator="cpu", devices=1, max_steps=5, logger=False)
    assert must_drain(SyncMode.FLUSH, trainer)
    assert not must_drain(SyncMode.ASYNC, trainer)
    last = Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False)
    assert must_drain(SyncMode.ASYNC, last)


def test_backward_leaves_the_loss_to_the_pipeline_without_updates() -> None:
    loss = torch.tensor(1.5)
    assert backward(None, None, None, loss) is loss  # type: ignore[arg-type]  # before setup
    assert backward(SimpleNamespace(update=None), None, None, loss) is loss  # type: ignore[arg-type]


# ----- a training_step that logs train_loss, the strategy's own name ---------------------------


class LogsTrainLoss(Net):
    """Logs its own value (twice the loss) as ``train_loss`` from batch ``first`` on."""

    def __init__(self, first: int = 0) -> None:
        super().__init__(optimizer="sgd")
        self.first = first

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        loss = loss_fn(self(x), y)
        if batch_idx >= self.first:
            self.log("train_loss", 2 * loss)
        return loss


def _fit(devices: int, first: int = 0) -> Trainer:
    strategy: Any = "auto"
    if devices > 1:
        strategy = PipeDreamStrategy(
            sync="flush", balance=[3, 3], microbatches=1, start_method="fork", timeout=60
        )
    run = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=1,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    run.fit(LogsTrainLoss(first), loader(1))
    return run


@pytest.mark.slow
def test_a_train_loss_the_user_logs_wins_over_the_strategys_own() -> None:
    single, pipelined = _fit(1), _fit(2)
    expected = float(single.callback_metrics["train_loss"])  # the user's 2 x loss
    got = float(pipelined.callback_metrics["train_loss"])
    assert math.isclose(got, expected, rel_tol=1e-6), (got, expected)
    assert "train_loss" not in pipelined.progress_bar_metrics  # the user's prog_bar=False


@pytest.mark.slow
def test_a_train_loss_the_user_logs_only_after_the_strategy_did_is_refused() -> None:
    with pytest.raises(Exception, match="PipeDreamStrategy logs each batch's loss as train_loss"):
        _fit(2, first=2)
