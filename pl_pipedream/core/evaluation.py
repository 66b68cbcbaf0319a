"""Forward-only passes through the pipeline: evaluation and predictions, for every front end.

The pipeline is drained before a forward-only pass, so its messages never mix with training
ones. A batch goes through the first replica of every stage in order, one message per boundary
(whatever structure a stage returns, as in training: ``runtime.boundary``; a rank of several
stages, ``runtime.chunks``, runs each of its stages in turn); the last stage hands
its output to the front end's ``finish`` (the Lightning hook, or the engine's loss function).
``to_every_rank`` sends the last stage's result to every other rank, so that every rank returns
the same value.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from pl_pipedream.core.stage import LocalStage
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.runtime.boundary import CrossingError, explain, flatten, unflatten
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.chunks import chunk_of
from pl_pipedream.runtime.executor import ExecutorError
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.ranks import describe
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.trees import map_tensors

__all__ = ["ForwardPipe"]


class ForwardPipe:
    """One rank's part of forward-only passes."""

    def __init__(self, plan: Plan, local: LocalStage, channel: Channel, rank: int) -> None:
        self.plan = plan
        self.local = local
        self.channel = channel
        self.rank = rank

    @property
    def evaluates(self) -> bool:
        """Only the first replica of a stage evaluates."""
        return self.rank == self.local.stage.ranks[0]

    def forward(
        self,
        inputs: Callable[[], Any],
        finish: Callable[[Any], Any],
        what: str,
        context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    ) -> Any:
        """Run this stage's layers, without gradients, on ``inputs()`` (the first stage) or on
        what the previous stage sent; the last stage returns ``finish(output)``, the others
        None. The layers run in ``context()``; ``what`` names the messages in errors."""
        if not self.evaluates:
            return None
        last = self.plan.num_stages - 1
        value: Any = None
        with torch.no_grad():
            for stage in self.local.stages:  # several in a chunked plan, in pipeline order
                if stage.index == 0:
                    value = inputs()
                elif not self._holds(stage.index - 1):  # else: the turn of a V, kept in memory
                    source = self.plan.stages[stage.index - 1].ranks[0]
                    message = self.channel.recv(source, Tag.EVALUATION, what)
                    value = unflatten(message.tensors, message.structure)
                with context():
                    value = self._layers(stage)(value)  # one argument, as nn.Sequential passes it
                if stage.index == last:
                    return finish(value)
                if not self._holds(stage.index + 1):
                    message = self._message(value)  # fails here, before anything is sent
                    target = self.plan.stages[stage.index + 1].ranks[0]
                    self.channel.send(message, target, Tag.EVALUATION, what)
        return None

    def _holds(self, index: int) -> bool:
        return any(stage.index == index for stage in self.local.stages)

    def _layers(self, stage: Stage) -> nn.Module:
        module = self.local.module
        return module if len(self.local.stages) == 1 else chunk_of(module, stage)

    def to_every_rank(self, result: Any, what: str) -> Any:
        """The last stage's ``result``, on every rank: the last stage's first replica sends it
        to each other rank (one message each)."""
        last = self.metrics_source
        others = sorted({r for stage in self.plan.stages for r in stage.ranks if r != last})
        if not others:
            return result
        if self.rank == last:
            message = self._message(result)
            for rank in others:
                self.channel.send(message, rank, Tag.PREDICTIONS, what)
            return result
        message = self.channel.recv(last, Tag.PREDICTIONS, what)
        # the user keeps the result: copies, not views that hold on to the whole frame
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
        """The rank whose results every rank adopts: the last stage's first replica."""
        return self.plan.stages[-1].ranks[0]
