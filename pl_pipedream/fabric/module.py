"""``PipelineModule``: the module ``fabric.setup`` hands back, whose call runs the pipeline.

In train mode ``model((inputs, targets))`` is ``Pipeline.train_step``: this rank's segment of the
schedule for one batch, forwards, backwards and the update included, returning the loss (the
same on every rank). In eval mode ``model((inputs, targets))`` is ``eval_step`` and, in any
mode, ``model(inputs=x)`` is ``predict_step``. Fabric's own calls around it then have nothing
left to do, and each checks that rather than doing it twice: ``fabric.backward`` accepts only
the loss the last training call returned (its backward passes already ran), and
``optimizer.step()`` confirms that a training call applied the update since the previous step.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.engine import Pipeline

__all__ = ["NoAccumulation", "PipelineModule"]


class PipelineModule(nn.Module):
    """``pipeline``'s steps behind one ``nn.Module`` call (see the module docstring); its
    submodule ``stage`` holds this rank's layers."""

    def __init__(self, pipeline: Pipeline) -> None:
        super().__init__()
        self.pipeline = pipeline
        self.stage = pipeline.module
        self.loss: Tensor | None = None  # what the newest training call returned
        self.unconfirmed = 0  # training calls since the last optimizer.step()
        self.confirms = False  # whether the loop calls optimizer.step() at all

    def forward(self, batch: Any = None, *, inputs: Any = None) -> Any:
        # Fabric enters its precision's autocast around this call; the engine enters its own
        # around each stage's forward passes only, not around backward passes and updates
        with torch.autocast(self.pipeline.device.type, enabled=False):
            return self._call(batch, inputs)

    def _call(self, batch: Any, inputs: Any) -> Any:
        if inputs is not None:
            return self.pipeline.predict_step(inputs)
        if not self.training:
            return self.pipeline.eval_step(batch)
        if self.confirms and self.unconfirmed:
            raise RuntimeError(
                f"each training call of the pipeline applies its own update, so optimizer.step() "
                f"follows every one or none (training calls since the last step: "
                f"{self.unconfirmed}); to accumulate gradients over a larger batch raise "
                "PipeDreamFabricStrategy(microbatches=...) and pass the larger batch"
            )
        self.loss = self.pipeline.train_step(batch)
        if self.stage is not self.pipeline.module:  # a re-plan moved this rank's layers
            self.stage = self.pipeline.module
        self.unconfirmed += 1
        return self.loss

    def accept_backward(self, tensor: Tensor) -> None:
        """``fabric.backward(tensor)``: nothing to run for the newest training loss; any other
        tensor is refused (its backward would not reach the other stages)."""
        if self.loss is not None and tensor is self.loss:
            return
        raise RuntimeError(
            f"fabric.backward under the pipeline takes the loss the training call returned, "
            f"whose backward passes ran inside the schedule (tensor: {_describe(tensor)}); "
            "write loss = model((inputs, targets)) and fabric.backward(loss), or leave "
            "fabric.backward out; a loss of your own goes into the pipeline as "
            "PipeDreamFabricStrategy(loss_fn=...)"
        )

    def confirm_step(self) -> None:
        """``optimizer.step()``: the update the newest training call applied; refused where no
        training call, or more than one, came since the previous step."""
        if self.unconfirmed != 1:
            raise RuntimeError(
                f"optimizer.step() under the pipeline confirms the update the training call "
                f"before it applied inside the schedule, one step per call (training calls "
                f"since the last step: {self.unconfirmed}); call loss = model((inputs, "
                "targets)) in train mode before each optimizer.step(), and to accumulate "
                "gradients over a larger batch raise PipeDreamFabricStrategy(microbatches=...)"
            )
        self.unconfirmed = 0
        self.confirms = True


class NoAccumulation:
    """Fabric's ``no_backward_sync`` hook: refused, since each training call applies its own
    update (gradient accumulation across calls would silently step every call)."""

    def no_backward_sync(self, module: nn.Module, enabled: bool) -> AbstractContextManager:
        if not enabled:
            return nullcontext()
        raise RuntimeError(
            "fabric.no_backward_sync accumulates gradients across training calls, but each "
            "training call of the pipeline applies its own update (enabled: True); pass the "
            "larger batch in one call and split it with PipeDreamFabricStrategy(microbatches=...)"
        )


def _describe(tensor: Any) -> str:
    if isinstance(tensor, Tensor):
        grad = ", requires grad" if tensor.requires_grad else ""
        return f"a tensor of shape {list(tensor.shape)}{grad}"
    return type(tensor).__name__
