"""Setup's ends in one process: a strategy that never set up ends and tears down cleanly. The
environment, the plan, the stage and the pipeline are set up end to end by every multi-process
test (``test_fit.py``, ``test_resume.py``, ``test_evaluation.py``)."""

from __future__ import annotations

from lightning.pytorch import Trainer

from pl_pipedream import PipeDreamStrategy, Pretrained
from pl_pipedream.core.resume import Resume
from pl_pipedream.strategy.setup import attached_trainer, end_fit, stage_weights, tear_down


def test_a_strategy_without_a_pipeline_reports_nothing_and_tears_down() -> None:
    strategy = PipeDreamStrategy(timeline="trace.json")
    end_fit(strategy)
    assert strategy.memory_report == [] and strategy.bubbles == {}
    tear_down(strategy)
    assert strategy.session is None and strategy.cpu_binding is None


def test_a_module_tells_the_trainer_it_is_attached_to() -> None:
    from lightning.pytorch import LightningModule, Trainer

    module, trainer = LightningModule(), Trainer(accelerator="cpu", devices=1, logger=False)
    assert attached_trainer(module) is None and attached_trainer(None) is None
    module.trainer = trainer
    assert attached_trainer(module) is trainer


def test_resuming_wins_over_pretrained_weights(tmp_path) -> None:  # type: ignore[no-untyped-def]
    trainer = Trainer(accelerator="cpu", devices=1, logger=False)
    weights = Pretrained(tmp_path / "never-read.pt")
    assert stage_weights(weights, trainer, built_empty=True, resume=Resume()) is weights
    assert stage_weights(None, trainer, built_empty=True, resume=Resume()) is None
    trainer.ckpt_path = tmp_path / "last.ckpt"  # resuming, the checkpoint not loaded (whole build)
    assert stage_weights(weights, trainer, built_empty=False, resume=Resume()) is None
