"""The spawn launcher, returning the whole trained model to the launching process.

Lightning's spawn launcher sends rank 0's ``state_dict`` back to the parent. Under
``PipeDreamStrategy`` rank 0 holds only its own stage, so every rank contributes its stage first
and the parent receives all of them merged under the LightningModule's names.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from typing_extensions import override

from pl_pipedream.core.checkpoint import merge_states
from pl_pipedream.strategy.exits import ExitReport, record_uncaught_errors
from pl_pipedream.strategy.lightning_patches import (
    MultiProcessingLauncher,
    SubprocessScriptLauncher,
    WorkerOutput,
)

__all__ = ["PipelineScriptLauncher", "PipelineSpawnLauncher"]


class PipelineScriptLauncher(SubprocessScriptLauncher):
    """``start_method="popen"``: Lightning's script launcher, plus the exit report
    (``strategy.exits``): the launching command exits 1 when any rank failed, even after rank 0
    finished, and prints the first failed rank's error once at the end."""

    def __init__(
        self, cluster_environment: Any, num_processes: int, num_nodes: int, timeout: float
    ):
        super().__init__(cluster_environment, num_processes, num_nodes)
        self.timeout = timeout

    @override
    def launch(self, function: Any, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        if self.cluster_environment.creates_processes_externally:
            record_uncaught_errors(int(os.environ.get("LOCAL_RANK", "0")))
        return super().launch(function, *args, trainer=trainer, **kwargs)

    @override
    def _call_children_scripts(self) -> None:
        report = ExitReport(self.timeout)
        super()._call_children_scripts()
        report.watch(self.procs)


class PipelineSpawnLauncher(MultiProcessingLauncher):
    """``start_method="spawn"`` (or ``"fork"``) for ``PipeDreamStrategy``."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        fitted = trainer.state.fn == TrainerFn.FITTING
        state = _gather_state_dict(self._strategy) if fitted else None
        # This worker process ends next: close the process group first, so that no gloo thread
        # is still running when the interpreter exits (that aborts the process).
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        if self._strategy.local_rank != 0:
            return None
        weights_path = None
        if state is not None:
            weights_path = os.path.join(tempfile.mkdtemp(), ".pipedream-weights.ckpt")
            self._strategy.checkpoint_io.save_checkpoint(state, weights_path)
        return WorkerOutput(
            best, weights_path, trainer.state, results, self.get_extra_results(trainer)
        )


def _gather_state_dict(strategy: Any) -> dict[str, Tensor]:
    """Every stage's state, merged under the LightningModule's names (all ranks call it)."""
    gathered: list[dict[str, Tensor]] = [{}] * strategy.world_size
    dist.all_gather_object(gathered, strategy.lightning_module_state_dict())
    return merge_states(gathered)
