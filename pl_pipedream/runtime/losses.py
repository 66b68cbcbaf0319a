"""What a rank knows of the training losses, per batch, so every rank can log a batch's mean.

Only the last stage computes losses, and a replica of it only those of its own minibatches. A
rank learns the others' from the gradient messages (each carries every loss its sender knows of
the minibatch's batch) and, on a replicated stage, from its replicas at each ``ALLREDUCE`` (one
small all-reduce of the batch's losses after the gradients'). A single-replica stage runs its
backward passes in minibatch order, so by the backward of a batch's last minibatch it knows the
whole batch; replicas of a stage together know it, and their ``ALLREDUCE`` after the batch's
backward passes shares it. Means are summed in minibatch order, so every rank that knows a batch
computes the identical number.

On a GPU the last stage's own losses arrive as ``runtime.streams.HostValue``s (``add_later``): each
is read, waiting for its copy to the host alone, the first time the book is asked for what it
knows, so a forward's end does not hold up the queueing of its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.runtime.channel import MinibatchLoss
from pl_pipedream.runtime.streams import HostValue

__all__ = ["LossBook"]


class LossBook:
    """The losses this rank knows, by batch and then by minibatch (indices of the current run)."""

    def __init__(self) -> None:
        self._batches: dict[int, dict[int, float]] = {}
        self._unread: list[tuple[int, int, HostValue]] = []  # (batch, minibatch, value)

    def add_later(self, batch: int, minibatch: int, value: float | HostValue) -> None:
        """This rank's loss of ``minibatch``: a number, or one on its way from the GPU."""
        if isinstance(value, HostValue):
            self._unread.append((batch, minibatch, value))
        else:
            self._batches.setdefault(batch, {})[minibatch] = value

    def _read(self) -> None:
        for batch, minibatch, value in self._unread:
            self._batches.setdefault(batch, {})[minibatch] = float(value)
        self._unread.clear()

    def add(self, batch: int, losses: tuple[MinibatchLoss, ...] | list[MinibatchLoss]) -> None:
        known = self._batches.setdefault(batch, {})
        for loss in losses:
            known[loss.minibatch] = loss.value

    def of(self, batch: int) -> tuple[MinibatchLoss, ...]:
        """Every loss of ``batch`` this rank knows, in minibatch order (what a message carries)."""
        self._read()
        known = self._batches.get(batch, {})
        return tuple(MinibatchLoss(i, known[i]) for i in sorted(known))

    def mean(self, batch: int, microbatches: int) -> float | None:
        """The mean loss of ``batch`` once all its ``microbatches`` losses are known, else None."""
        self._read()
        known = self._batches.get(batch, {})
        first = batch * microbatches
        if any(i not in known for i in range(first, first + microbatches)):
            return None
        return sum(known[i] for i in range(first, first + microbatches)) / microbatches

    def share(self, batch: int, microbatches: int, group: Any) -> None:
        """Merge what the replicas in ``group`` know of ``batch`` (a collective over ``group``):
        the maximum over replicas per minibatch, ``-inf`` standing for "not known here" (every
        replica that knows a loss knows the same value, so it arrives unchanged)."""
        self._read()
        first = batch * microbatches
        known = self._batches.setdefault(batch, {})
        table = torch.full((microbatches,), float("-inf"), dtype=torch.float64)
        for i, value in known.items():
            table[i - first] = value
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        for j, value in enumerate(table.tolist()):
            if value != float("-inf"):
                known[first + j] = value

    def forget_before(self, batch: int) -> None:
        """Drop the batches before ``batch`` (they will not be logged any more)."""
        for old in [b for b in self._batches if b < batch]:
            del self._batches[old]

    def clear(self) -> None:
        self._batches.clear()
        self._unread.clear()
