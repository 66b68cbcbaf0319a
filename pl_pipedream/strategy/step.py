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
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from pl_pipedream.core.data import Fingerprints, SameData
from pl_pipedream.core.divergence import DivergenceWatch, describe_optimizer, divergence_message
from pl_pipedream.core.loss_watch import LossWatch
from pl_pipedream.runtime import ranks
from pl_pipedream.schedule import rules
from pl_pipedream.strategy.batches import TrainingBatch
from pl_pipedream.strategy.step_logs import LossName, log_finished

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

    def run(self, strategy: Any, batch: Any, batch_idx: int) -> Tensor:
        """Run ``batch`` through ``strategy``'s pipeline; return the loss to log."""
        runner, local = strategy.runner, strategy.local_stage
        assert runner is not None and local is not None
        module = strategy.lightning_module
        describe = ranks.describe(strategy.global_rank, local.stage.index)
        # A non-finite loss travels on like any other: every rank sees it logged and all act
        # alike (divergence=...), knowing whether the batch's data were finite.
        work = TrainingBatch(module, batch, batch_idx, strategy.microbatches, describe)
        step = module.trainer.global_step
        same = SameData(work.slices, describe, step, batch_idx, self.fingerprints, batch)
        drain = must_drain(strategy.sync, module.trainer)
        if self.losses is not None:
            self.losses.note(runner.batches, batch, strategy.microbatches)
        runner.train_batch(
            work.inputs, work.loss, drain=drain, fingerprint=same, logged=work.logged
        )
        logged = runner.take_logged()
        own = runner.loss is not None and self.loss_name.strategy_logs(logged, step)
        loss = work.log_loss(runner.loss, strategy.root_device, own)
        log_finished(module, logged, strategy.root_device)
        if self.losses is not None and runner.loss is not None:
            self._check_divergence(strategy, self.losses, runner.loss, module.trainer.global_step)
        return loss

    def _check_divergence(self, strategy: Any, losses: LossWatch, loss: float, step: int) -> None:
        def explain(reason: str) -> str:
            plan, sync = strategy.plan, strategy.sync
            delays = [rules.update_delay(plan, sync, s) for s in range(len(plan.stages))]
            groups = [g for optimizer in strategy.optimizers for g in optimizer.param_groups]
            return divergence_message(reason, step, sync, delays, describe_optimizer(groups))

        losses.check(
            loss, strategy.runner.loss_batch, step, explain, strategy.drain, rank_zero_warn
        )


def must_drain(sync: Any, trainer: pl.Trainer) -> bool:
    """Whether this step ends with the pipeline drained: in the flushed modes, at the end of an
    epoch and at ``max_steps``."""
    if sync.flushes or trainer.is_last_batch:
        return True
    return 0 < trainer.max_steps <= trainer.global_step + 1


def backward(strategy: Any, closure_loss: Tensor) -> Tensor:
    """Lightning's backward of a step: the pipeline ran it. In the flushed modes this is where
    the batch's gradient reaches ``.grad``, between ``on_before_backward`` and
    ``on_after_backward`` as on one device; the other modes run their hooks per update."""
    updates = strategy.updates
    if updates is None or updates.steps_in_pipeline:
        return closure_loss
    module, precision = strategy.lightning_module, strategy.precision_plugin
    closure_loss = precision.pre_backward(closure_loss, module)
    closure_loss = updates.backward(closure_loss)
    return precision.post_backward(closure_loss, module)
