"""Lightning batches in the pipeline: microbatches, the first stage's inputs, ``self(x)``.

A Lightning batch is split along dim 0 into ``microbatches`` equal slices. The first stage takes
each slice's inputs: ``pipeline_split_batch(batch)[0]`` when the LightningModule defines it, the
first element of an ``(inputs, targets)`` pair, or a lone tensor as it is; one rule for training
and evaluation alike. The inputs may be any structure (a tensor, a tuple, a dict...): the first
layer gets them as its one argument, as ``nn.Sequential`` would. The last stage runs the user's
``training_step`` (or evaluation hook) on the whole slice, with ``self(x)`` returning the
pipeline's output for it: whatever the last layer returned; what it logs is captured per
microbatch (``strategy.step_logs``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.core.microbatches import slice_batch
from pl_pipedream.strategy import lightning_patches
from pl_pipedream.strategy.step_logs import LOSS_NAME, StepLogCapture
from pl_pipedream.trees import map_tensors

__all__ = [
    "TrainingBatch",
    "first_stage_input",
    "forward_returns",
    "shape_forward",
    "slice_batch",
]


def first_stage_input(module: nn.Module, batch: Any) -> Any:
    """What the first stage's first layer takes from ``batch``."""
    split = getattr(module, "pipeline_split_batch", None)
    if split is not None:
        return split(batch)[0]
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        return batch[0]
    if isinstance(batch, Tensor):
        return batch
    raise ValueError(
        f"a pipeline batch must be (inputs, targets) or a tensor (got: {type(batch).__name__}); "
        "return such batches from the dataloader or define "
        "pipeline_split_batch(batch) -> (inputs, targets) on the LightningModule"
    )


class TrainingBatch:
    """One Lightning batch as the pipeline sees it: microbatch ``j``'s inputs for the first
    stage, and its loss from the user's ``training_step`` on the last stage. The loss is not read
    here (on a GPU that would make the host wait for the device after every forward); a
    non-finite loss travels on and the strategy's divergence watch acts on the logged mean
    (``core.divergence``)."""

    def __init__(
        self,
        module: Any,
        batch: Any,
        batch_idx: int,
        microbatches: int,
        describe: str,
    ) -> None:
        self.module = module
        self.batch_idx = batch_idx
        self.describe = describe  # "rank 1 (stage 1)", for errors
        self.slices = slice_batch(batch, microbatches)
        self._inputs = [first_stage_input(module, piece) for piece in self.slices]
        self.logs = StepLogCapture()
        self.logged = self.logs.logged  # what microbatch j's training_step logged

    def inputs(self, j: int) -> Any:
        return self._inputs[j]

    def loss(self, output: Any, j: int) -> Tensor:
        """Run ``training_step`` on microbatch ``j`` with ``self(x)`` returning ``output``."""
        module = self.module
        with forward_returns(module, output), self.logs.capture(module, j):
            result = module.training_step(self.slices[j], self.batch_idx)
        loss = result["loss"] if isinstance(result, dict) else result
        if not isinstance(loss, Tensor):
            raise ValueError(
                "training_step must return the loss tensor (or a dict with 'loss') on the last "
                f"stage (returned: {type(result).__name__})"
            )
        return loss

    def log_loss(self, finished: float | None, device: torch.device, log: bool = True) -> Tensor:
        """Log ``train_loss`` (unless not ``log``): ``finished``, the mean loss of the newest
        batch whose backward passes have all finished (``PipelineRunner.loss``, the same on every
        rank). Returns it, as ``training_step`` must return a tensor; while the pipeline is still
        filling for the first time there is none: nothing is logged and the tensor returned is
        NaN."""
        if finished is None:
            return torch.tensor(float("nan"), device=device)
        loss = torch.tensor(finished, device=device)
        if log:
            lightning_patches.log_step_value(self.module, LOSS_NAME, loss)
        return loss


@contextmanager
def forward_returns(module: nn.Module, output: Any) -> Iterator[None]:
    """Make ``module(x)`` return ``output`` (the pipeline's result) for the duration."""
    previous = module.__dict__.get("forward")
    module.forward = lambda *args, **kwargs: output  # type: ignore[method-assign]
    try:
        yield
    finally:
        if previous is None:
            del module.forward
        else:
            module.forward = previous  # type: ignore[method-assign]


def shape_forward(layers: nn.Sequential) -> Callable[..., Any]:
    """A forward for calls outside the pipeline (Lightning's model summary): it runs every
    layer on the ``meta`` device, so it yields the right shapes without the other stages'
    weights."""

    def forward(*args: Any, **kwargs: Any) -> Any:
        # model(x) passes x on as it is; model(*example) for a tuple example passes the tuple
        value: Any = _to_meta(args[0] if len(args) == 1 else (args or kwargs))
        for layer in layers:
            state = {n: _to_meta(t) for n, t in (*layer.named_parameters(), *layer.named_buffers())}
            value = torch.func.functional_call(layer, state, (value,))
        return value

    return forward


def _to_meta(value: Any) -> Any:
    return map_tensors(lambda t: t.detach().to("meta"), value)
