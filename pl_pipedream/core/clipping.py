"""Clipping a stage's gradients by a norm, over the stage or over the whole pipeline.

``clip_global_norm`` scales the gradients so that their norm over every stage is at most the
limit, as ``torch.nn.utils.clip_grad_norm_`` over the whole model does on one device: each rank
sums its stage's squares, one all-reduce over every rank adds them (replicas of a stage hold the
same gradient, so each counts ``1 / replicas``; a tied parameter's holders hold the same one, so
only its first stage counts it), and every rank scales by the same coefficient. Every rank must
call it at its stage's update of the same batch: the flushed modes, where each stage updates
once per batch, after it sent its last gradient upstream.

``clip_stage_norm`` scales by the norm of the stage's own gradients, no collective: what the
modes that update inside the pipeline can do, where stages update at different times.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = ["clip_global_norm", "clip_stage_norm"]

EPSILON = 1e-6  # as torch.nn.utils.clip_grad_norm_


def clip_global_norm(
    grads: list[Tensor],
    counted: list[Tensor],
    max_norm: float,
    replicas: int,
    device: torch.device,
) -> float:
    """Scale ``grads`` in place so that the norm over every rank's ``counted`` gradients is at
    most ``max_norm``; returns that norm (every rank must call it)."""
    square = _squares(counted, device) / replicas
    dist.all_reduce(square)
    norm = float(square.sqrt())
    _scale(grads, max_norm, norm)
    return norm


def clip_stage_norm(grads: list[Tensor], max_norm: float) -> float:
    """Scale ``grads`` in place so that their own norm is at most ``max_norm``; returns it."""
    device = grads[0].device if grads else torch.device("cpu")
    norm = float(_squares(grads, device).sqrt())
    _scale(grads, max_norm, norm)
    return norm


def _squares(grads: list[Tensor], device: torch.device) -> Tensor:
    """The sum of the gradients' squared entries, in float64 on ``device``."""
    square = torch.zeros((), dtype=torch.float64, device=device)
    for grad in grads:
        square += grad.detach().double().pow(2).sum()
    return square


def _scale(grads: list[Tensor], max_norm: float, norm: float) -> None:
    coefficient = float(max_norm) / (norm + EPSILON)
    if coefficient < 1.0:
        for grad in grads:
            grad.mul_(coefficient)
