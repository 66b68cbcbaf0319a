"""A backward pass in two halves: the input gradient at once, the weight gradient later.

In a mode that splits the backward (``SyncMode.splits_backward``, zero bubble) the schedule runs
``BACKWARD_INPUT`` where the other modes run ``BACKWARD``, and ``BACKWARD_WEIGHT`` later. The
forward's Linear layers hold their weight products back (``runtime.linear_sums.HeldProducts``):
their backward computes the input's gradient only and keeps the output gradient and the input.
The input half is one ``torch.autograd.grad`` of the stage's roots (the loss, or the outputs
seeded with the gradients received) with respect to the received tensors, the weights of the
forward pass (its stashed version) and the held products' anchor: it sends the input gradient
upstream at once, adds the gradients of the weights that no held Linear covers (LayerNorm,
embeddings, convolutions, a Linear that cannot be fused) to the update's sums, and frees the
graph. The weight half adds the held products, ``g^T x`` per Linear layer, into the update's
Linear sums with the GEMMs a whole backward uses, and then releases the activations and the
version as a whole backward releases them. The two halves cost what one backward costs, and the
result is exactly a whole backward's. A stage whose weights are all too small for fusing to pay
(``UpdateSettings.fused_linear_min_elements``) holds nothing: its input half computes every
weight's gradient, as a whole backward does, and its weight half only releases. Where the
roots and seeds come from (``_seeds``: the loss, or the gradients received; under recompute the
forward run again) is the same for a whole backward, which the executor runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from pl_pipedream.runtime.boundary import flatten
from pl_pipedream.runtime.linear_sums import HeldProducts
from pl_pipedream.runtime.lookahead import ExecutorError, batch_of, minibatch_of
from pl_pipedream.schedule.actions import Action

__all__ = ["Owed", "SplitBackward"]


@dataclass
class Owed:
    """What an input half leaves for its weight half."""

    version: int
    held: HeldProducts | None


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
            with self.precision.forward(), self.updates.capture(params, flight.held):
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
        names = [n for n, p in flight.params.items() if p.requires_grad]
        leaves = [flight.params[n] for n in names]
        held = flight.held
        anchor = [] if held is None or held.anchor is None else [held.anchor]
        if roots and (received or leaves or anchor):
            found = torch.autograd.grad(
                roots, [*received, *leaves, *anchor], grads, allow_unused=True
            )
            for tensor, grad in zip(received, found[: len(received)], strict=True):
                tensor.grad = grad
            self.updates.add(names, found[len(received) : len(received) + len(leaves)])
        self._owed[i] = Owed(flight.version, held)
        flight.outputs, flight.loss, flight.held = [], None, None  # the graph is freed

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
        self.updates.add_held(owed.held)
        flight = self._flight.get(i)  # the first stage keeps it until here
        if flight is not None:
            flight.params = {}
        self._weights_done(i)

    def _owed_versions(self) -> frozenset[int]:
        """The versions the weight halves to come will use."""
        return frozenset(owed.version for owed in self._owed.values())
