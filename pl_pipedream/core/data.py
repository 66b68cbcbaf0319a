"""The same data on every rank: identical loaders, and a check that they really are.

Every rank runs its own Lightning loop over its own copy of the DataLoader; stage 0 feeds a
batch's inputs into the pipeline while the last stage scores the same batch's targets, so every
rank must draw the same batches in the same order, as one device would. Two parts:

* Identical loaders. The strategy keeps the DataLoader's own sampler (Lightning would put a
  ``DistributedSampler`` in, which forces shuffling on for training: ``lightning_patches.
  keep_user_samplers``), and ``seed_loader`` gives a ``RandomSampler`` that has no generator one
  seeded the same on every rank (else each rank draws its order from its own global RNG), and
  the DataLoader a generator for its workers' base seed, from one seed rank 0 broadcasts at setup.
* A check. Each rank fingerprints each microbatch it holds (``Fingerprints``: a bounded strided
  sample of every tensor's elements plus its shape, so it costs little for large batches); stage
  0's fingerprint rides forward with the activations and every later stage compares it with its
  own (``SameData``); in a plan of one stage, whose replicas pass no activations, the replicas
  compare theirs (``runtime.pipeline``). What seeding cannot fix (a custom sampler, an
  IterableDataset sharded by rank, random augmentation in the dataset or its workers) stops
  within the first training step. The batch setup draws (``core.loader_state``) moves no loader.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import DataLoader, RandomSampler

from pl_pipedream.core.errors import PipelineDataError
from pl_pipedream.trees import tensors

__all__ = [
    "Fingerprints",
    "SameData",
    "broadcast_seed",
    "fingerprint",
    "seed_loader",
]

SAMPLES = 256  # elements read per tensor, at most
_HOST_DTYPES = frozenset(  # the dtypes NumPy reads (not bfloat16, not complex)
    [
        torch.float16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.uint8,
        torch.bool,
    ]
)
_SCALES = torch.arange(1, SAMPLES + 1, dtype=torch.float64) / SAMPLES  # weights by position


def broadcast_seed() -> int:
    """A seed drawn on rank 0 (from its global RNG, left as it was) and sent to every rank
    (every rank must call it)."""
    box = [0]
    if dist.get_rank() == 0:
        with torch.random.fork_rng(devices=[]):
            box[0] = int(torch.empty((), dtype=torch.int64).random_())
    dist.broadcast_object_list(box, src=0)
    return int(box[0])


def seed_loader(loader: Any, seed: int) -> Any:
    """Give ``loader``'s unseeded ``RandomSampler`` (its sampler's or its batch sampler's) and
    the loader itself (its workers' base seed) generators seeded with ``seed``; generators the
    user set are kept. Returns ``loader`` (changed in place)."""
    if not isinstance(loader, DataLoader):
        return loader
    samplers = {id(s): s for s in (loader.sampler, getattr(loader.batch_sampler, "sampler", None))}
    for sampler in samplers.values():
        if isinstance(sampler, RandomSampler) and sampler.generator is None:
            sampler.generator = torch.Generator().manual_seed(seed)
    if loader.generator is None:
        loader.generator = torch.Generator().manual_seed(seed + 1)
    return loader


class LoaderSeeds:
    """One strategy's loaders seeded alike on every rank: a seed agreed at setup
    (``broadcast_seed``), and for the n-th loader seen ``seed + 2 n`` (``seed_loader``)."""

    def __init__(self) -> None:
        self.seed: int | None = None  # the same on every rank once agreed
        self.loaders = 0

    def agree(self) -> None:
        """Agree the seed (every rank must call it)."""
        self.seed = broadcast_seed()

    def seed_loader(self, loader: Any) -> Any:
        """``loader`` seeded with the next seed; as it is before the seed is agreed."""
        if self.seed is None:
            return loader
        self.loaders += 1
        return seed_loader(loader, self.seed + 2 * self.loaders)


class Fingerprints:
    """``fingerprint`` with the weights of each layout kept (a microbatch's shapes repeat): a
    few tensor operations per batch, not seven per tensor and microbatch. One per strategy; the
    weights live as long as it does (at most ``keep`` layouts, then they are built afresh)."""

    def __init__(self, keep: int = 64) -> None:
        self.keep = keep
        self._weights: dict[tuple[tuple[int, int], ...], Tensor] = {}

    def __call__(self, data: Any) -> float:
        """A number that differs, almost surely, between two different microbatches: for every
        tensor in ``data`` (nested tuples, lists, dicts), its shape and up to ``SAMPLES``
        elements at evenly spaced positions (a strided view: only those are read), each weighted
        by its position and its tensor's; values that are not tensors do not count. Equal data
        give the bit-identical number on every rank. The samples of all tensors are joined and
        weighted in one product."""
        return self.each(data, 1)[0]

    def each(self, batch: Any, microbatches: int) -> list[float]:
        """The fingerprint of each of the ``microbatches`` equal slices of ``batch`` along dim
        0 (``core.microbatches.slice_batch``), all in one product: row j of each tensor viewed
        as ``(microbatches, -1)`` is slice j's elements. Equal to ``[self(piece) for piece in
        slice_batch(batch, microbatches)]`` up to the rounding of the sums (a rank compares only
        fingerprints made the same way)."""
        found = tensors(batch, sort_keys=True)
        if microbatches > 1 and any(t.dim() == 0 or t.shape[0] % microbatches for t in found):
            raise ValueError(
                f"a batch must split into equal microbatches (shapes: "
                f"{[tuple(t.shape) for t in found]}, microbatches: {microbatches})"
            )
        # on the host, the samples are read and weighted through NumPy views: a NumPy operation
        # costs a fraction of a tensor operation's dispatch, which small batches pay per step
        host = all(t.device.type == "cpu" and t.dtype in _HOST_DTYPES for t in found)
        total = 0.0
        samples: list[Any] = []  # tensors, or NumPy arrays on the host
        layout: list[tuple[int, int]] = []  # (tensor index, samples taken) of each sampled tensor
        for index, tensor in enumerate(found):
            shape = tensor.shape
            if microbatches > 1:
                shape = torch.Size((shape[0] // microbatches, *shape[1:]))
            total += (index + 1) * sum((k + 1) * 7.0 * size for k, size in enumerate(shape))
            data = tensor.detach() if tensor.requires_grad else tensor
            rows = (
                data.numpy().reshape(microbatches, -1) if host else data.reshape(microbatches, -1)
            )
            if rows.shape[1] == 0:
                continue
            step = -(-rows.shape[1] // SAMPLES)  # every step-th element: at most SAMPLES of them
            samples.append(rows[:, ::step] if step > 1 else rows)
            layout.append((index, samples[-1].shape[1]))
        if not samples:
            return [total] * microbatches
        if host:
            array = np.concatenate(samples, axis=1).astype(np.float64, copy=False)
            weighting = self._weights_of(tuple(layout), torch.device("cpu")).numpy()
            sums = (array @ weighting).tolist()
            if not all(math.isfinite(v) for v in sums):  # NaN and inf read as fixed numbers
                np.nan_to_num(array, copy=False, nan=1.5, posinf=1e300, neginf=-1e300)
                sums = (array @ weighting).tolist()
            return [total + v for v in sums]
        first = samples[0]
        if all(t.dtype == first.dtype and t.device == first.device for t in samples):
            values = torch.cat(samples, dim=1).to(torch.float64)
        else:
            values = torch.cat([t.to(first.device, torch.float64) for t in samples], dim=1)
        weights = self._weights_of(tuple(layout), first.device)
        sums = (values @ weights).tolist()
        if not all(math.isfinite(v) for v in sums):  # NaN and inf read as fixed numbers
            sums = (values.nan_to_num_(1.5, 1e300, -1e300) @ weights).tolist()
        return [total + v for v in sums]

    def _weights_of(self, layout: tuple[tuple[int, int], ...], device: torch.device) -> Tensor:
        """Each sample's weight: its tensor's index + 1 times its position's (``_SCALES``)."""
        key = (*layout, (-1, hash(device)))
        weights = self._weights.get(key)
        if weights is None:
            if len(self._weights) >= self.keep:  # shapes that never settle: keep it small
                self._weights.clear()
            parts = [(index + 1) * _SCALES[:count] for index, count in layout]
            weights = self._weights[key] = torch.cat(parts).to(device)
        return weights


def fingerprint(data: Any) -> float:
    """``Fingerprints.__call__`` of ``data``, its weights built for this call alone."""
    return Fingerprints(keep=1)(data)


class SameData:
    """``Feed.fingerprint`` for one Lightning batch: the fingerprint of microbatch ``j`` of
    ``slices``, checked against stage 0's when one arrived. ``fingerprints`` keeps the weights
    from batch to batch (the strategy's own); without it they are kept for this batch only.
    Given the ``batch`` the slices were cut from, every slice is fingerprinted at the first
    call, in one pass (``Fingerprints.each``): every rank of a pipeline must be given it alike."""

    def __init__(
        self,
        slices: list[Any],
        describe: str,
        step: int,
        batch_idx: int,
        fingerprints: Fingerprints | None = None,
        batch: Any = None,
    ) -> None:
        self.slices = slices
        self.describe = describe  # "rank 1 (stage 1)"
        self.step = step
        self.batch_idx = batch_idx
        self.fingerprints = fingerprints or Fingerprints()
        self.batch = batch  # the batch ``slices`` were cut from: fingerprinted in one pass
        self._own: list[float] | None = None

    def __call__(self, j: int, received: float | None) -> float:
        if self.batch is None:
            own = self.fingerprints(self.slices[j])
        else:
            if self._own is None:
                self._own = self.fingerprints.each(self.batch, len(self.slices))
            own = self._own[j]
        if received is not None and received != own:
            raise PipelineDataError(
                f"every rank must train on the same batches in the same order ({self.describe}, "
                f"global step {self.step}, batch {self.batch_idx}, microbatch {j}: its data "
                f"differ from those another rank holds for it (stage 0's, or another replica's); "
                f"fingerprints {own!r} and {received!r}); the ranks' loaders give different "
                "batches (the batch setup draws leaves every loader as it was: a draw that "
                "cannot be undone stops at setup instead), so give every rank an identical "
                "DataLoader: the same dataset and sampler with no per-rank randomness (seed any "
                "sampler, generator or augmentation the same on every rank, e.g. with "
                "lightning.seed_everything), and no sharding of an IterableDataset by rank. "
                "PipeDreamStrategy keeps the DataLoader's own sampler and seeds an unseeded "
                "RandomSampler identically on every rank"
            )
        return own
