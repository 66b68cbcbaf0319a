"""The strategy shell in one process: its arguments, its registration, what it tells Lightning.

Its hooks run end to end in ``test_fit.py``, ``test_lightning_features.py``, ``test_resume.py``,
``test_evaluation.py`` and ``test_errors.py``.
"""

from __future__ import annotations

import pytest
from lightning.pytorch import Trainer

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.schedule.modes import SyncMode


def test_unknown_sync_mode() -> None:
    with pytest.raises(ValueError, match=r"sync must be one of async, .* \(sync: 'fast'\)"):
        PipeDreamStrategy(sync="fast")


@pytest.mark.parametrize("microbatches", [0, 2.0])
def test_microbatches_must_be_a_positive_integer(microbatches: object) -> None:
    with pytest.raises(ValueError, match=rf"\(microbatches: {microbatches!r}\)"):
        PipeDreamStrategy(microbatches=microbatches)  # type: ignore[arg-type]


def test_an_unknown_start_method_is_refused() -> None:
    with pytest.raises(ValueError, match=r"'popen', 'spawn' or 'fork' \(start_method: 'thread'\)"):
        PipeDreamStrategy(start_method="thread")


def test_init_stores_the_arguments_as_given() -> None:
    strategy = PipeDreamStrategy(sync="flush", microbatches=4, balance=(2, 2), timeout=5)
    assert strategy.sync is SyncMode.FLUSH
    assert (strategy.microbatches, strategy.balance, strategy.timeout) == (4, [2, 2], 5.0)
    assert strategy.plan is None and strategy.runner is None


def test_trainer_finds_the_strategy_by_name() -> None:
    trainer = Trainer(accelerator="cpu", devices=2, strategy="pipedream", logger=False)
    assert isinstance(trainer.strategy, PipeDreamStrategy)
    assert trainer.strategy.sync is SyncMode.ASYNC and trainer.strategy.microbatches == 1


def test_every_stage_samples_every_batch_in_the_same_order() -> None:
    assert PipeDreamStrategy().distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


@pytest.mark.parametrize("sync", ["flush", "gpipe", "2bw"])
def test_staleness_corrections_are_refused_outside_the_per_minibatch_modes(sync: str) -> None:
    with pytest.raises(ValueError, match=r"weight_prediction=True.*sync='async'"):
        PipeDreamStrategy(sync=sync, weight_prediction=True)
    with pytest.raises(ValueError, match=r"lr_warmup_per_delay=4"):
        PipeDreamStrategy(sync=sync, lr_warmup_per_delay=4)
    strategy = PipeDreamStrategy(sync="vertical_sync", weight_prediction=True)
    assert strategy.weight_prediction and strategy.lr_warmup_per_delay == 0
