"""Whether a batch's data were finite: bad data told apart from training that diverged.

The loss exists on the last stage and the inputs enter at the first, but every rank runs its own
Lightning loop over the same batches (``core.data``), so every rank holds the whole batch,
inputs and targets alike. Each rank notes, per microbatch of each batch it feeds, whether every
floating-point tensor in it is finite: one reduction per tensor of the batch, each microbatch's
smallest and largest value (a NaN in a microbatch makes both NaN, an inf makes one of them
infinite, so both are finite exactly when every value is), whose result stays on the device (no
wait for the GPU) and is read, and reduced to a verdict, only when a non-finite loss is logged.
In the asynchronous modes the loss logged in a step belongs to a batch fed some steps earlier
(``PipelineRunner.loss_batch``), so the notes of the batches since the last finite logged loss
are kept; they are the batches whose bad data could have made the loss, directly or through the
weights they updated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pl_pipedream.trees import tensors

__all__ = ["FiniteData"]


class FiniteData:
    """Per batch fed (counted from 0 in the fit), whether each microbatch's data were finite."""

    def __init__(self) -> None:
        self._notes: dict[int, list[Tensor]] = {}

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
            finite = _finite(self._notes[batch])
            if finite is not None and not bool(finite.all()):
                return batch, int((~finite.cpu()).nonzero()[0])
        return None


def _finite_slices(data: Any, microbatches: int) -> list[Tensor]:
    """Per floating-point tensor of ``data`` (integer tensors are always finite; an empty one
    holds nothing), per slice of ``microbatches``: its smallest and largest values, or for a
    complex tensor whether it is finite."""
    notes = []
    for t in tensors(data):
        if not t.dim() or not t.numel():
            continue
        if t.is_complex():
            notes.append(torch.isfinite(t.reshape(microbatches, -1)).all(1))
        elif t.is_floating_point():
            flat = t.detach()
            # one slice: the whole tensor's (a reduction without a dim costs a third as much)
            whole = microbatches == 1
            notes.extend(flat.aminmax() if whole else flat.reshape(microbatches, -1).aminmax(dim=1))
    return notes


def _finite(notes: list[Tensor]) -> Tensor | None:
    """Per slice, whether the tensors ``_finite_slices`` noted were finite (a bool tensor on
    the first one's device); None when there were none."""
    if not notes:
        return None
    first = notes[0].device
    checks = [(n if n.dtype == torch.bool else torch.isfinite(n)).reshape(-1) for n in notes]
    return torch.stack([c.to(first) for c in checks]).all(0)
