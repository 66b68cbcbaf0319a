"""What a ``Pipeline``'s re-plan needs of its optimizer (``Pipeline.replan``): the names of each
group's parameters over the whole module (``core.relayout`` moves the state by name), and an
optimizer on every rank, a shell where a stage without parameters built none."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core import named_state
from pl_pipedream.engine.checkpoints import every_stages_groups
from pl_pipedream.planner.plan import Plan

__all__ = ["group_names_of", "shell", "to_move"]

Factory = Callable[[list[nn.Parameter]], Optimizer]


def group_names_of(layers: nn.Module, optimizer: Optimizer) -> list[list[str]]:
    """Per group of ``optimizer`` (over the whole of ``layers``), its parameters' names."""
    names = {id(param): name for name, param in layers.named_parameters()}
    return named_state.group_names(optimizer.param_groups, names)


def to_move(
    optimizer: Optimizer | None,
    factory: Factory | None,
    recorded: list[list[list[str]]] | None,
    layers: nn.Module,
    plan: Plan,
    device: torch.device,
) -> tuple[Optimizer, list[list[list[str]]]]:
    """Every rank: the optimizer a re-plan moves (``shell`` where a stage without parameters
    built none with ``factory``), and the whole module's names of its groups: ``recorded`` at
    construction (an optimizer over every layer), else each stage's, gathered."""
    if recorded is None:
        own = group_names_of(layers, optimizer) if optimizer is not None else None
        recorded = [every_stages_groups(own, plan)]
    if optimizer is None:
        assert factory is not None, "an optimizer given built is kept on every rank"
        optimizer = shell(factory, device)
    return optimizer, recorded


def shell(factory: Factory, device: torch.device) -> Optimizer:
    """An optimizer of ``factory``'s kind and settings holding no parameter yet, for a rank
    whose stage had none and may get some in a re-plan (``core.relayout`` fills its groups)."""
    optimizer = factory([nn.Parameter(torch.zeros(1, device=device))])
    optimizer.state.clear()
    for group in optimizer.param_groups:
        group["params"] = []
    return optimizer
