"""What one layer of a pipeline hands the next, and the error when the next cannot take it.

As in ``nn.Sequential``, each layer of the pipeline (``configure_pipeline()``) gets the previous
layer's output as its one argument: a tuple is passed on whole, not unpacked into several
arguments. A layer that cannot take what it is given usually fails inside torch with a
``TypeError`` that names neither layer ("linear(): argument 'input' (position 1) must be
Tensor, not tuple"). ``run_layers`` runs the layers in turn and turns such an error into a
``HandoffError`` that names the boundary: both layers (index in ``configure_pipeline()`` and
class), where they ran (the rank and stage, or setup), and the structure and shapes of the value
that crossed; torch's error stays chained to it. Every place that runs the layers (the setup's
forward check, the profiler, a stage's forward in the runtime) words it with
``handoff_message``. A stage's first layer names the layer before it by index only: that layer
runs on the stage before, whose modules this rank does not hold.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["HandoffError", "describe_value", "handoff_message", "run_layers"]

_SHOWN = 6  # items of a container shown before "..."


class HandoffError(TypeError):
    """A layer of the pipeline could not take what the layer before it returned."""


def run_layers(
    layers: nn.Sequential, value: Any, where: str, before_first: str | None = None
) -> Any:
    """``layers(value)``, one layer at a time; a ``TypeError`` a layer raises becomes a
    ``HandoffError`` naming that layer, the one before it and ``value``'s structure, ``where``
    they run (e.g. ``"rank 1 (stage 1)"``). ``before_first`` says what fed the first layer
    (default: the pipeline's input)."""
    previous: tuple[int, nn.Module] | None = None
    for position, (name, layer) in enumerate(layers.named_children()):
        index = int(name) if name.isdigit() else position
        try:
            output = layer(value)
        except TypeError as error:
            before = _layer(*previous) if previous is not None else before_first
            raise HandoffError(
                handoff_message(index, layer, before, where, value, error)
            ) from error
        previous, value = (index, layer), output
    return value


def handoff_message(
    index: int,
    layer: nn.Module,
    before: str | None,
    where: str,
    value: Any,
    error: BaseException,
) -> str:
    """The error text for ``layer`` (``index`` in ``configure_pipeline()``) failing on ``value``,
    the output of ``before`` (a description, e.g. ``"layer 2: Pair"``; None: the pipeline's
    input), while running ``where``."""
    source = before or "the pipeline's input"
    cause = str(error).strip().splitlines()
    return (
        "each layer of the pipeline takes the previous layer's output as its one "
        f"argument, as in nn.Sequential (layer {index}: {type(layer).__name__}, after {source}, "
        f"on {where}; passed: {describe_value(value)}; {type(error).__name__}: "
        f"{cause[0] if cause else ''}); make the layer before return what layer {index} takes, "
        f"or make layer {index}'s forward take that value (a tuple arrives whole, as one "
        "argument: unpack it inside forward)"
    )


def describe_value(value: Any) -> str:
    """The structure of ``value`` with each tensor's shape and dtype, e.g.
    ``"tuple(Tensor(4, 8) float32, Tensor(4, 8) float32)"``."""
    if isinstance(value, torch.Tensor):
        return f"Tensor{tuple(value.shape)} {str(value.dtype).removeprefix('torch.')}"
    if isinstance(value, dict):
        items = [f"{key!r}: {describe_value(item)}" for key, item in list(value.items())[:_SHOWN]]
        return f"{type(value).__name__}({_listed(items, len(value))})"
    if isinstance(value, (tuple, list)):
        items = [describe_value(item) for item in value[:_SHOWN]]
        return f"{type(value).__name__}({_listed(items, len(value))})"
    if value is None or isinstance(value, (bool, int, float)):
        return repr(value)
    return f"a {type(value).__name__}"


def _listed(items: list[str], count: int) -> str:
    more = f", ... {count - len(items)} more" if count > len(items) else ""
    return ", ".join(items) + more


def _layer(index: int, layer: nn.Module) -> str:
    return f"layer {index}: {type(layer).__name__}"
