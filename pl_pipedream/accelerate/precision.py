"""The Accelerator's ``mixed_precision`` as the engine's ``precision=`` (``engine.precision``).

``"no"`` is ``"32-true"``, ``"bf16"`` is ``"bf16-mixed"`` (autocast to bfloat16 around every
stage's forward passes, as Accelerate wraps one device's ``forward``) and ``"fp16"`` is
``"16-mixed"`` (autocast to float16 and one loss scale for the pipeline, on CUDA devices, in the
flushed modes). The settings of the Accelerator's ``GradScaler`` (``GradScalerKwargs``) carry
over to the pipeline's scaler (``carry_scaler``). ``"fp8"`` and custom ``AutocastKwargs`` are
refused: the pipeline's forwards would not compute as Accelerate's do.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["MIXED_PRECISION", "carry_scaler", "engine_precision"]

MIXED_PRECISION = {"no": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}


def engine_precision(accelerator: Any) -> str:
    """The engine's precision flag for ``accelerator.mixed_precision``; raise where the
    pipeline cannot compute as Accelerate would on one device."""
    mixed = str(accelerator.mixed_precision)
    if mixed not in MIXED_PRECISION:
        raise ValueError(
            f"prepare_pipeline runs the mixed precisions {', '.join(MIXED_PRECISION)} (mixed "
            f"precision: {mixed!r}); use Accelerator(mixed_precision='bf16')"
        )
    if accelerator.autocast_handler is not None:
        raise ValueError(
            "prepare_pipeline enters its own autocast around each stage's forward passes, "
            f"without Accelerate's AutocastKwargs (autocast handler: "
            f"{accelerator.autocast_handler!r}); create the Accelerator without "
            "kwargs_handlers=[AutocastKwargs(...)]"
        )
    if mixed == "fp16" and accelerator.device.type != "cuda":
        raise ValueError(
            "fp16 mixed precision scales the loss with torch's GradScaler, which the pipeline "
            f"runs on CUDA devices (mixed precision: 'fp16', device: {accelerator.device}); use "
            "Accelerator(mixed_precision='bf16') here, or launch on GPUs"
        )
    return MIXED_PRECISION[mixed]


def carry_scaler(accelerator: Any, scaler: torch.amp.GradScaler | None) -> None:
    """Start the pipeline's scaler from the Accelerator's (its initial scale, growth and
    backoff factors and growth interval), which the pipeline uses in its place."""
    if scaler is not None and accelerator.scaler is not None:
        scaler.load_state_dict(accelerator.scaler.state_dict())
