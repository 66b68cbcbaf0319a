"""The collectives Lightning asks a strategy for, over every rank of the pipeline.

Lightning calls them at setup, around evaluation and checkpoints, and for ``sync_dist`` logging;
none runs inside a training step, where ranks are coupled only by the pipeline's messages.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import Tensor

__all__ = ["barrier", "broadcast", "reduce"]


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def broadcast(obj: Any, src: int = 0) -> Any:
    """``obj`` as rank ``src`` has it (any picklable object)."""
    if not dist.is_initialized():
        return obj
    shared = [obj]
    dist.broadcast_object_list(shared, src=src)
    return shared[0]


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """A reduced copy of ``tensor`` over ``group``; anything but a tensor comes back as is."""
    if not isinstance(tensor, Tensor) or not dist.is_initialized():
        return tensor
    op, mean = reduce_op_of(reduce_op)
    tensor = tensor.clone()
    dist.all_reduce(tensor, op=op, group=group)
    return tensor / dist.get_world_size(group) if mean else tensor


def reduce_op_of(reduce_op: Any) -> tuple[Any, bool]:
    """torch's reduce op for Lightning's ``reduce_op`` (a ``ReduceOp``, its name, or "mean"),
    and whether to divide by the group's size afterwards (gloo has no ``AVG``)."""
    if reduce_op is None:
        return dist.ReduceOp.SUM, False
    if isinstance(reduce_op, str):
        name = reduce_op.lower()
        if name in ("mean", "avg"):
            return dist.ReduceOp.SUM, True
        if name in ("sum", "max", "min", "product"):
            return getattr(dist.ReduceOp, name.upper()), False
        raise ValueError(
            "reduce_op must be a torch.distributed.ReduceOp or one of 'sum', 'mean', 'avg', "
            f"'max', 'min', 'product' (reduce_op: {reduce_op!r})"
        )
    if reduce_op == dist.ReduceOp.AVG:
        return dist.ReduceOp.SUM, True
    return reduce_op, False
