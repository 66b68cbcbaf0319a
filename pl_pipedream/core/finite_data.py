"""Whether a batch's data were finite: bad data told apart from training that diverged.

The loss exists on the last stage and the inputs enter at the first, but every rank runs its own
Lightning loop over the same batches (``core.data``), so every rank holds the whole batch,
inputs and targets alike. Each rank notes, per microbatch of each batch it feeds, whether every
floating-point tensor in it is finite: one reduction per tensor of the batch, whose result stays
on the device (no wait for the GPU) and is read only when a non-finite loss is logged. In the
asynchronous modes the loss logged in a step belongs to a batch fed some steps earlier
(``PipelineRunner.loss_batch``), so the notes of the batches since the last finite logged loss
are kept; they are the batches whose bad data could have made the loss, directly or through the
weights they updated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pl_pipedream.runtime.trees import tensors

__all__ = ["FiniteData"]


class FiniteData:
    """Per batch fed (counted from 0 in the fit), whether each microbatch's data were finite."""

    def __init__(self) -> None:
        self._notes: dict[int, Tensor | None] = {}

    def note(self, batch: int, data: Any, microbatches: int) -> None:
        """Note batch ``batch``: ``data`` (any structure of tensors), split along dim 0 into
        ``microbatches`` equal slices (``core.microbatches.slice_batch``)."""
        self._notes[batch] = _finite_slices(data, microbatches)

    def forget_through(self, batch: int) -> None:
        """Drop the notes of ``batch`` and every earlier one (their loss was finite)."""
        for old in [b for b in self._notes if b <= batch]:
            del self._notes[old]

    def first_bad(self, through: int) -> tuple[int, int] | None:
        """The first (batch, microbatch) up to batch ``through`` whose data held a NaN or inf;
        None when all were finite (reads the notes: on a GPU, waits for them)."""
        for batch in sorted(b for b in self._notes if b <= through):
            finite = self._notes[batch]
            if finite is not None and not bool(finite.all()):
                return batch, int((~finite.cpu()).nonzero()[0])
        return None


def _finite_slices(data: Any, microbatches: int) -> Tensor | None:
    """Per slice of ``data``, whether its floating-point tensors are finite (a bool tensor of
    ``microbatches`` on the first tensor's device); None when there is no such tensor (integer
    tensors are always finite)."""
    floating = [t for t in tensors(data) if t.dim() and (t.is_floating_point() or t.is_complex())]
    checks = [torch.isfinite(t.reshape(microbatches, -1)).all(1) for t in floating]
    if not checks:
        return None
    if len(checks) == 1:
        return checks[0]
    first = checks[0].device
    return torch.stack([c.to(first) for c in checks]).all(0)
