"""BatchNorm running statistics of a replicated stage, made one at every replica all-reduce.

Each replica of a stage runs the forwards of its own minibatches (1F1B-RR: minibatch ``i`` on
replica ``i mod r``), so each BatchNorm layer updates its running mean and variance from those
alone. The rule: at every ``ALLREDUCE`` (one per update, in every sync mode), every replica's
running statistics become what one layer would hold after running, in minibatch order, every
forward that any replica ran since the previous all-reduce, from the statistics all held then;
``num_batches_tracked`` counts each of those forwards once. On one device that is running the
same microbatches one after another, for any ``momentum`` (``None`` included: the cumulative
average). Between two all-reduces the replicas differ; evaluation and checkpoints come after a
drain, whose last all-reduce follows every forward.

A forward's batch statistic ``x`` is read off the layer's own update ``r' = (1 - f) r + f x``
(``f`` the momentum, or ``1 / num_batches_tracked``): ``x = r + (r' - r) / f``, its rounding
error is that of ``r``. The rule is linear in the ``x``: ``r_K = a r_0 + sum_j c_j x_j``
with ``a = (1 - f)^K, c_j = f (1 - f)^(K - 1 - p_j)`` (``p_j`` the forward's position among
the ``K``) or, cumulative, ``a = n_0 / (n_0 + K), c_j = 1 / (n_0 + K)``. A replica weighs its
own forwards from its newest one, and sends that sum, its newest minibatch and its count in a
slot of its own; the all-reduce (the same message as the gradients', ``GradientSums``) puts
every slot on every replica, which then rescales each slot by the forwards that followed it.
The forwards since the last all-reduce are consecutive minibatches in every sync mode; a layer
that skipped some of them is refused, naming the rule it breaks.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["RunningStats"]

_HEADER = 3  # per layer and replica: newest minibatch (high, low part), forwards
_SPLIT = 4096  # a minibatch index travels as two floats, each exact in float32


class RunningStats:
    """Records the BatchNorm forwards of one replica and combines every replica's at each
    all-reduce (see the module docstring). ``of`` returns None where there is nothing to do."""

    def __init__(self, layers: list[_BatchNorm], replicas: int, describe: str) -> None:
        self.layers = layers
        self.replicas = replicas
        self.describe = describe
        wide = any(_stats(layer)[0].dtype == torch.float64 for layer in layers)
        self.dtype = torch.float64 if wide else torch.float32  # of the message
        self._minibatch: int | None = None
        self._before: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._start: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._seen: dict[int, list[tuple[int, torch.Tensor, torch.Tensor]]] = {}
        self._handles: list[Any] = []
        for index, layer in enumerate(layers):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(index)))
            self._handles.append(layer.register_forward_hook(self._post_hook(index)))

    @classmethod
    def of(cls, module: nn.Module, replicas: int, describe: str) -> RunningStats | None:
        """The stage's BatchNorm layers that keep running statistics, if it is replicated."""
        layers = [
            m
            for m in module.modules()
            if isinstance(m, _BatchNorm) and m.track_running_stats and m.running_mean is not None
        ]
        return cls(layers, replicas, describe) if layers and replicas > 1 else None

    @property
    def pending(self) -> bool:
        """Forwards recorded since the last all-reduce."""
        return bool(self._seen)

    @contextmanager
    def forward(self, minibatch: int) -> Iterator[None]:
        """Record the BatchNorm updates of ``minibatch``'s forward (the executor's own; a
        recomputed forward runs on copies of the buffers, outside this)."""
        self._minibatch = minibatch
        try:
            yield
        finally:
            self._minibatch = None
            self._before.clear()

    def close(self) -> None:
        """Take the hooks off the layers."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ----- recording --------------------------------------------------------------------------

    def _pre_hook(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: Any) -> None:
            if self._minibatch is None or not layer.training:
                return
            mean, var = (stat.detach().clone() for stat in _stats(layer))
            self._before[index] = (mean, var)
            if index not in self._start:
                count = layer.num_batches_tracked
                self._start[index] = (mean, var, None if count is None else count.clone())

        return hook

    def _post_hook(self, index: int) -> Any:
        def hook(layer: _BatchNorm, args: Any, output: Any) -> None:
            before = self._before.pop(index, None)
            if before is None or self._minibatch is None:
                return
            scale: torch.Tensor | float  # 1 / f, on the device (no copy from the host)
            if layer.momentum is None:  # the cumulative average: f = 1 / forwards counted
                scale = _counted(layer).to(before[0].dtype)
            else:  # (momentum 0: the statistics never change, and x weighs nothing)
                scale = 1.0 / layer.momentum if layer.momentum else 0.0
            now = _stats(layer)
            mean = before[0] + (now[0].detach() - before[0]) * scale
            var = before[1] + (now[1].detach() - before[1]) * scale
            self._seen.setdefault(index, []).append((self._minibatch, mean, var))

        return hook

    # ----- combining --------------------------------------------------------------------------

    def message(self, replica: int) -> torch.Tensor:
        """This replica's part of the all-reduce: every layer's header in its slot, then every
        layer's weighted sums of means and variances in its slot; zeros elsewhere. Float32 (64
        if a layer keeps float64 statistics), on the layers' device."""
        dtype = self.dtype
        device = _stats(self.layers[0])[0].device
        headers = torch.zeros(len(self.layers), self.replicas, _HEADER, dtype=dtype)
        sums = []
        for index, layer in enumerate(self.layers):
            size = _stats(layer)[0].numel()
            slots = torch.zeros(self.replicas, 2, size, dtype=dtype, device=device)
            seen = self._seen.get(index, [])
            if seen:
                newest = self._check_own(index, [i for i, _, _ in seen])
                headers[index, replica] = torch.tensor(
                    [newest // _SPLIT, newest % _SPLIT, len(seen)], dtype=dtype
                )
                for i, mean, var in seen:
                    weight = _weight(layer, newest - i)
                    slots[replica, 0] += weight * mean.to(dtype)
                    slots[replica, 1] += weight * var.to(dtype)
            sums.append(slots.reshape(-1))
        return torch.cat([headers.reshape(-1).to(device), *sums])

    def combine(self, reduced: torch.Tensor) -> None:
        """Set every layer's statistics from the all-reduced ``message``s (every replica's)."""
        count = len(self.layers) * self.replicas * _HEADER
        headers = reduced[:count].view(len(self.layers), self.replicas, _HEADER).tolist()
        offset = count
        for index, layer in enumerate(self.layers):
            size = _stats(layer)[0].numel()
            slots = reduced[offset : offset + 2 * self.replicas * size]
            offset += 2 * self.replicas * size
            seen = [(int(h) * _SPLIT + int(lo), int(k)) for h, lo, k in headers[index]]
            if any(k for _, k in seen):
                self._set(index, layer, seen, slots.view(self.replicas, 2, size))
        self._seen.clear()
        self._start.clear()

    def _set(
        self,
        index: int,
        layer: _BatchNorm,
        seen: list[tuple[int, int]],
        slots: torch.Tensor,
    ) -> None:
        """One layer's statistics from every replica's slot (``seen``: per replica its newest
        minibatch and its count of forwards)."""
        total = sum(k for _, k in seen)
        newest = max(n for n, k in seen if k)
        union = {n - self.replicas * k for n, count in seen for k in range(count)}
        if union != set(range(newest - total + 1, newest + 1)):
            raise RuntimeError(
                f"{self.describe}: the replicas' BatchNorm forwards since the last all-reduce "
                f"must be consecutive minibatches (layer {_name(layer)}, minibatches: "
                f"{sorted(union)}); a replicated stage must run every BatchNorm layer in every "
                "forward, or use a plan without replicas"
            )
        mean, var, count = self._start.get(index) or _current(layer)
        mean, var = mean.to(slots.dtype), var.to(slots.dtype)
        keep: torch.Tensor | float
        if layer.momentum is None:  # (tensor arithmetic: the count stays on the device)
            start = torch.zeros((), device=slots.device) if count is None else count
            share = 1.0 / (start.to(slots.dtype) + total)
            keep, scales = start * share, [share if k else 0.0 for _, k in seen]
        else:
            decay = 1.0 - layer.momentum
            keep = decay**total  # each slot: the other replicas' forwards after its newest
            scales = [decay ** (newest - n) if k else 0.0 for n, k in seen]
        combined = sum(scale * slot for scale, slot in zip(scales, slots, strict=True))
        # Through ``.data``, as BatchNorm's own update: a forward whose backward is still to
        # come saved these buffers, and autograd would refuse a write it can see.
        running_mean, running_var = _stats(layer)
        running_mean.data.copy_(keep * mean + combined[0])
        running_var.data.copy_(keep * var + combined[1])
        if layer.num_batches_tracked is not None and count is not None:
            layer.num_batches_tracked.data.copy_(count + total)

    def _check_own(self, index: int, minibatches: list[int]) -> int:
        """This replica's newest minibatch; its forwards must be its consecutive ones."""
        newest = minibatches[-1]
        expected = [newest - self.replicas * k for k in range(len(minibatches))][::-1]
        if minibatches != expected:
            raise RuntimeError(
                f"{self.describe}: a replica's BatchNorm forwards since the last all-reduce must "
                f"be its consecutive minibatches (layer {_name(self.layers[index])}, minibatches: "
                f"{minibatches}); a replicated stage must run every BatchNorm layer in every "
                "forward, or use a plan without replicas"
            )
        return newest


def _weight(layer: _BatchNorm, later: int) -> float:
    """The weight of a forward's statistic ``later`` minibatches before its replica's newest
    (its slot is rescaled by the forwards that follow that one)."""
    if layer.momentum is None:
        return 1.0
    return layer.momentum * (1.0 - layer.momentum) ** later


def _current(layer: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A layer's statistics now (no forward of this replica changed them since the last
    all-reduce)."""
    count = layer.num_batches_tracked
    mean, var = _stats(layer)
    return mean.clone(), var.clone(), None if count is None else count.clone()


def _name(layer: _BatchNorm) -> str:
    return f"{type(layer).__name__}({layer.num_features})"


def _stats(layer: _BatchNorm) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's running mean and variance (``RunningStats.of`` keeps only layers that have
    them; torch types them as optional for the layers that do not)."""
    mean, var = layer.running_mean, layer.running_var
    assert mean is not None and var is not None
    return mean, var


def _counted(layer: _BatchNorm) -> torch.Tensor:
    """The forwards a layer has counted (kept, as the statistics, when it tracks them)."""
    count = layer.num_batches_tracked
    assert count is not None
    return count
