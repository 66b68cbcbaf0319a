"""What a rank knows of the training losses, per batch, so every rank can log a batch's mean.

Only the last stage computes losses, and a replica of it only those of its own minibatches. A
rank learns the others' from the gradient messages (each carries every loss its sender knows of
the minibatch's batch) and, on a replicated stage, from its replicas at each ``ALLREDUCE`` (one
small all-reduce of the batch's losses after the gradients'). A single-replica stage runs its
backward passes in minibatch order, so by the backward of a batch's last minibatch it knows the
whole batch; replicas of a stage together know it, and their ``ALLREDUCE`` after the batch's
backward passes shares it. Means are summed in minibatch order, so every rank that knows a batch
computes the identical number.

Beside each loss the book keeps what else the loss function logged for that minibatch ((key,
value) pairs, the keys opaque here): they travel with the loss, so every rank learns them at the
same point. Replicas share them in a second collective, run only when some replica knows such
values for the batch (a flag in the losses' all-reduce says so), so a run that logs nothing
pays nothing for it.

On a GPU the last stage's own losses arrive as ``runtime.streams.HostValue``s (``add_later``): each
is read, waiting for its copy to the host alone, the first time the book is asked for what it
knows, so a forward's end does not hold up the queueing of its backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.runtime.frames import MinibatchLoss
from pl_pipedream.runtime.streams import HostValue

__all__ = ["LossBook", "Logged"]

Logged = tuple[tuple[str, float], ...]  # what one minibatch logged besides its loss


def _read_logged(logged: tuple[tuple[str, float | HostValue], ...]) -> Logged:
    return tuple((key, float(value)) for key, value in logged)


class LossBook:
    """The losses this rank knows, by batch and then by minibatch (indices of the current run)."""

    def __init__(self) -> None:
        self._batches: dict[int, dict[int, float]] = {}
        self._logged: dict[int, dict[int, Logged]] = {}  # batch -> minibatch -> logged
        # (batch, minibatch, loss, logged), values still on their way from the GPU
        self._unread: list[tuple[int, int, Any, tuple[tuple[str, Any], ...]]] = []

    def add_later(
        self,
        batch: int,
        minibatch: int,
        value: float | HostValue,
        logged: tuple[tuple[str, float | HostValue], ...] = (),
    ) -> None:
        """This rank's loss of ``minibatch`` and what else it logged: numbers, or numbers on
        their way from the GPU."""
        if isinstance(value, HostValue) or any(isinstance(v, HostValue) for _, v in logged):
            self._unread.append((batch, minibatch, value, logged))
            return
        self._batches.setdefault(batch, {})[minibatch] = value  # type: ignore[assignment]
        if logged:
            self._logged.setdefault(batch, {})[minibatch] = logged  # type: ignore[assignment]

    def _read(self) -> None:
        for batch, minibatch, value, logged in self._unread:
            self._batches.setdefault(batch, {})[minibatch] = float(value)
            if logged:
                self._logged.setdefault(batch, {})[minibatch] = _read_logged(logged)
        self._unread.clear()

    def add(self, batch: int, losses: tuple[MinibatchLoss, ...] | list[MinibatchLoss]) -> None:
        known = self._batches.setdefault(batch, {})
        for loss in losses:
            known[loss.minibatch] = loss.value
            if loss.logged:
                self._logged.setdefault(batch, {})[loss.minibatch] = loss.logged

    def of(self, batch: int) -> tuple[MinibatchLoss, ...]:
        """Every loss of ``batch`` this rank knows, in minibatch order (what a message carries),
        each with what it logged."""
        self._read()
        known = self._batches.get(batch, {})
        logged = self._logged.get(batch, {})
        return tuple(MinibatchLoss(i, known[i], logged.get(i, ())) for i in sorted(known))

    def logged(self, batch: int, microbatches: int) -> tuple[Logged, ...]:
        """What each of ``batch``'s minibatches logged besides its loss, in minibatch order."""
        self._read()
        logged = self._logged.get(batch, {})
        first = batch * microbatches
        return tuple(logged.get(i, ()) for i in range(first, first + microbatches))

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
        replica that knows a loss knows the same value, so it arrives unchanged); the table's
        last entry says whether any replica knows logged values, which a gather then shares."""
        self._read()
        first = batch * microbatches
        known = self._batches.setdefault(batch, {})
        table = torch.full((microbatches + 1,), float("-inf"), dtype=torch.float64)
        for i, value in known.items():
            table[i - first] = value
        logged = self._logged.get(batch, {})
        table[microbatches] = 1.0 if logged else 0.0
        dist.all_reduce(table, op=dist.ReduceOp.MAX, group=group)
        values = table.tolist()
        for j, value in enumerate(values[:microbatches]):
            if value != float("-inf"):
                known[first + j] = value
        if values[microbatches] > 0:
            gathered: list[Any] = [None] * dist.get_world_size(group)
            dist.all_gather_object(gathered, logged, group=group)
            for other in gathered:
                self._logged.setdefault(batch, {}).update(other)

    def forget_before(self, batch: int) -> None:
        """Drop the batches before ``batch`` (they will not be logged any more)."""
        for old in [b for b in self._batches if b < batch]:
            del self._batches[old]
        for old in [b for b in self._logged if b < batch]:
            del self._logged[old]

    def clear(self) -> None:
        self._batches.clear()
        self._logged.clear()
        self._unread.clear()
