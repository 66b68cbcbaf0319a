"""A stage's update without a training framework: the user's optimizer steps inside the pipeline.

Every ``STEP`` of the schedule hands the stage's ``Update`` the mean gradient of that update
(``runtime.executor``). Here the gradient goes on the stage's ``.grad`` and the optimizer built
from the stage's parameters steps at once, in every sync mode: in ``flush`` and ``gpipe`` that is
the one step per batch a single-device loop takes after ``backward``; in the other modes it is
PipeDream's step per minibatch (``async``, ``vertical_sync``) or per batch (``2bw``). The step is
``runtime.update.step``, which leaves a stashed weight version's storage untouched.
"""

from __future__ import annotations

from torch import Tensor, nn
from torch.optim import Optimizer

from pl_pipedream.runtime import update

__all__ = ["OptimizerUpdate"]


class OptimizerUpdate:
    """The ``runtime.update.Update`` of a stage stepped by ``optimizer`` (None: a stage without
    parameters, whose updates only release weight versions)."""

    def __init__(self, module: nn.Module, optimizer: Optimizer | None) -> None:
        self.module = module  # the stage's layers
        self.optimizer = optimizer
        self.updates = 0  # updates applied since the pipeline was built

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        params = dict(self.module.named_parameters())
        self.updates += 1
        if self.optimizer is None:
            return update.move_storage({params[n]: t for n, t in storage.items()})
        for name, param in params.items():
            param.grad = gradients.get(name)
        targets: dict[Tensor, Tensor] = {params[name]: t for name, t in storage.items()}
        stepped = {id(p) for g in self.optimizer.param_groups for p in g["params"]}
        # a parameter the optimizer does not step keeps its values; it still leaves the storage
        copied = update.move_storage({p: t for p, t in targets.items() if id(p) not in stepped})
        copied += update.step(self.optimizer, targets)
        self.optimizer.zero_grad(set_to_none=True)
        return copied
