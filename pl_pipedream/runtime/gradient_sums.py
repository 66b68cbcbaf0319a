"""The gradients of one update under way, summed over its backward passes, by parameter name.

Autograd returns a fresh tensor for each gradient, so the first gradient of a parameter is kept
as it is (a copy of a large gradient costs as much as a small backward pass); the sum is changed
in place only once it is a tensor this class made (or was handed: an all-reduce's result, the
Linear layers' sums), never a tensor autograd may also have returned elsewhere. ``mean`` divides
by the update's size, in place where it may, and starts the next update.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["GradientSums"]


class GradientSums:
    """Per-parameter gradient sums of the update under way (see the module docstring)."""

    def __init__(self) -> None:
        self._sums: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # names whose sum is a tensor nobody else holds

    def __bool__(self) -> bool:
        return bool(self._sums)

    def get(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        return self._sums.get(name, default)

    def __setitem__(self, name: str, total: torch.Tensor) -> None:
        """Make ``total`` the sum of ``name``: a tensor made for it (this class owns it)."""
        self._sums[name] = total
        self._owned.add(name)

    def pop(self, name: str, default: torch.Tensor | None = None) -> torch.Tensor | None:
        """Take ``name``'s sum out of this update (a tied parameter's, updated on its own)."""
        self._owned.discard(name)
        return self._sums.pop(name, default)

    def add(self, names: Sequence[str], grads: Sequence[torch.Tensor | None]) -> None:
        """Add one backward pass's gradients (``None``: the parameter was not used). A tensor
        autograd returned for two parameters is copied for the second."""
        shared = _repeated_ids(grads)
        for name, grad in zip(names, grads, strict=True):
            if grad is not None:
                self._add(name, grad, copy=id(grad) in shared)

    def _add(self, name: str, grad: torch.Tensor, copy: bool) -> None:
        held = self._sums.get(name)
        if held is None:
            self._sums[name] = grad.clone() if copy else grad
            if copy:
                self._owned.add(name)
        elif name in self._owned:
            held += grad
        else:
            self[name] = held + grad

    def add_totals(self, totals: dict[str, torch.Tensor]) -> None:
        """Add sums computed elsewhere into tensors of their own (the Linear layers' sums)."""
        for name, total in totals.items():
            held = self._sums.get(name)
            if held is not None:  # the same weight also reached autograd elsewhere
                total += held
            self[name] = total

    def all_reduce(
        self,
        params: Sequence[tuple[str, torch.Tensor]],
        group: Any,
        extra: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Sum these parameters' gradients over ``group`` (a stage's replicas) in one message:
        the sums, zeros for a parameter without one, laid end to end, then ``extra`` (the
        BatchNorm statistics, ``runtime.running_stats``), which comes back summed. ``extra``
        travels in a message of its own only where its dtype is not the gradients'."""
        if not params:
            if extra is not None:
                dist.all_reduce(extra, group=group)
            return extra
        parts = [self._sums.get(n, torch.zeros_like(p)).reshape(-1) for n, p in params]
        joined = extra is not None and extra.dtype == parts[0].dtype
        flat = torch.cat([*parts, extra] if joined else parts)  # type: ignore[list-item]
        dist.all_reduce(flat, group=group)
        offset = 0
        for name, param in params:
            self[name] = flat[offset : offset + param.numel()].view_as(param)
            offset += param.numel()
        if joined:
            return flat[offset:]
        if extra is not None:
            dist.all_reduce(extra, group=group)
        return extra

    def mean(self, count: int) -> dict[str, torch.Tensor]:
        """Every sum divided by ``count`` (the update's minibatches); the next update starts."""
        gradients: dict[str, torch.Tensor] = {}
        for name, total in self._sums.items():
            if count != 1:
                total = total.div_(count) if name in self._owned else total / count
            gradients[name] = total
        self._sums, self._owned = {}, set()
        return gradients


def _repeated_ids(tensors: Sequence[torch.Tensor | None]) -> set[int]:
    """Ids of the tensor objects that occur more than once in ``tensors``."""
    seen: set[int] = set()
    repeated: set[int] = set()
    for tensor in tensors:
        if tensor is not None:
            (repeated if id(tensor) in seen else seen).add(id(tensor))
    return repeated
