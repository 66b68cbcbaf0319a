"""The strategy shell in one process: its arguments, its registration, what it tells Lightning.

Its hooks run end to end in ``test_fit.py``, ``test_lightning_features.py``, ``test_resume.py``,
``test_evaluation.py`` and ``test_errors.py``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from lightning.pytorch import Trainer
from lightning.pytorch.strategies import ParallelStrategy

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy import pipedream


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
    assert strategy.plan is None and strategy.session is None


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


# ----- the class reads as one thing -------------------------------------------------------------

SOURCE = Path(pipedream.__file__)
# Lightning's call order: launch, environment, setup, training, evaluation, checkpoints,
# collectives, the end.
HOOK_ORDER = (
    "root_device",
    "distributed_sampler_kwargs",
    "_configure_launcher",
    "setup_environment",
    "tensor_init_context",
    "setup",
    "process_dataloader",
    "model_to_device",
    "training_step",
    "backward",
    "optimizer_step",
    "validation_step",
    "test_step",
    "predict_step",
    "on_validation_start",
    "on_test_start",
    "on_predict_start",
    "lightning_module_state_dict",
    "save_checkpoint",
    "load_checkpoint",
    "load_optimizer_state_dict",
    "remove_checkpoint",
    "barrier",
    "broadcast",
    "reduce",
    "on_train_end",
    "teardown",
    "register_strategies",
)


def _methods() -> list[ast.FunctionDef]:
    tree = ast.parse(SOURCE.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "PipeDreamStrategy"]
    return [n for n in cls.body if isinstance(n, ast.FunctionDef)]


def test_the_strategy_is_one_class_over_lightnings_parallel_strategy() -> None:
    assert PipeDreamStrategy.__bases__ == (ParallelStrategy,)
    assert len(SOURCE.read_text().splitlines()) <= 350


def test_every_lightning_hook_is_marked_override_and_held_by_the_class_itself() -> None:
    methods = {m.name: m for m in _methods()}
    for name in HOOK_ORDER:
        assert name in methods, f"{name} is not defined in PipeDreamStrategy itself"
        marks = {d.id for d in methods[name].decorator_list if isinstance(d, ast.Name)}
        assert "override" in marks, f"{name} lacks @override"
    lightning = {n for n in dir(ParallelStrategy) if not n.startswith("__")}
    unmarked = [
        name
        for name, m in methods.items()
        if name in lightning
        and "override" not in {d.id for d in m.decorator_list if isinstance(d, ast.Name)}
    ]
    assert unmarked == []


def test_the_hooks_come_in_lightnings_call_order() -> None:
    order = [m.name for m in _methods() if m.name in HOOK_ORDER]
    assert order == list(HOOK_ORDER)
