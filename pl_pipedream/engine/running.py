"""The parts of a ``Pipeline`` that its plan decides, built at construction and again after a
re-plan (``Pipeline.replan``): the check of its ties, the stage's update, the runner and the
evaluation pipe; and what a re-plan needs of the optimizer (the names of each group's
parameters over the whole module, ``core.relayout``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.core import named_state
from pl_pipedream.core.evaluation import ForwardPipe
from pl_pipedream.core.materialize import EmptyBuild, materialize
from pl_pipedream.core.pretrained import Pretrained, load_stage
from pl_pipedream.core.stage import LocalStage
from pl_pipedream.engine.checkpoints import every_stages_groups
from pl_pipedream.engine.updates import OptimizerUpdate, clipping
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.runtime.ties import check_ties
from pl_pipedream.schedule.modes import SyncMode, check_chunked

__all__ = [
    "Running",
    "Settings",
    "check_plan_ties",
    "create_stage",
    "group_names_of",
    "to_move",
]

Factory = Callable[[list[nn.Parameter]], Optimizer]


@dataclass(frozen=True)
class Settings:
    """What a ``Pipeline`` keeps from its arguments to build its runner on any plan."""

    sync: SyncMode
    microbatches: int
    rank: int
    device: torch.device
    timeout: float
    precision: StagePrecision
    scaler: torch.amp.GradScaler | None
    clip_grad_norm: float | None
    weight_prediction: bool
    recompute: bool
    record_timeline: bool = False  # what a re-plan check reads (engine.replanning)


@dataclass
class Running:
    """The stage's update, its runner (every rank builds it at the same point: it makes process
    groups) and the evaluation pipe over the runner's channel."""

    updates: OptimizerUpdate
    runner: PipelineRunner
    forward: ForwardPipe

    @classmethod
    def start(
        cls, local: LocalStage, plan: Plan, optimizer: Optimizer | None, settings: Settings
    ) -> Running:
        s = settings
        check_plan_ties(local.ties, plan, s.sync)
        norm = clipping(s.clip_grad_norm, s.sync, local, plan, s.device)
        elsewhere = local.ties_counted_elsewhere()
        updates = OptimizerUpdate(local.module, optimizer, s.scaler, norm, elsewhere)
        runner = PipelineRunner.create(
            plan,
            s.sync,
            s.microbatches,
            local.module,
            s.rank,
            updates,
            s.device,
            s.timeout,
            ties=local.ties,
            weight_prediction=s.weight_prediction,
            recompute=s.recompute,
            precision=s.precision,
            record_timeline=s.record_timeline,
        )
        forward = ForwardPipe(plan, local, runner.executor.channel, s.rank)
        return cls(updates, runner, forward)


def check_plan_ties(ties: Sequence[Tie], plan: Plan, sync: SyncMode) -> None:
    """Raise for ``plan``'s ties (``core.stage.find_ties``) whose rule ``sync`` does not build
    under ``plan``."""
    replicas = [s.replicas for s in plan.stages]
    described = [t.describe() for t in ties]
    check_ties(sync, described, replicas, "Pipeline")
    check_chunked(sync, described, False, "Pipeline(..., sync='{sync}')")


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


def create_stage(
    layers: nn.Sequential,
    local: LocalStage,
    device: torch.device,
    pretrained: str | os.PathLike | Pretrained | None,
    build: EmptyBuild | None,
) -> None:
    """The stage's tensors from ``pretrained`` (each rank reads its own), else created from
    the empty build's record when the layers were built on ``meta`` (``core.materialize``)."""
    weights = Pretrained.parse(pretrained)
    initial = (layers, layers, local.layer_indices, device)
    if weights is not None:
        load_stage(weights, *initial, build or EmptyBuild())
    else:
        materialize(*initial, build or EmptyBuild())
