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
from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

__all__ = ["PipelineSpawnLauncher"]


class PipelineSpawnLauncher(_MultiProcessingLauncher):
    """``start_method="spawn"`` (or ``"fork"``) for ``PipeDreamStrategy``."""

    @override
    def _collect_rank_zero_results(self, trainer: pl.Trainer, results: Any) -> _WorkerOutput | None:
        callback = trainer.checkpoint_callback
        best = getattr(callback, "best_model_path", None) if callback else None
        fitted = trainer.state.fn == TrainerFn.FITTING
        state = self._strategy.full_state_dict() if fitted else None  # type: ignore[attr-defined]
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
        return _WorkerOutput(
            best, weights_path, trainer.state, results, self.get_extra_results(trainer)
        )
