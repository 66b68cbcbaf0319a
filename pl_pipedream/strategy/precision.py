"""Lightning's precision flags on a pipeline: each stage computes as one device computes the model.

What each precision plugin means here (docs/precision.md):

* ``32-true`` (``Precision``): nothing to do.
* ``bf16-mixed``, ``16-mixed`` (``MixedPrecision``): every forward pass of a stage, and the
  user's ``training_step`` on the last stage, runs in the plugin's ``train_step_context``
  (``torch.autocast``), recomputed and evaluation forwards included (``runtime.precision``).
  Parameters and optimizer state stay in fp32 (the master weights), as on one device.
* ``16-mixed``'s loss scale is one for the whole pipeline. Every rank's plugin owns a
  ``GradScaler`` with the same settings; the last stage multiplies the seed of each backward
  pass by its scale, so every gradient crossing a cut carries it; every stage unscales its own
  gradients by its own scaler, whose ``unscale_`` then agrees with every other rank's
  (``share_found_inf``: an all-reduce, MAX, of the inf/NaN flag). So an inf or NaN anywhere
  skips the step on every stage, every scaler backs off or grows alike, and the scales stay
  equal, evolving as one device's. The agreement happens in Lightning's optimizer step, which
  only the flushed modes take; the modes that update inside the pipeline refuse ``16-mixed``.
* ``bf16-true``, ``16-true``, ``64-true`` (``HalfPrecision``, ``DoublePrecision``): the plugin
  converts the module once this rank's stage holds its real tensors (``convert_stage``; the
  other stages' layers are on ``meta``, where only their dtype changes); Lightning's loop
  converts each batch (``convert_input``) and the forwards run under the plugin's default
  dtype. Activations and their gradients cross the cuts in the dtype they have, as they would
  flow inside one device's graph.

Any other plugin (``transformer-engine``, ``bitsandbytes``, a subclass with its own rules) is
refused at setup, naming the precisions the strategy runs.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning.pytorch.plugins.precision import (
    DoublePrecision,
    HalfPrecision,
    MixedPrecision,
    Precision,
)
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core.precision import share_found_inf
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.schedule.modes import SyncMode, check_fp16

__all__ = [
    "SUPPORTED",
    "check_optimizers",
    "check_precision",
    "convert_stage",
    "share_found_inf",
    "stage_precision",
]

SUPPORTED = ("32-true", "64-true", "bf16-true", "16-true", "bf16-mixed", "16-mixed")
_PLUGINS = (Precision, MixedPrecision, HalfPrecision, DoublePrecision)


def describe(plugin: Precision) -> str:
    """The flag a plugin stands for ("bf16-mixed"), or its class for a plugin without one."""
    flag = getattr(plugin, "precision", None)
    return f"'{flag}'" if isinstance(flag, str) else type(plugin).__name__


def check_precision(plugin: Precision, sync: SyncMode) -> None:
    """Raise for a precision plugin the pipeline cannot run as one device would."""
    if type(plugin) not in _PLUGINS:
        raise ValueError(
            f"PipeDreamStrategy runs the precisions {', '.join(SUPPORTED)} (precision: "
            f"{describe(plugin)}, plugin: {type(plugin).__name__}); use one of them, e.g. "
            "Trainer(precision='bf16-mixed')"
        )
    scaler = loss_scaler(plugin)
    if scaler is not None:
        check_fp16(sync, "PipeDreamStrategy(sync='{sync}')", "Trainer(precision='bf16-mixed')")
    if scaler is not None and not isinstance(scaler, torch.amp.GradScaler):
        raise ValueError(
            f"fp16 mixed precision needs a torch.amp.GradScaler (scaler: "
            f"{type(scaler).__name__}); pass MixedPrecision('16-mixed', device) without one"
        )


def check_optimizers(plugin: Precision, optimizers: Sequence[Optimizer]) -> None:
    """Raise for an optimizer that unscales inside its own step (a fused one) under a loss
    scale: the stages could not agree on skipping that step."""
    if loss_scaler(plugin) is None:
        return
    for optimizer in optimizers:
        if getattr(optimizer, "_step_supports_amp_scaling", False):
            raise ValueError(
                "fp16 mixed precision skips a step on every stage when any stage finds an inf "
                "or NaN, which needs the gradients unscaled before the step (optimizer: "
                f"{type(optimizer).__name__} unscales inside its fused step); create it "
                "without fused=True, or use Trainer(precision='bf16-mixed')"
            )


def loss_scaler(plugin: Precision) -> Any:
    """The plugin's ``GradScaler`` (``16-mixed``), or None."""
    return plugin.scaler if isinstance(plugin, MixedPrecision) else None


def convert_stage(plugin: Precision, module: nn.Module) -> None:
    """Convert the LightningModule as the plugin converts one device's (``convert_module``),
    once this rank's stage is materialized; parameters keep their identity."""
    converted = plugin.convert_module(module)
    if converted is not module:
        raise ValueError(
            f"PipeDreamStrategy needs a precision plugin that converts the module in place "
            f"(precision: {describe(plugin)}); use one of {', '.join(SUPPORTED)}"
        )


def stage_precision(plugin: Precision, device: torch.device) -> StagePrecision:
    """What the runtime needs of the plugin: the training step's forward context and, under a
    loss scale, the scaler's ``scale`` for the last stage's backward seeds. The scaler's scale
    is created now on every stage, since a stage that never scales a loss still unscales."""
    if type(plugin) is Precision:  # 32-true: no context to enter per forward
        return StagePrecision()
    scaler = loss_scaler(plugin)
    if scaler is None:
        return StagePrecision(plugin.train_step_context)
    scaler.scale(torch.zeros((), device=device))
    share_found_inf(scaler, device)
    return StagePrecision(plugin.train_step_context, scaler.scale)
