"""A stage's update without a training framework: the user's optimizer steps inside the pipeline.

Every ``STEP`` of the schedule hands the stage's ``Update`` the mean gradient of that update
(``runtime.executor``). Here the gradient goes on the stage's ``.grad`` and the optimizer built
from the stage's parameters steps at once, in every sync mode: in the flushed modes that is
the one step per batch a single-device loop takes after ``backward``; in the other modes it is
PipeDream's step per minibatch (``async``, ``vertical_sync``) or per batch (``2bw``). The step is
``runtime.update.step``, which leaves a stashed weight version's storage untouched.

Under fp16 mixed precision (``engine.precision``) the stage's ``GradScaler`` unscales the
gradient first; the stages agree whether any found an inf or NaN (``core.precision``), and then
every stage steps, or none does, and every scaler updates its scale alike. A stage without
parameters takes part in that agreement with no gradient.

With ``Pipeline(clip_grad_norm=...)`` the gradients are then clipped (``core.clipping``): by
their norm over every stage in the flushed modes, where every stage updates once per batch (a
stage without parameters joins that all-reduce with nothing), and by the stage's own norm in the
others, whose stages update at their own times.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.core.clipping import clip_global_norm, clip_stage_norm
from pl_pipedream.core.precision import found_inf
from pl_pipedream.core.stage import LocalStage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime import update
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["Clip", "OptimizerUpdate", "clipping"]

# scales a stage's gradients in place, given them all and those its norm counts
Clip = Callable[[list[Tensor], list[Tensor]], object]


class OptimizerUpdate:
    """The ``runtime.update.Update`` of a stage stepped by ``optimizer`` (None: a stage without
    parameters, whose updates only release weight versions); ``scaler``: the stage's
    ``GradScaler`` under fp16 mixed precision; ``clip``: scales the gradients before each step
    (``clipping``; ``counted_elsewhere``: the tied parameters another stage counts)."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        scaler: torch.amp.GradScaler | None = None,
        clip: Clip | None = None,
        counted_elsewhere: frozenset[str] = frozenset(),
    ) -> None:
        self.module = module  # the stage's layers
        self.optimizer = optimizer
        self.scaler = scaler
        self.clip = clip
        self.counted_elsewhere = counted_elsewhere  # tied: another stage counts them in a norm
        self.updates = 0  # updates applied since the pipeline was built
        self.stepping = False  # True while the optimizer steps inside the pipeline

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        params = dict(self.module.named_parameters())
        self.updates += 1
        if self.optimizer is None:
            self._agree_without_gradients()
            if self.clip is not None:
                self.clip([], [])  # a global norm counts every rank, this one with nothing
            return update.move_storage({params[n]: t for n, t in storage.items()})
        for name, param in params.items():
            param.grad = gradients.get(name)
        targets: dict[Tensor, Tensor] = {params[name]: t for name, t in storage.items()}
        stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        skip = False
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # agreed across the ranks
            skip = found_inf(self.scaler, self.optimizer)
            if skip:
                stepped = set()  # skipped on every stage: the values stay, the storage moves
        # a parameter the optimizer does not step keeps its values; it still leaves the storage
        copied = update.move_storage({p: t for p, t in targets.items() if id(p) not in stepped})
        if not skip and self.clip is not None:  # a skip is agreed: every rank clips, or none
            grads = [p.grad for p in params.values() if p.grad is not None]
            own = [p.grad for n, p in params.items() if n not in self.counted_elsewhere]
            self.clip(grads, [grad for grad in own if grad is not None])
        if not skip:
            self.stepping = True
            try:
                copied += update.step(self.optimizer, targets)
            finally:
                self.stepping = False
        if self.scaler is not None:
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        return copied

    def _agree_without_gradients(self) -> None:
        """Under a loss scale, a stage without parameters still joins the agreement and
        updates its scale (the last stage scales its losses by it)."""
        if self.scaler is None:
            return
        nothing = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.0)  # no gradient
        self.scaler.unscale_(nothing)  # the flag of no gradients: agreed with every rank's
        self.scaler.update()


def clipping(
    max_norm: float | None, sync: SyncMode, local: LocalStage, plan: Plan, device: torch.device
) -> Clip | None:
    """The clip of ``Pipeline(clip_grad_norm=...)``: by the norm over every stage where each
    stage updates once per batch (the flushed modes: equal to one device's
    ``clip_grad_norm_`` over the model), by the stage's own norm where stages update at their
    own times; None without a limit."""
    if max_norm is None:
        return None
    if not max_norm > 0:
        raise ValueError(
            f"clip_grad_norm must be a positive number (clip_grad_norm: {max_norm!r}); for "
            "example Pipeline(..., clip_grad_norm=1.0), or leave it out"
        )
    limit = float(max_norm)
    if not sync.flushes:
        return lambda grads, counted: clip_stage_norm(grads, limit)
    replicas = plan.stages[local.stage.index].replicas
    return lambda grads, counted: clip_global_norm(grads, counted, limit, replicas, device)
