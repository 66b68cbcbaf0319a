"""How a stage computes in another precision: the context of its forward passes, its loss scale.

The runtime knows no precision plugin; a front end describes what it needs with two plain
callables. ``forward()`` is entered around every forward pass the stage runs (the first, the
recomputed one of ``recompute``, and on the last stage the loss after it), as a single device
enters it around the whole model's forward: ``torch.autocast`` for mixed precision, a default
dtype for the true precisions. Backward passes, gradient sums and updates run outside it.

``scale(seed)`` (fp16 mixed precision) multiplies the seed of each of the last stage's backward
passes by the loss scale, as ``GradScaler.scale(loss).backward()`` does on one device: every
gradient that travels back then carries the one scale of the pipeline, by which every stage
later unscales its own parameters' gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["StagePrecision"]


@dataclass(frozen=True)
class StagePrecision:
    """``forward``: a fresh context for each forward pass; ``scale``: the loss scale applied
    to a backward seed (None: no loss scaling)."""

    forward: Callable[[], AbstractContextManager[Any]] = nullcontext
    scale: Callable[[torch.Tensor], torch.Tensor] | None = None

    def seed(self, loss: torch.Tensor, factor: float) -> torch.Tensor | None:
        """The seed of a backward pass from ``loss``: ``factor`` (1/microbatches where the last
        stage averages) times the loss scale; None where both are 1 (autograd's own seed)."""
        if self.scale is None:
            return None if factor == 1.0 else torch.full_like(loss, factor)
        return self.scale(torch.full_like(loss, factor))
