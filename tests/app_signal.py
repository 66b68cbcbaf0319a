"""A callback for app tests: SIGTERM to rank 0's own process at a given global step, as a
scheduler's preemption would send it (``+trainer.callbacks=[{_target_: tests.app_signal.
SigtermAt, step: 7}]``)."""

from __future__ import annotations

import os
import signal
from typing import Any

from lightning.pytorch import Callback


class SigtermAt(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == 0:
            os.kill(os.getpid(), signal.SIGTERM)
