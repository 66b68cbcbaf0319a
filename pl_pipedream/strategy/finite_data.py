"""Whether a batch's data were finite: bad data told apart from training that diverged.

The loss exists on the last stage and the inputs enter at the first, but every rank runs its own
Lightning loop over the same batches (``strategy.data``), so every rank holds the whole batch,
inputs and targets alike. Each rank notes, per microbatch of each batch it feeds, whether every
floating-point tensor in it is finite: a few reductions per step that stay on the device (no
wait for the GPU), read only when a non-finite loss is logged. In the asynchronous modes the
loss logged in a step belongs to a batch fed some steps earlier (``PipelineRunner.loss_batch``),
so the notes of the batches since the last finite logged loss are kept; they are the batches
whose bad data could have made the loss, directly or through the weights they updated.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from pl_pipedream.runtime.boundary import map_tensors

__all__ = ["FiniteData"]


class FiniteData:
    """Per batch fed (counted from 0 in the fit), whether each microbatch's data were finite."""

    def __init__(self) -> None:
        self._notes: dict[int, list[Tensor | bool]] = {}

    def note(self, batch: int, microbatches: list[Any]) -> None:
        """Note batch ``batch``, given as its microbatches (any structure of tensors)."""
        self._notes[batch] = [_all_finite(piece) for piece in microbatches]

    def forget_through(self, batch: int) -> None:
        """Drop the notes of ``batch`` and every earlier one (their loss was finite)."""
        for old in [b for b in self._notes if b <= batch]:
            del self._notes[old]

    def first_bad(self, through: int) -> tuple[int, int] | None:
        """The first (batch, microbatch) up to batch ``through`` whose data held a NaN or inf;
        None when all were finite (reads the notes: on a GPU, waits for them)."""
        for batch in sorted(b for b in self._notes if b <= through):
            for j, finite in enumerate(self._notes[batch]):
                if not bool(finite):
                    return batch, j
        return None


def _all_finite(data: Any) -> Tensor | bool:
    """Whether every floating-point tensor in ``data`` is finite, as a 0-d tensor on its device
    (True when there is none: integer tensors are always finite)."""
    found: list[Tensor] = []
    map_tensors(found.append, data)
    checks = [torch.isfinite(t).all() for t in found if t.is_floating_point() or t.is_complex()]
    if not checks:
        return True
    if len(checks) == 1:
        return checks[0]
    first = checks[0].device
    return torch.stack([c.to(first) for c in checks]).all()
