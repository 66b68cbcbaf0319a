"""The strategy's ``training_step``: one Lightning batch through this rank's part of the pipeline.

The batch is split into microbatches (``batches.TrainingBatch``), fingerprinted so that every
rank is known to see the same data (``data.SameData``), and run by the ``PipelineRunner``; the
pipeline drains where Lightning's loop ends (the last batch of an epoch, ``max_steps``) and in
the flushed modes. The finished batch's mean loss is logged as ``train_loss`` (unless
``training_step`` logs that name itself: ``step_logs.LossName``) and judged by the
divergence check (``core.loss_watch``): every rank sees the same logged losses and holds the same
batches, so every rank decides alike, at one step, with one message. Lightning's ``backward``
of the step (``backward``) reaches ``.grad`` in the flushed modes only.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from pl_pipedream.core.data import Fingerprints, SameData
from pl_pipedream.core.divergence import DivergenceWatch
from pl_pipedream.core.loss_watch import LossWatch
from pl_pipedream.engine.session import Session
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.batches import TrainingBatch
from pl_pipedream.strategy.step_logs import LossName, log_finished
from pl_pipedream.strategy.updates import LightningUpdates

__all__ = ["TrainingSteps", "backward", "must_drain"]


class TrainingSteps:
    """One strategy's training steps: the data check's weights (kept from batch to batch), and
    per fit the divergence check (``core.loss_watch``)."""

    def __init__(self, divergence: str, rule: tuple[float, int, int]) -> None:
        self.divergence = divergence
        self.rule = rule
        LossWatch(divergence, rule)  # refuses bad thresholds now
        self.losses: LossWatch | None = None
        self.fingerprints = Fingerprints()
        self.loss_name = LossName()

    @property
    def watch(self) -> DivergenceWatch | None:
        """The fit's divergence watch while it still watches."""
        return self.losses.watch if self.losses is not None else None

    def start_fit(self) -> None:
        """A fresh check (no watch with ``divergence="off"``) and fresh notes for a new fit."""
        self.losses = LossWatch(self.divergence, self.rule)
        self.loss_name = LossName()

    def run(
        self, session: Session | None, module: pl.LightningModule | None, batch: Any, batch_idx: int
    ) -> Tensor:
        """Run ``batch`` through ``session``'s pipeline of ``module``; return the loss to log."""
        assert session is not None and module is not None
        runner, settings, describe = session.running(), session.settings, session.describe
        # A non-finite loss travels on like any other: every rank sees it logged and all act
        # alike (divergence=...), knowing whether the batch's data were finite.
        work = TrainingBatch(module, batch, batch_idx, settings.microbatches, describe)
        step = module.trainer.global_step
        same = SameData(work.slices, describe, step, batch_idx, self.fingerprints, batch)
        drain = must_drain(settings.sync, module.trainer)
        if self.losses is not None:
            self.losses.note(runner.batches, batch, settings.microbatches)
        runner.train_batch(
            work.inputs, work.loss, drain=drain, fingerprint=same, logged=work.logged
        )
        logged = runner.take_logged()
        own = runner.loss is not None and self.loss_name.strategy_logs(logged, step)
        loss = work.log_loss(runner.loss, settings.device, own)
        log_finished(module, logged, settings.device)
        if self.losses is not None:
            clipping = "Trainer(gradient_clip_val=1.0)"
            session.judge(self.losses, module.trainer.global_step, rank_zero_warn, clipping)
        return loss


def must_drain(sync: SyncMode, trainer: pl.Trainer) -> bool:
    """Whether this step ends with the pipeline drained: in the flushed modes, at the end of an
    epoch and at ``max_steps``."""
    if sync.flushes or trainer.is_last_batch:
        return True
    return 0 < trainer.max_steps <= trainer.global_step + 1


def backward(
    session: Session | None,
    module: pl.LightningModule | None,
    precision: Precision,
    closure_loss: Tensor,
) -> Tensor:
    """Lightning's backward of a step: the pipeline ran it. In the flushed modes this is where
    the batch's gradient reaches ``.grad``, between ``on_before_backward`` and
    ``on_after_backward`` (the ``precision`` plugin's) as on one device; the other modes run
    their hooks per update (``session``'s update, ``updates.LightningUpdates``)."""
    updates = session.update if session is not None else None
    if not isinstance(updates, LightningUpdates) or updates.steps_in_pipeline:
        return closure_loss
    assert module is not None
    closure_loss = precision.pre_backward(closure_loss, module)
    closure_loss = updates.backward(closure_loss)
    return precision.post_backward(closure_loss, module)
