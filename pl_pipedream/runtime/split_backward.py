"""A backward pass in two halves: the input gradient at once, the weight gradient later.

In a mode that splits the backward (``SyncMode.splits_backward``, zero bubble) the schedule runs
``BACKWARD_INPUT`` where the other modes run ``BACKWARD``: ``torch.autograd.grad`` of the stage's
roots (the loss, or the outputs seeded with the gradients received) with respect to the received
tensors only, keeping the graph, so the gradient can be sent upstream at once. ``BACKWARD_WEIGHT``
later takes the gradient of the same roots with the same seeds with respect to the weights of the
forward pass (its stashed version), from the kept graph, and adds it to the update's sums; then
the graph, the activations and the version are released as a whole backward releases them.
Where the roots and seeds come from (``_seeds``: the loss, or the gradients received; under
recompute the forward run again) is the same for a whole backward, which the executor runs.

The weight half walks the graph from the roots again, so it costs more than the weight share of a
backward where a stage holds several layers; the fused Linear sums (``runtime.linear_sums``)
would add a Linear layer's weight gradient already in the input half, so a split mode does not
use them (``schedule.modes.update_settings``). The result is exactly that of a whole backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from pl_pipedream.runtime.boundary import flatten
from pl_pipedream.runtime.lookahead import ExecutorError, batch_of, minibatch_of
from pl_pipedream.schedule.actions import Action

__all__ = ["Owed", "SplitBackward"]


@dataclass
class Owed:
    """What an input half leaves for its weight half."""

    version: int
    params: dict[str, torch.Tensor]
    roots: list[torch.Tensor]
    grads: list[torch.Tensor]


class SplitBackward:
    """The two halves as ``StageExecutor`` handlers; ``_owed`` holds the weight halves to come.

    ``_seeds`` starts a whole backward too. The executor provides the attributes below and
    ``_weights_done``.
    """

    _owed: dict[int, Owed]
    _flight: dict[int, Any]
    _gradients: dict[int, Any]
    describe: str
    updates: Any
    activations: Any
    precision: Any
    losses: Any
    module: Any
    loss_scale: float

    def _seeds(self, action: Action, flight: Any) -> tuple[list, list]:
        """The roots of ``flight``'s backward pass and the gradients they are seeded with (the
        loss scaled, or the gradients received); under recompute, the forward is run again."""
        i = minibatch_of(action)
        if flight.version != action.version:
            raise ExecutorError(
                f"{self.describe}: backward of minibatch {i} must use the forward's weights "
                f"(forward version: {flight.version}, backward version: {action.version})"
            )
        params = flight.params
        if flight.replay is not None:  # recompute: the forward again, on the same weights
            with self.precision.forward(), self.updates.capture(params):
                again = self.activations.replay(i, flight.replay, self.module, params)
            flight.outputs = flatten(again)[0]
        if flight.loss is not None:
            roots, grads = [flight.loss], [self.precision.seed(flight.loss, self.loss_scale)]
        else:
            message = self._gradients.pop(i)
            self.losses.add(batch_of(action), message.losses)
            pairs = [
                (out, grad)
                for out, grad in zip(flight.outputs, message.tensors, strict=True)
                if out.requires_grad and grad.shape == out.shape
            ]
            roots = [p[0] for p in pairs]
            grads = [p[1].to(p[0].device) for p in pairs]
        return roots, grads

    def _weights_done(self, i: int) -> None:
        raise NotImplementedError

    def _backward_input(self, action: Action) -> None:
        i = minibatch_of(action)
        flight = self._flight[i]
        roots, grads = self._seeds(action, flight)
        received = [t for t in flight.inputs if t.requires_grad]
        if roots and received:
            found = torch.autograd.grad(
                roots, received, grads, allow_unused=True, retain_graph=True
            )
            for tensor, grad in zip(received, found, strict=True):
                tensor.grad = grad
        self._owed[i] = Owed(flight.version, flight.params, roots, grads)
        flight.outputs, flight.loss = [], None  # the roots are in ``Owed`` now

    def _backward_weight(self, action: Action) -> None:
        i = minibatch_of(action)
        owed = self._owed.pop(i, None)
        if owed is None or owed.version != action.version:
            raise ExecutorError(
                f"{self.describe}: the weight half of minibatch {i} follows its input half on "
                f"the forward's weights (input half run: {owed is not None}, its version: "
                f"{None if owed is None else owed.version}, weight half version: "
                f"{action.version})"
            )
        names = [n for n, p in owed.params.items() if p.requires_grad]
        leaves = [owed.params[n] for n in names]
        found: tuple[Tensor | None, ...] = (None,) * len(leaves)
        if owed.roots and leaves:
            found = torch.autograd.grad(owed.roots, leaves, owed.grads, allow_unused=True)
        self.updates.add(names, found)
        flight = self._flight.get(i)  # the first stage keeps it until here
        if flight is not None:
            flight.params = {}
        self._weights_done(i)

    def _owed_versions(self) -> frozenset[int]:
        """The versions the weight halves to come will use."""
        return frozenset(owed.version for owed in self._owed.values())
