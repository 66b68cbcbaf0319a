"""A batch split into microbatches: every tensor sliced along dim 0 into equal parts.

One rule for every front end (the Lightning strategy, the plain ``Pipeline``): a batch of
``microbatches=m`` is split into ``m`` equal slices, tensor by tensor through tuples (named
tuples kept), lists and dicts; anything that is not a tensor is repeated in every slice.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from pl_pipedream.trees import tensors

__all__ = ["slice_batch"]


def slice_batch(batch: Any, microbatches: int) -> list[Any]:
    """Split every tensor of a batch along dim 0 into ``microbatches`` equal parts; one part is
    the batch itself (checked as any split is, but not rebuilt: no tensor operation)."""
    if microbatches == 1:
        for tensor in tensors(batch):
            _check(tensor, 1)
        return [batch]
    if isinstance(batch, Tensor):
        _check(batch, microbatches)
        return list(batch.chunk(microbatches))
    if isinstance(batch, (tuple, list)):
        parts = [slice_batch(item, microbatches) for item in batch]
        if isinstance(batch, tuple):
            rebuild = getattr(type(batch), "_make", type(batch))  # a namedtuple's, else tuple
            return [rebuild(p[j] for p in parts) for j in range(microbatches)]
        return [[p[j] for p in parts] for j in range(microbatches)]
    if isinstance(batch, dict):
        split = {key: slice_batch(value, microbatches) for key, value in batch.items()}
        return [{key: value[j] for key, value in split.items()} for j in range(microbatches)]
    return [batch] * microbatches


def _check(tensor: Tensor, microbatches: int) -> None:
    size = tensor.shape[0] if tensor.dim() else 0
    if size % microbatches != 0 or size == 0:
        raise ValueError(
            f"a batch must split into equal microbatches (batch size: {size}, microbatches: "
            f"{microbatches}); use a batch size that is a multiple of {microbatches} (and "
            "drop_last=True in the DataLoader)"
        )
