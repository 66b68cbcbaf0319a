"""Cut a LightningModule's pipeline down to the stage one rank runs.

The module lists its layers with ``configure_pipeline() -> nn.Sequential``; those layers are
submodules of the module, so every parameter keeps the name the module's ``state_dict`` gives
it. A rank keeps its stage's layers on its device and moves every other layer to the ``meta``
device, which frees their memory while keeping the module's structure (and the names) intact.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
from torch import nn

from pl_pipedream.planner.plan import Plan, PlanError, Stage

__all__ = ["LocalStage", "PipelineSetupError", "cut_stage", "pipeline_layers"]


class PipelineSetupError(ValueError):
    """The module, the plan and the launch do not fit together."""


@dataclass
class LocalStage:
    """The layers this rank runs and the module-level names of their state."""

    stage: Stage
    module: nn.Sequential  # children named by layer index: "0", "3", ...
    names: dict[str, str]  # stage-module state name -> LightningModule state name
    shared: list[str]  # LightningModule state outside the pipeline (every rank has it)

    def state_dict(self, module: nn.Module) -> dict[str, torch.Tensor]:
        """This stage's state under ``module``'s names, on the CPU; stage 0 adds the state
        outside the pipeline."""
        state = {
            self.names[name]: tensor.detach().cpu()
            for name, tensor in self.module.state_dict(keep_vars=True).items()
        }
        if self.stage.index == 0:
            full = module.state_dict()
            state.update({name: full[name] for name in self.shared if name in full})
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
        stage = plan.stage_of_rank(rank)
    except PlanError as error:
        raise PipelineSetupError(str(error)) from error
    full_names = _full_names(module)
    local = [int(node) for node in stage.nodes]
    stage_module = nn.Sequential(OrderedDict((str(i), layers[i]) for i in sorted(local)))
    names = {}
    for local_name, tensor in _state(stage_module):
        names[local_name] = full_names[id(tensor)]
    in_pipeline = {id(t) for layer in layers for _, t in _state(layer)}
    shared = [full_names[id(t)] for _, t in _state(module) if id(t) not in in_pipeline]
    for index, layer in enumerate(layers):
        if index not in local:
            layer.to("meta")
    return LocalStage(stage, stage_module, names, shared)


def _layer_order(node: str) -> tuple[int, str]:
    return (int(node), node) if node.isdigit() else (-1, node)


def _state(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return list(module.named_parameters()) + list(module.named_buffers())


def _full_names(module: nn.Module) -> dict[int, str]:
    return {id(t): name for name, t in _state(module)}
