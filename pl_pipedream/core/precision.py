"""One loss scale for the whole pipeline, without a framework: the stages agree on skipping.

fp16 mixed precision scales the last stage's loss, so every gradient that crosses a cut carries
the one scale, and every stage unscales its own parameters' gradients by a ``GradScaler`` of the
same settings. An inf or NaN found on any stage must skip the step on every stage, and every
scaler must back off (or grow) alike, so that the scales stay equal and evolve as one device's.
``share_found_inf`` makes ``unscale_`` agree across ranks (an all-reduce, MAX, of the inf/NaN
flag); ``found_inf`` reads the agreed flag. The Lightning strategy (``strategy.precision``) and
the plain engine (``engine.precision``) both use them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.optim import Optimizer

__all__ = ["found_inf", "share_found_inf"]


def share_found_inf(scaler: torch.amp.GradScaler, device: torch.device, group: Any = None) -> None:
    """Make ``scaler.unscale_(optimizer)`` agree with every rank of ``group`` (all by default):
    after unscaling, the inf/NaN flag of the optimizer's gradients becomes its maximum over the
    ranks, so ``scaler.step`` skips, and ``scaler.update`` backs off, on every stage or on none.
    Every rank must unscale the same optimizers in the same order. Writes the flag where torch
    keeps it, ``GradScaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]``, as
    torch's own ``ShardedGradScaler`` does; a stage without gradients gets one for ``device``."""
    unscale = type(scaler).unscale_.__get__(scaler)  # the class's: setting up twice wraps once

    def unscale_(optimizer: Optimizer) -> None:
        unscale(optimizer)
        found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
        flag = torch.zeros((), dtype=torch.float32, device=device)  # as torch keeps it
        for value in found.values():
            flag = torch.maximum(flag, value.to(device).reshape(()))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        for value in found.values():
            value.copy_(flag.reshape(value.shape))
        if not found:
            found[device] = flag

    scaler.unscale_ = unscale_  # type: ignore[method-assign]


def found_inf(scaler: torch.amp.GradScaler, optimizer: Optimizer) -> bool:
    """Whether ``scaler.unscale_(optimizer)`` found an inf or NaN (on any rank, once
    ``share_found_inf`` ran): ``scaler.step`` skips exactly then."""
    found = scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"]
    return bool(sum(value.item() for value in found.values()))
