"""Preemption under Lightning: at the step every rank agreed on, drain, save, requeue, exit.

The agreement (which step every rank stops at, after a signal to any of them) is
``core.preemption``'s. At that step every rank drains the pipeline, the ranks save ``last.ckpt``
together (``checkpoint_path``), and each rank exits with ``128 + signal`` (143 for SIGTERM, 138
for SIGUSR1), the status of a process that the signal ended, so the scheduler accounts the job
as ended by it, not completed. ``trainer.fit(ckpt_path="last")`` resumes (in the app:
``pl-pipedream-train ... ckpt_path=last`` with the run's ``hydra.run.dir``).

Lightning's own SIGTERM handler broadcasts inside the handler (a collective that can meet a
pipeline message mid-step) and forwards the signal to the other ranks; it stays in place outside
training. Under SLURM with ``auto_requeue``, the agreed stop also runs Lightning's requeue
(``lightning_patches.slurm_requeue``) on every rank.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pl_pipedream.core.preemption import Preempted, exit_code
from pl_pipedream.runtime import processes
from pl_pipedream.strategy import lightning_patches

__all__ = ["checkpoint_path", "stop_fit"]


def checkpoint_path(trainer: Any) -> Path:
    """Where a preempted fit saves: ``last.ckpt`` in the first ``ModelCheckpoint``'s directory
    (where ``fit(ckpt_path="last")`` looks), else in ``trainer.default_root_dir``. The callback
    takes it for its own last checkpoint (``last_model_path``, saved with it), so that the
    resumed fit rewrites it rather than writing ``last-v1.ckpt`` beside it."""
    callback = trainer.checkpoint_callback
    if callback is None or not getattr(callback, "dirpath", None):
        return Path(trainer.default_root_dir) / "last.ckpt"
    name = callback.CHECKPOINT_NAME_LAST + callback.FILE_EXTENSION
    callback.last_model_path = os.path.join(callback.dirpath, name)
    return Path(callback.last_model_path)


def stop_fit(trainer: Any, drain: Callable[[], None], signum: int) -> None:
    """What every rank does at the agreed step: ``drain``, save, requeue (SLURM), and exit."""
    path = checkpoint_path(trainer)
    name = signal.Signals(signum).name
    print(
        f"[rank {trainer.global_rank}] {name}: every rank stops at step {trainer.global_step} "
        f"and saves {path}; resume with trainer.fit(..., ckpt_path='last'), or in the app with "
        "pl-pipedream-train <the same overrides> hydra.run.dir=<this run's directory> "
        "ckpt_path=last",
        flush=True,
    )
    drain()
    trainer.save_checkpoint(path)
    lightning_patches.slurm_requeue(trainer, signum)
    processes.agree_exit(exit_code(signum))  # the report counts this status as no failure
    raise Preempted(exit_code(signum))
