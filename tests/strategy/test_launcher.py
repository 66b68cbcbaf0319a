"""The spawn launcher: every stage's state reaches the launching process.

Here: the Lightning internals the launcher overrides and builds, the launcher chosen by
``start_method``, and the gather of every rank's stage over gloo. End to end, every spawn test
in ``test_lightning_features.py`` compares the launching process's model with the oracle, which
only this launcher's gather fills (Lightning loads the returned weights with ``strict=False``,
so a stage missing from them would otherwise go unnoticed).
"""

from __future__ import annotations

import inspect

import pytest
import torch
from lightning.pytorch import Trainer

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.strategy.launcher import (
    PipelineScriptLauncher,
    PipelineSpawnLauncher,
    _gather_state_dict,
)
from pl_pipedream.strategy.lightning_patches import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
)
from tests.runtime.distributed import run


def test_lightning_collects_each_workers_results_through_the_overridden_method() -> None:
    assert hasattr(MultiProcessingLauncher, "_collect_rank_zero_results")
    source = inspect.getsource(MultiProcessingLauncher._wrapping_function)
    assert "self._collect_rank_zero_results(trainer, results)" in source


def test_the_launching_process_loads_the_weights_file_a_worker_names() -> None:
    source = inspect.getsource(MultiProcessingLauncher._recover_results_in_main_process)
    assert "worker_output.weights_path" in source and "load_state_dict(" in source


def test_worker_output_takes_its_fields_in_the_order_the_launcher_passes_them() -> None:
    assert WorkerOutput._fields == (
        "best_model_path",
        "weights_path",
        "trainer_state",
        "trainer_results",
        "extra",
    )


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_spawn_and_fork_launch_with_the_pipeline_launcher(start_method: str) -> None:
    strategy = PipeDreamStrategy(balance=[1, 1], start_method=start_method)
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy.launcher, PipelineSpawnLauncher)
    assert trainer.strategy.launcher._start_method == start_method


def test_popen_launches_like_ddp() -> None:
    strategy = PipeDreamStrategy(balance=[1, 1], start_method="popen")
    trainer = Trainer(accelerator="cpu", devices=2, strategy=strategy, logger=False)
    assert isinstance(trainer.strategy.launcher, SubprocessScriptLauncher)
    assert type(trainer.strategy.launcher) is PipelineScriptLauncher  # adds the exit report


class StageStates:
    """What the launcher asks of the strategy: the world size and this rank's stage state."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size

    def lightning_module_state_dict(self) -> dict[str, torch.Tensor]:
        return {
            f"net.{self.rank}.weight": torch.full((2,), float(self.rank)),
            "scale": torch.ones(1) * self.rank,
        }


def _gather(rank: int, world: int) -> dict[str, torch.Tensor]:
    return _gather_state_dict(StageStates(rank, world))


@pytest.mark.slow  # two processes that import Lightning: about 5 s
def test_every_rank_contributes_its_stage_merged_under_the_modules_names() -> None:
    results = run(2, _gather, timeout=60.0)
    for rank, (status, state) in results.items():
        assert status == "ok", f"rank {rank}: {state}"
        assert sorted(state) == ["net.0.weight", "net.1.weight", "scale"]
        assert torch.equal(state["net.1.weight"], torch.ones(2))
        assert torch.equal(state["scale"], torch.zeros(1))  # rank 0's state outside the pipeline
