"""Cut a LightningModule's pipeline down to the stage one rank runs.

The module lists its layers with ``configure_pipeline() -> nn.Sequential``; those layers are
submodules of the module, so every parameter keeps the name the module's ``state_dict`` gives
it. A rank keeps its stage's layers on its device and moves every other layer to the ``meta``
device, which frees their memory while keeping the module's structure (and the names) intact.

A parameter that layers on several stages use (a tied weight: ``head.weight = wte.weight``) is
one parameter: every stage whose layers use it keeps its copy on its device, and the stage
records it as a ``planner.ties.Tie`` (the same value on every rank) so that the holders sum its
gradient and apply the same updates (docs/guide.md, "The sync modes"). A tensor reachable under
several names (a tied weight, or a module that is an attribute twice) is saved under every name
``module.state_dict()`` gives it.

In a plan of several stages per rank (chunks: ``planner.chunks``), the rank keeps the layers of
every stage it holds; ``LocalStage.module`` holds them all (``runtime.chunks.chunk_of`` cuts
out each stage's, the same layer objects under the same names).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import nn

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.plan import Plan, PlanError, Stage
from pl_pipedream.planner.ties import Tie

__all__ = ["LocalStage", "cut_stage", "find_ties", "pipeline_layers"]


@dataclass
class LocalStage:
    """The layers this rank runs and the module-level names of their state. ``stage`` is the
    rank's first stage; ``stages`` every stage it holds (several in a chunked plan)."""

    stage: Stage
    module: nn.Sequential  # children named by layer index: "0", "3", ... (of every stage held)
    names: dict[str, str]  # stage-module state name -> LightningModule state name
    shared: list[str]  # LightningModule state outside the pipeline (every rank has it)
    aliases: dict[str, tuple[str, ...]] = field(default_factory=dict)  # name -> every name
    ties: list[Tie] = field(default_factory=list)  # every tie of the pipeline, in one order
    stages: tuple[Stage, ...] = ()  # every stage held, in pipeline order (default: ``stage``)

    def __post_init__(self) -> None:
        if not self.stages:
            self.stages = (self.stage,)

    @property
    def layer_indices(self) -> list[int]:
        """The indices in ``configure_pipeline()`` of the layers this rank holds, every stage's."""
        return sorted(int(node) for stage in self.stages for node in stage.nodes)

    def ties_counted_elsewhere(self) -> frozenset[str]:
        """The tied parameters this stage holds that an earlier stage counts (in a global norm,
        each tied gradient counts once: on its first stage)."""
        index = self.stage.index
        held = [t.name_in(index) for t in self.ties if t.stages[0] != index]
        return frozenset(name for name in held if name is not None)

    def state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """This stage's state under ``module``'s names (each tensor under every name it has),
        on the CPU; stage 0 adds the state outside the pipeline."""
        state = {}
        for name, tensor in self.module.state_dict(keep_vars=True).items():
            full = self.names[name]
            for alias in self.aliases.get(full, (full,)):
                state[alias] = tensor.detach().cpu()
        if self.stage.index == 0:
            whole = module.state_dict()
            for name in self.shared:
                for alias in self.aliases.get(name, (name,)):
                    if alias in whole:
                        state[alias] = whole[alias]
        return state


def pipeline_layers(module: nn.Module) -> nn.Sequential:
    """Call ``configure_pipeline`` and check that it lists submodules of ``module``."""
    configure = getattr(module, "configure_pipeline", None)
    if configure is None:
        raise PipelineSetupError(
            f"a LightningModule trained with PipeDreamStrategy must list its layers in order "
            f"(module: {type(module).__name__} has no configure_pipeline); add "
            "`def configure_pipeline(self): return nn.Sequential(self.layer1, self.layer2, ...)`"
        )
    layers = configure()
    if not isinstance(layers, nn.Sequential) or len(layers) == 0:
        raise PipelineSetupError(
            f"configure_pipeline() must return a non-empty nn.Sequential (returned: "
            f"{type(layers).__name__}{'' if not isinstance(layers, nn.Sequential) else ' of 0'})"
        )
    own = {id(m) for m in module.modules()}
    for index, layer in enumerate(layers):
        if id(layer) not in own:
            raise PipelineSetupError(
                f"every layer of configure_pipeline() must be a submodule of the LightningModule "
                f"so its parameters keep their names (layer {index}: {type(layer).__name__}); "
                "assign it to an attribute in __init__ first"
            )
    return layers


