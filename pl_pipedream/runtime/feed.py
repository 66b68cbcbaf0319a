"""What a stage's passes take and leave: a run's ``Feed`` from outside (the first stage's
inputs, the last stage's loss), and what a forward pass leaves for its backward pass
(``InFlight``). The executor (``runtime.executor``) holds one ``InFlight`` per minibatch between
its forward and its backward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pl_pipedream.runtime.linear_sums import HeldProducts
from pl_pipedream.runtime.recompute import Replay

__all__ = ["Feed", "InFlight"]


@dataclass(frozen=True)
class Feed:
    """What a run's forward passes take from outside, by global minibatch index: the first
    stage's ``inputs(i)`` and the last stage's ``loss(output, i)``. ``fingerprint(i, received)``,
    if given, returns this rank's fingerprint of microbatch ``i``'s data (sent on with the
    activations) after checking it against ``received``, stage 0's (None on stage 0).
    ``logged(i)``, if given, returns what else ``loss(output, i)`` logged, (key, value) pairs
    that travel with the loss (``runtime.losses``)."""

    inputs: Callable[[int], Any]
    loss: Callable[[Any, int], torch.Tensor]
    fingerprint: Callable[[int, float | None], float] | None = None
    logged: Callable[[int], tuple[tuple[str, Any], ...]] | None = None


@dataclass
class InFlight:
    """What a forward pass leaves for its backward pass."""

    version: int
    params: dict[str, torch.Tensor]
    inputs: list[torch.Tensor]  # the received tensors (their gradients travel back)
    outputs: list[torch.Tensor]  # the tensors of the output, in ``flatten``'s order
    structure: bytes | None = None  # what the outputs sit in (``runtime.boundary``)
    loss: torch.Tensor | None = None
    fingerprint: float | None = None  # of the data stage 0 fed in; travels with the activations
    predicted: bool = False  # ``params`` are a prediction of its own, not a stashed version
    replay: Replay | None = None  # recompute: the input to run the forward again from
    held: HeldProducts | None = None  # a split backward's Linear products (``linear_sums``)
