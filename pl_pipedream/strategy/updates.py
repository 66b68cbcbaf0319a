"""Who applies a stage's updates, chosen once at setup from the sync mode.

Lightning's automatic optimisation runs ``training_step``, then ``zero_grad``, ``backward`` and
the optimizer step. Every ``STEP`` of the schedule hands the stage's ``Update`` the mean gradient
of that update (``runtime.executor``); what the update does with it depends on the mode:

* ``PipelineUpdates`` (modes that update inside the pipeline: ``async``, ``vertical_sync``,
  ``2bw``): the stage's optimizers step right there, when the schedule says, several times per
  Lightning step in the per-minibatch modes. Each update runs the hooks Lightning runs around an
  optimizer step, with the update's gradients on the stage's ``.grad``: ``on_after_backward``,
  then per optimizer ``on_before_optimizer_step`` and ``configure_gradient_clipping`` (so
  clipping is per stage). They run through the precision plugin's public methods, as in
  Lightning's own step: ``post_backward`` (``on_after_backward``), then ``optimizer_step``, which
  runs the hooks before a step and then calls ``optimizer.step``; for that one call the stage's
  own step (``runtime.update.step``, which keeps a stashed version intact) stands in for the
  optimizer's. Lightning's own backward and step do nothing; its step counter, ``max_steps``
  and LR schedulers still advance per batch.
* ``TrainerUpdates`` (the flushed modes, ``schedule.modes.FLUSHED_MODES``): the one update of
  the batch holds its gradient until Lightning's ``backward`` hands it to the parameters;
  Lightning then clips (by the norm over every stage, as on one device), accumulates and steps
  as usual.

Either way an update first moves the live weights out of any storage a kept weight version
shares (``runtime.update``), so a stashed version never changes.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.core.clipping import clip_global_norm
from pl_pipedream.runtime import update
from pl_pipedream.runtime.functional import ParameterSlots
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "PipelineUpdates",
    "LightningUpdates",
    "TrainerUpdates",
    "check_trainer",
    "clear_grads",
    "lightning_updates",
]


class LightningUpdates:
    """The ``Update`` of a stage (``runtime.update.Update``) and its part in Lightning's
    ``backward``. ``optimizers`` gives the strategy's optimizers, set up after the pipeline."""

    steps_in_pipeline: bool

    def __init__(
        self,
        mode: SyncMode,
        module: nn.Module,
        optimizers: Callable[[], list[Optimizer]],
        trainer: Any,
    ) -> None:
        self.mode = mode
        self.module = module  # the stage's layers
        self.slots = ParameterSlots(module)  # its named_parameters(), found once
        self.optimizers = optimizers
        self.trainer = trainer

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        raise NotImplementedError

    def backward(self, loss: Tensor) -> Tensor:
        """Lightning's backward of a training step: the pipeline already ran it."""
        return loss


class PipelineUpdates(LightningUpdates):
    """The stage's optimizers step inside the pipeline, after the hooks Lightning runs before
    a step (clipping included, per stage)."""

    steps_in_pipeline = True
    _no_loss = torch.zeros(())  # what post_backward takes for a loss: an update has none

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        params = self.slots.by_name()
        for name, param in params.items():
            param.grad = gradients.get(name)
        precision, module = self.trainer.precision_plugin, self.trainer.lightning_module
        precision.post_backward(self._no_loss, module)  # on_after_backward
        targets: dict[Tensor, Tensor] = {params[name]: t for name, t in storage.items()}
        optimizers = self.optimizers()
        stepped = {id(p) for opt in optimizers for g in opt.param_groups for p in g["params"]}
        # a parameter no optimizer steps keeps its values; it still leaves the shared storage
        copied = update.move_storage({p: t for p, t in targets.items() if id(p) not in stepped})
        for optimizer in optimizers:
            copied += step_after_hooks(precision, module, optimizer, targets)
            clear_grads(optimizer)
        return copied


