"""Validation, test and predict: forward-only through the first replica of every stage.

The pipeline is drained before evaluation starts, so evaluation messages never mix with training
ones. Each batch goes through the stages in order, one message per boundary (whatever structure a
stage returns, as in training: ``runtime.boundary``); the last stage runs
the user's hook (``validation_step``, ...) with ``self(x)`` returning the pipeline's output.
Predictions travel from the last stage to every other rank, so that ``trainer.predict`` returns
them on every rank. Metrics the
last stage logged are shared with every rank (``lightning_patches.share_evaluation_metrics``),
because callbacks such as ``ModelCheckpoint`` and ``EarlyStopping`` monitor them on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from pl_pipedream.core.stage import LocalStage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.boundary import CrossingError, explain, flatten, unflatten
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import ExecutorError
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.ranks import describe
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.runtime.trees import map_tensors
from pl_pipedream.strategy.batches import first_stage_input, forward_returns

__all__ = ["EvaluationPipe", "evaluation_step"]


class EvaluationPipe:
    """One rank's part of forward-only evaluation."""

    def __init__(self, plan: Plan, local: LocalStage, channel: Channel, rank: int) -> None:
        self.plan = plan
        self.local = local
        self.channel = channel
        self.rank = rank

    @property
    def evaluates(self) -> bool:
        """Only the first replica of a stage evaluates."""
        return self.rank == self.local.stage.ranks[0]

    def run(
        self,
        module: nn.Module,
        hook: str,
        batch: Any,
        batch_idx: int,
        *rest: Any,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
        **kwargs: Any,
    ) -> Any:
        """Run this stage's layers on the batch; the last stage returns the user's ``hook``.
        The layers and the hook run in ``context()`` (the precision plugin's step context)."""
        if not self.evaluates:
            return None
        stage = self.local.stage
        what = f"the {hook.split('_')[0]} activations of batch {batch_idx}"
        with torch.no_grad():
            if stage.index == 0:
                value = first_stage_input(module, batch)
            else:
                source = self.plan.stages[stage.index - 1].ranks[0]
                message = self.channel.recv(source, Tag.EVALUATION, what)
                value = unflatten(message.tensors, message.structure)
            with context():
                output = self.local.module(value)  # one argument, as nn.Sequential passes it on
            if stage.index < self.plan.num_stages - 1:
                message = self._message(output)  # fails here, before anything is sent
                target = self.plan.stages[stage.index + 1].ranks[0]
                self.channel.send(message, target, Tag.EVALUATION, what)
                return None
            with context(), forward_returns(module, output):
                return getattr(module, hook)(batch, batch_idx, *rest, **kwargs)

    def predictions_to_every_rank(self, result: Any, batch_idx: int) -> Any:
        """The last stage's predictions, on every rank: the last stage's first replica sends
        them to each other rank (one message each), so that ``trainer.predict`` returns the
        same list everywhere, as a user of ``DDPStrategy`` expects each rank to get its own."""
        last = self.plan.stages[-1].ranks[0]
        others = sorted(r for stage in self.plan.stages for r in stage.ranks if r != last)
        if not others:
            return result
        what = f"the predictions of batch {batch_idx}"
        if self.rank == last:
            message = self._message(result)
            for rank in others:
                self.channel.send(message, rank, Tag.PREDICTIONS, what)
            return result
        message = self.channel.recv(last, Tag.PREDICTIONS, what)
        # the user keeps predictions: copies, not views that hold on to the whole frame
        return map_tensors(torch.clone, unflatten(message.tensors, message.structure))

    def _message(self, value: Any) -> Message:
        """``value`` flattened into one message, or an error naming the layer and the stage."""
        try:
            tensors, structure = flatten(value)
        except CrossingError as error:
            where = describe(self.rank, self.local.stage.index)
            raise ExecutorError(explain(error, self.local.module, where)) from None
        return Message(tensors, structure=structure)

    @property
    def metrics_source(self) -> int:
        """The rank whose logged metrics every rank adopts: the last stage's first replica."""
        return self.plan.stages[-1].ranks[0]


def evaluation_step(
    strategy: Any, hook: str, batch: Any, batch_idx: int = 0, *rest: Any, **kwargs: Any
) -> Any:
    """The strategy's ``validation_step``, ``test_step`` or ``predict_step`` (``hook``): the
    batch through the ``EvaluationPipe`` built at setup, in the precision plugin's step context
    as in Lightning's own steps; predictions reach every rank."""
    pipe: EvaluationPipe | None = strategy.evaluation
    assert pipe is not None
    context = getattr(strategy.precision_plugin, _CONTEXTS[hook])
    module = strategy.lightning_module
    result = pipe.run(module, hook, batch, batch_idx, *rest, context=context, **kwargs)
    if hook == "predict_step":
        return pipe.predictions_to_every_rank(result, batch_idx)
    return result


_CONTEXTS = {
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}
