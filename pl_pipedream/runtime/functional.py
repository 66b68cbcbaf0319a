"""A stage's forward on given parameter tensors, at a fraction of ``functional_call``'s cost.

Every forward pass of the executor runs the stage on one weight version's tensors (a stashed
snapshot, a prediction) instead of the module's own parameters. ``torch.func.functional_call``
does that, but per call it rebuilds the map of tied names, checks the keys and swaps through
attribute lookups: about 0.1 ms per forward on this machine, measured, for any size of stage, a
fixed cost per microbatch (docs/performance.md). ``StageCall`` finds each parameter's
slot (the module that owns it and its name there) once, with the names tied to it, and per call
puts the given tensors in those slots, runs the module and puts the parameters back, even when
the forward raises. As with ``functional_call(module, params, args, strict=False)``, a
parameter not given keeps the module's own, and a tensor given for one of several names of a
tied parameter serves all of them. Buffers are not swapped: the module's own are used (and
updated, e.g. BatchNorm's running statistics), which is what the executor passed anyway. A stage
module that is an ``nn.Sequential`` runs layer by layer (``profile.handoff.run_layers``): a layer
that cannot take the previous one's output raises an error naming both, the rank and stage
(``where``), and the value.

``ParameterSlots`` is the same idea for reading: ``module.named_parameters()`` walks the module
tree through generators at every call (about 9 us for a two-layer stage, several times per
update); the slots, found once, read the same (name, parameter) pairs in the same order from
the modules that hold them, so a parameter object replaced in its slot is still the one read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from pl_pipedream.profile.handoff import run_layers

__all__ = ["ParameterSlots", "StageCall"]


class ParameterSlots:
    """``named()`` returns what ``module.named_parameters()`` would, read from the slots (the
    owning module and attribute of each parameter's first registration) found at construction."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        owners = {}
        for owner in module.modules():
            for attribute, param in owner._parameters.items():
                if param is not None and id(param) not in owners:
                    owners[id(param)] = (owner, attribute)
        self._slots = [(name, *owners[id(param)]) for name, param in module.named_parameters()]

    def named(self) -> list[tuple[str, nn.Parameter]]:
        """(name, parameter) of the module's parameters, in ``named_parameters()``'s order."""
        found = [(name, owner._parameters[attribute]) for name, owner, attribute in self._slots]
        return [(name, param) for name, param in found if param is not None]

    def by_name(self) -> dict[str, nn.Parameter]:
        return dict(self.named())


class StageCall:
    """``StageCall(module)(params, value)``: ``module(value)`` with ``params`` (by the names of
    ``module.named_parameters()``) in place of the module's own parameters. ``where`` (the rank
    and stage) and ``before_first`` (what feeds the first layer) word a layer's ``TypeError``."""

    def __init__(self, module: nn.Module, where: str = "", before_first: str | None = None) -> None:
        self.module = module
        self.where = where or "one stage"
        self.before_first = before_first
        canonical: dict[int, str] = {}
        for name, param in module.named_parameters():
            canonical[id(param)] = name
        # (owner, attribute, the name a caller gives for it), every registration of a tied one
        self._slots: list[tuple[nn.Module, str, str]] = []
        for prefix, owner in module.named_modules(remove_duplicate=False):
            for attribute, param in owner._parameters.items():
                if param is not None:
                    full = f"{prefix}.{attribute}" if prefix else attribute
                    self._slots.append((owner, attribute, canonical.get(id(param), full)))

    def __call__(self, params: Mapping[str, torch.Tensor], value: Any) -> Any:
        swapped: list[tuple[nn.Module, str, Any]] = []
        try:
            for owner, attribute, name in self._slots:
                tensor = params.get(name)
                if tensor is not None:
                    swapped.append((owner, attribute, owner._parameters[attribute]))
                    # A plain tensor in the slot for this call (put back below); torch types the
                    # slot as a Parameter.
                    owner._parameters[attribute] = tensor  # type: ignore[assignment]
            if isinstance(self.module, nn.Sequential):
                return run_layers(self.module, value, self.where, self.before_first)
            return self.module(value)
        finally:
            for owner, attribute, original in reversed(swapped):
                owner._parameters[attribute] = original
