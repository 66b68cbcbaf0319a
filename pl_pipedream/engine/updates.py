"""A stage's update without a training framework: the user's optimizer steps inside the pipeline.

Every ``STEP`` of the schedule hands the stage's ``Update`` the mean gradient of that update
(``runtime.executor``). Here the gradient goes on the stage's ``.grad`` and the optimizer built
from the stage's parameters steps at once, in every sync mode: in ``flush`` and ``gpipe`` that is
the one step per batch a single-device loop takes after ``backward``; in the other modes it is
PipeDream's step per minibatch (``async``, ``vertical_sync``) or per batch (``2bw``). The step is
``runtime.update.step``, which leaves a stashed weight version's storage untouched.

Under fp16 mixed precision (``engine.precision``) the stage's ``GradScaler`` unscales the
gradient first; the stages agree whether any found an inf or NaN (``core.precision``), and then
every stage steps, or none does, and every scaler updates its scale alike. A stage without
parameters takes part in that agreement with no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.core.precision import found_inf
from pl_pipedream.runtime import update

__all__ = ["OptimizerUpdate"]


class OptimizerUpdate:
    """The ``runtime.update.Update`` of a stage stepped by ``optimizer`` (None: a stage without
    parameters, whose updates only release weight versions); ``scaler``: the stage's
    ``GradScaler`` under fp16 mixed precision."""

    def __init__(
        self,
        module: nn.Module,
        optimizer: Optimizer | None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        self.module = module  # the stage's layers
        self.optimizer = optimizer
        self.scaler = scaler
        self.updates = 0  # updates applied since the pipeline was built
        self.stepping = False  # True while the optimizer steps inside the pipeline

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        params = dict(self.module.named_parameters())
        self.updates += 1
        if self.optimizer is None:
            self._agree_without_gradients()
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
