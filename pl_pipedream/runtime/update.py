"""An optimizer step that leaves a weight stash's storage untouched.

A kept weight version shares the live parameters' storage until the next update would change it
(``WeightStash.storage_for_update``). ``step`` applies the update with the new values of those
parameters in the tensors it is given, which become the parameters' storage. ``torch.optim.SGD``
(momentum, dampening, Nesterov, weight decay, maximize) has an out-of-place form with the same
arithmetic, one pass over the weights, as its in-place step: the new values are written there
directly and weight stashing copies nothing. The result equals torch's single-tensor step bit
for bit (the default on CPU); torch's foreach kernels (its default on GPUs) may round
differently in the last bit. Every other optimizer, or an SGD with step hooks, a patched
``step``, a fused or differentiable step, a tensor learning rate or weight decay, or sparse
gradients, first gets the live values copied into the new tensors and steps in place on them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

import torch
from torch import Tensor
from torch.optim import optimizer as optim_base
from torch.optim.optimizer import Optimizer

__all__ = ["has_out_of_place_step", "move_storage", "step"]


class Update(Protocol):
    """Applies one update of a stage: ``gradients`` by parameter name (the mean over the
    update's minibatches) and ``storage``: for each parameter that a kept weight version
    shares, the tensor that must receive its new values and become its storage
    (``step`` does both). Returns the bytes it copied to do so."""

    def __call__(
        self, gradients: dict[str, torch.Tensor], storage: dict[str, torch.Tensor]
    ) -> int: ...


def step(optimizer: Optimizer, new_storage: Mapping[Tensor, Tensor]) -> int:
    """``optimizer.step()`` with the new values of the parameters in ``new_storage`` written into
    ``new_storage[param]`` (which then holds the parameter's data); returns the bytes copied."""
    given = {id(param): target for param, target in new_storage.items()}
    mine = {
        id(p): given[id(p)]
        for group in optimizer.param_groups
        for p in group["params"]
        if id(p) in given
    }
    if mine and has_out_of_place_step(optimizer):
        _sgd_step(optimizer, mine)
        return 0
    copied = move_storage({p: t for p, t in new_storage.items() if id(p) in mine})
    optimizer.step()
    return copied


@torch.no_grad()
def move_storage(new_storage: Mapping[Tensor, Tensor]) -> int:
    """Copy each parameter's values into ``new_storage[param]`` and make that its storage, so an
    in-place step leaves the old storage as it was; returns the bytes copied."""
    copied = 0
    for param, target in new_storage.items():
        target.copy_(param)
        param.data = target
        copied += target.numel() * target.element_size()
    return copied


def has_out_of_place_step(optimizer: Optimizer) -> bool:
    """True for a plain ``torch.optim.SGD`` whose ``step`` this module can run out of place."""
    if type(optimizer) is not torch.optim.SGD:
        return False
    patched = vars(optimizer).get("step")
    if patched is not None and not getattr(patched, "_wrapped_by_lr_sched", False):
        return False
    hooks = ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks")
    if any(getattr(optimizer, name, None) for name in hooks):
        return False
    global_hooks = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")
    if any(getattr(optim_base, name, None) for name in global_hooks):
        return False
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("differentiable"):
            return False
        if isinstance(group["lr"], Tensor) or isinstance(group["weight_decay"], Tensor):
            return False
        if any(p.grad is not None and p.grad.is_sparse for p in group["params"]):
            return False
    return True


@torch.no_grad()
def _sgd_step(optimizer: Optimizer, new_storage: dict[int, Tensor]) -> None:
    """``torch.optim.SGD.step`` with ``param - lr * direction`` written into ``new_storage``."""
    optimizer._opt_called = True  # type: ignore[attr-defined]  # what an LR scheduler checks
    for group in optimizer.param_groups:
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        for param in group["params"]:
            if param.grad is None:
                continue
            grad = -param.grad if group["maximize"] else param.grad
            if decay != 0:
                grad = grad.add(param, alpha=decay)
            if momentum != 0:
                grad = _momentum(optimizer.state[param], grad, momentum, group)
            target = new_storage.get(id(param))
            if target is None:
                param.add_(grad, alpha=-lr)
            else:
                torch.add(param, grad, alpha=-lr, out=target)
                param.data = target


def _momentum(state: dict, grad: Tensor, momentum: float, group: dict) -> Tensor:
    buffer = state.get("momentum_buffer")
    if buffer is None:
        buffer = state["momentum_buffer"] = grad.detach().clone()
    else:
        buffer.mul_(momentum).add_(grad, alpha=1 - group["dampening"])
    return grad.add(buffer, alpha=momentum) if group["nesterov"] else buffer