def cut_stage(module: nn.Module, layers: nn.Sequential, plan: Plan, rank: int) -> LocalStage:
    """Keep the layers of ``rank``'s stage, move every other pipeline layer to ``meta``."""
    count = len(layers)
    expected = [str(i) for i in range(count)]
    placed = sorted((node for s in plan.stages for node in s.nodes), key=_layer_order)
    if placed != expected:
        raise PipelineSetupError(
            f"the plan must place each of the {count} layers of configure_pipeline() on exactly "
            f"one stage (placed: {placed[:12]}{'...' if len(placed) > 12 else ''}); plan with "
            f"layer ids '0'..'{count - 1}' or pass balance= with {count} layers in total"
        )
    try:
        held = plan.stages_of_rank(rank)
    except PlanError as error:
        raise PipelineSetupError(str(error)) from error
    full_names = _full_names(module)
    stage_module = _stage_module(layers, *held)
    names = {}
    for local_name, tensor in _state(stage_module):
        names[local_name] = full_names[id(tensor)][0]
    in_pipeline = {id(t) for layer in layers for _, t in _state(layer)}
    shared = [full_names[id(t)][0] for _, t in _state(module) if id(t) not in in_pipeline]
    aliases = {all_names[0]: all_names for all_names in full_names.values() if len(all_names) > 1}
    ties = find_ties(module, layers, plan)
    keep = {id(t) for _, t in _state(stage_module)}  # a tied tensor stays on every holder
    moved: dict[int, nn.Parameter] = {}
    local = LocalStage(held[0], stage_module, names, shared, aliases, ties, held)
    kept = set(local.layer_indices)
    for index, layer in enumerate(layers):
        if index not in kept:
            _to_meta(layer, keep, moved)
    return local


def find_ties(module: nn.Module, layers: nn.Sequential, plan: Plan) -> list[Tie]:
    """The parameters that layers on more than one stage of ``plan`` use, in the order of
    ``module.named_parameters()``: the same list on every rank, each tie with its name in every
    holding stage's module (as ``cut_stage`` builds it)."""
    in_stage = [  # each stage's parameter names, by parameter id
        {id(p): name for name, p in _stage_module(layers, s).named_parameters()}
        for s in plan.stages
    ]
    full_names = _full_names(module)
    ties = []
    for _, param in module.named_parameters():
        stages = tuple(s.index for s in plan.stages if id(param) in in_stage[s.index])
        if len(stages) < 2:
            continue
        ties.append(
            Tie(
                names=full_names[id(param)],
                stages=stages,
                stage_names=tuple(in_stage[s][id(param)] for s in stages),
                stage_ranks=tuple(plan.stages[s].ranks for s in stages),
                nbytes=param.numel() * param.element_size(),
            )
        )
    return ties


def _stage_module(layers: nn.Sequential, *stages: Stage) -> nn.Sequential:
    """The layers of ``stages``, named by their index in the pipeline: "0", "3", ..."""
    nodes = [node for stage in stages for node in stage.nodes]
    return nn.Sequential(OrderedDict((str(i), layers[i]) for i in sorted(map(int, nodes))))


def _to_meta(layer: nn.Module, keep: set[int], moved: dict[int, nn.Parameter]) -> None:
    """Move ``layer``'s parameters and buffers to ``meta``, except the tensors in ``keep``;
    ``moved`` maps each parameter already moved to its ``meta`` twin, so a parameter that
    several layers share stays one parameter."""
    for sub in layer.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or id(param) in keep:
                continue
            if id(param) not in moved:
                moved[id(param)] = nn.Parameter(param.detach().to("meta"), param.requires_grad)
            sub._parameters[name] = moved[id(param)]
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and id(buffer) not in keep:
                sub._buffers[name] = buffer.to("meta")


def _layer_order(node: str) -> tuple[int, str]:
    return (int(node), node) if node.isdigit() else (-1, node)


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def _full_names(module: nn.Module) -> dict[int, tuple[str, ...]]:
    """Every state name of each tensor of ``module``, by tensor id: ``state_dict`` lists a tied
    parameter, and the state of a module that is an attribute twice, under each name."""
    names: dict[int, list[str]] = {}
    for name, tensor in module.state_dict(keep_vars=True).items():
        names.setdefault(id(tensor), []).append(name)
    for name, tensor in _state(module):  # non-persistent buffers: not in state_dict
        names.setdefault(id(tensor), [name])
    return {key: tuple(value) for key, value in names.items()}