class TrainerUpdates(LightningUpdates):
    """The batch's gradient waits for Lightning's ``backward``; Lightning steps in place."""

    steps_in_pipeline = False

    def __init__(
        self,
        mode: SyncMode,
        module: nn.Module,
        optimizers: Callable[[], list[Optimizer]],
        trainer: Any,
        replicas: int,
        device: torch.device,
        counted_elsewhere: frozenset[str] = frozenset(),
    ) -> None:
        super().__init__(mode, module, optimizers, trainer)
        self.replicas = replicas
        self.device = device
        # tied parameters whose gradient another stage counts in the global norm
        self.counted_elsewhere = counted_elsewhere
        self._held: dict[str, Tensor] = {}

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        self._held = gradients
        params = self.slots.by_name()
        # Lightning steps later, in place: a stashed version keeps a copy
        return update.move_storage({params[n]: t for n, t in storage.items()})

    def backward(self, loss: Tensor) -> Tensor:
        """Add the held batch gradient to the parameters' ``.grad`` (Lightning accumulates)."""
        scale = 1.0 / self.trainer.accumulate_grad_batches
        for name, param in self.slots.named():
            grad = self._held.get(name)
            if grad is None:
                continue
            if scale != 1.0:  # a copy of the stage's gradients costs as much as a small backward
                grad = grad * scale
            param.grad = grad if param.grad is None else param.grad + grad
        self._held = {}
        return loss

    def clip_global_norm(self, optimizer: Optimizer, clip_val: float | int) -> None:
        """Scale gradients so their norm over every stage is at most ``clip_val``
        (``core.clipping``: a tied parameter counted by its first stage only)."""
        grads = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        skip = {id(p) for n, p in self.module.named_parameters() if n in self.counted_elsewhere}
        counted = [
            p.grad
            for group in optimizer.param_groups
            for p in group["params"]
            if p.grad is not None and id(p) not in skip
        ]
        clip_global_norm(grads, counted, float(clip_val), self.replicas, self.device)


def step_after_hooks(
    precision: Any, module: Any, optimizer: Optimizer, targets: dict[Tensor, Tensor]
) -> int:
    """``precision.optimizer_step(optimizer, module, closure)`` as Lightning's automatic
    optimisation calls it (``on_before_optimizer_step`` on callbacks and module, then
    ``configure_gradient_clipping`` with the Trainer's settings, then ``optimizer.step``), with
    ``update.step(optimizer, targets)`` standing in for ``optimizer.step``; returns the bytes
    that step copied. The closure has no backward to run: the gradients are on ``.grad``."""
    own = vars(optimizer).get("step")  # an LR scheduler's wrapper, if any, is put back first
    copied: list[int] = []

    def restore() -> None:
        if own is None:
            vars(optimizer).pop("step", None)
        else:
            optimizer.step = own  # type: ignore[method-assign]

    def stand_in(closure: Callable[[], Any] | None = None, **kwargs: Any) -> None:
        if closure is not None:
            closure()  # Lightning's wrapper: the hooks before a step
        restore()
        copied.append(update.step(optimizer, targets))

    optimizer.step = stand_in  # type: ignore[method-assign, assignment]
    try:
        precision.optimizer_step(optimizer, model=module, closure=_no_backward)
    finally:
        restore()
    if not copied:
        raise ValueError(
            f"the modes that update inside the pipeline need a precision plugin whose "
            f"optimizer_step calls optimizer.step (precision: {type(precision).__name__}); use "
            "Trainer(precision='32-true'), 'bf16-mixed' or another precision the strategy runs"
        )
    return copied[0]


def clear_grads(optimizer: Optimizer) -> None:
    """``optimizer.zero_grad(set_to_none=True)``, without its profiler record (about 15 us of
    an update's fixed cost) where the optimizer's class keeps torch's ``zero_grad``."""
    if type(optimizer).zero_grad is not Optimizer.zero_grad:
        optimizer.zero_grad(set_to_none=True)
        return
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = None


def _no_backward() -> None:
    return None


def check_trainer(mode: SyncMode, trainer: Any) -> None:
    """Raise for Trainer settings the mode's updates cannot honour."""
    if mode.updates_in_pipeline and trainer.accumulate_grad_batches != 1:
        raise ValueError(
            f"gradient accumulation needs a flushed pipeline (sync: {mode}, "
            f"accumulate_grad_batches: {trainer.accumulate_grad_batches}); use "
            f"PipeDreamStrategy(sync='{SyncMode.FLUSH}') or raise microbatches instead"
        )


def lightning_updates(
    mode: SyncMode,
    module: nn.Module,
    optimizers: Callable[[], list[Optimizer]],
    trainer: Any,
    replicas: int,
    device: torch.device,
    counted_elsewhere: frozenset[str] = frozenset(),
) -> LightningUpdates:
    """The updates of a stage under ``mode``; ``counted_elsewhere``: the tied parameters whose
    gradient another stage counts in the global clipping norm."""
    if mode.updates_in_pipeline:
        return PipelineUpdates(mode, module, optimizers, trainer)
    return TrainerUpdates(mode, module, optimizers, trainer, replicas, device, counted_elsewhere)
