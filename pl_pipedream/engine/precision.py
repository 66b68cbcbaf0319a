"""``Pipeline(precision=...)``: the precision flag of a plain loop, as the runtime needs it.

The flags are Lightning's names, so that every front end passes what its users already write
(Fabric's ``precision=``, Accelerate's ``mixed_precision`` mapped by ``pl_pipedream.accelerate``):

* ``"32-true"``: nothing to do.
* ``"bf16-mixed"``: every forward pass of a stage, and the loss on the last stage, runs under
  ``torch.autocast(device.type, dtype=torch.bfloat16)`` (``runtime.precision``), evaluation and
  predictions included; parameters and optimizer state stay fp32, as on one device.
* ``"16-mixed"``: autocast to fp16 with one loss scale for the whole pipeline (``core.precision``):
  the last stage scales its backward seeds, every stage unscales its own gradients, and the
  stages agree on skipping a step. That agreement is a collective over every rank at each
  update, which only the flushed modes (``schedule.modes.FLUSHED_MODES``) can take in step; and
  torch's loss scaling runs on CUDA devices only here. Elsewhere it is refused, naming
  ``"bf16-mixed"``.

A ``runtime.precision.StagePrecision`` without a loss scale is taken as given (a front end's own
forward context).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch

from pl_pipedream.core.precision import share_found_inf
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.schedule.modes import SyncMode, check_fp16

__all__ = ["PRECISIONS", "EnginePrecision", "choose_precision"]

PRECISIONS = ("32-true", "bf16-mixed", "16-mixed")


@dataclass(frozen=True)
class EnginePrecision:
    """The runtime's ``StagePrecision`` and, under fp16, the stage's ``GradScaler``."""

    stage: StagePrecision
    scaler: torch.amp.GradScaler | None = None


def choose_precision(
    precision: str | StagePrecision, sync: SyncMode, device: torch.device
) -> EnginePrecision:
    """The precision ``precision`` names, checked against the sync mode and the device."""
    if isinstance(precision, StagePrecision):
        if precision.scale is not None:
            raise ValueError(
                "a StagePrecision with a loss scale needs the scaler that unscales every stage's "
                "gradients (precision: StagePrecision with scale); pass Pipeline(..., "
                "precision='16-mixed')"
            )
        return EnginePrecision(precision)
    if precision not in PRECISIONS:
        raise ValueError(
            f"precision must be one of {', '.join(PRECISIONS)} or a StagePrecision (precision: "
            f"{precision!r}); for example Pipeline(..., precision='bf16-mixed')"
        )
    if precision == "32-true":
        return EnginePrecision(StagePrecision())
    if precision == "bf16-mixed":
        return EnginePrecision(StagePrecision(autocast(device, torch.bfloat16)))
    return EnginePrecision(*fp16(sync, device))


def autocast(device: torch.device, dtype: torch.dtype) -> partial[torch.autocast]:
    """A fresh ``torch.autocast`` context for each forward pass."""
    return partial(torch.autocast, device.type, dtype=dtype)


def fp16(sync: SyncMode, device: torch.device) -> tuple[StagePrecision, torch.amp.GradScaler]:
    """fp16 autocast and the stage's scaler, whose ``unscale_`` agrees across every rank."""
    check_fp16(sync, "Pipeline(..., sync='{sync}')", "Pipeline(..., precision='bf16-mixed')")
    if device.type != "cuda":
        raise ValueError(
            "fp16 mixed precision scales the loss with torch's GradScaler, which the pipeline "
            f"runs on CUDA devices (precision: '16-mixed', device: {device}); use "
            "Pipeline(..., precision='bf16-mixed') here, or run on GPUs"
        )
    scaler = torch.amp.GradScaler(device.type)
    scaler.scale(torch.zeros((), device=device))  # the scale exists on every stage from the start
    share_found_inf(scaler, device)
    return StagePrecision(autocast(device, torch.float16), scaler.scale), scaler
