"""The training step's pieces in one process: the divergence watch per fit, when a step drains,
Lightning's backward. The step itself runs end to end in ``test_fit.py`` and
``test_lightning_features.py``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from lightning.pytorch import Trainer

from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.step import TrainingSteps, backward, must_drain


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
    assert backward(SimpleNamespace(updates=None), loss) is loss
