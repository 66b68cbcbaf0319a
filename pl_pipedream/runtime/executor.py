"""The stage executor: runs one rank's action list, exactly as the schedule module built it.

There is no schedule in here. Each action kind has one handler: receive or send a message,
run a forward or backward pass on a weight version, average gradients among the stage's
replicas, apply an update. What comes from outside is injected: the first stage's inputs
(``inputs(i)``), the last stage's loss (``loss(output, i)``), and what an update does
(``apply_update(gradients, version, fresh)``: the stage's optimizer steps through
``runtime.update.step``, which writes the parameters named in ``fresh`` into those tensors, since
a kept weight version shares their storage; it returns the bytes it had to copy for that).

Gradients of an update are summed over its backward passes (and, through ``ALLREDUCE``, over
the stage's replicas), then divided by ``update_size``, so an update sees the mean gradient, as
single-device training on the same minibatches would. Where every update averages the same
number of microbatches (the batch-mean modes), the last stage can instead scale the seed of its
backward pass by ``loss_scale``: every stage then sums gradients that are already divided, and
no stage spends a pass over its gradients on the division. Where an update sums several backward
passes (``sum_linear_gradients``), Linear layers add their weight gradients into the sum inside
the GEMM that computes them (``runtime.linear_sums``), saving a pass over the gradients per
backward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call

from pl_pipedream.runtime.channel import Channel, Message, Stream
from pl_pipedream.runtime.linear_sums import LinearGradientSums
from pl_pipedream.runtime.versions import WeightVersions
from pl_pipedream.schedule.actions import Action, ActionKind

__all__ = ["ApplyUpdate", "ExecutorError", "StageExecutor", "TimelineEvent"]

TAG_ACTIVATION = 1
TAG_GRAD = 2


class ApplyUpdate(Protocol):
    """Applies one update of a stage: ``gradients`` by parameter name (the mean over the
    update's minibatches), the ``version`` it creates, and ``fresh``: tensors that must receive
    the new values of those parameters and become their storage (``runtime.update.step``).
    Returns the bytes it copied to do so."""

    def __call__(
        self, gradients: dict[str, torch.Tensor], version: int, fresh: dict[str, torch.Tensor]
    ) -> int | None: ...


class ExecutorError(RuntimeError):
    """A stage could not run an action; the message names the rank, stage and action."""


@dataclass(frozen=True)
class TimelineEvent:
    """One executed action with its wall-clock start and end (seconds, ``time.perf_counter``)."""

    rank: int
    action: str
    kind: str
    start: float
    end: float


@dataclass
class _InFlight:
    """What a forward pass leaves for its backward pass."""

    version: int
    params: dict[str, torch.Tensor]
    inputs: list[torch.Tensor]
    outputs: list[torch.Tensor]
    loss: torch.Tensor | None = None
    scalars: list[float] = field(default_factory=list)


def as_tensors(value: Any) -> list[torch.Tensor]:
    """A stage's output or input as a list of tensors (a tensor, or a tuple/list of them)."""
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)) and all(isinstance(v, torch.Tensor) for v in value):
        return list(value)
    raise ExecutorError(
        f"a pipeline stage must take and return a tensor or a tuple of tensors (got: "
        f"{type(value).__name__}); make each layer of configure_pipeline() return tensors"
    )


class StageExecutor:
    """Runs the actions of one rank for one stage module."""

    def __init__(
        self,
        module: nn.Module,
        rank: int,
        stage: int,
        num_stages: int,
        channel: Channel,
        replica_group: Any = None,
        num_replicas: int = 1,
        inputs: Callable[[int], Any] | None = None,
        loss: Callable[[Any, int], torch.Tensor] | None = None,
        apply_update: ApplyUpdate | None = None,
        update_size: int = 1,
        loss_scale: float = 1.0,
        sum_linear_gradients: bool = False,
        device: torch.device | None = None,
        record_timeline: bool = False,
    ) -> None:
        self.module = module
        self.rank = rank
        self.stage = stage
        self.num_stages = num_stages
        self.channel = channel
        self.replica_group = replica_group
        self.num_replicas = num_replicas
        self.inputs = inputs
        self.loss = loss
        self.apply_update = apply_update
        self.update_size = update_size
        self.loss_scale = loss_scale
        self.linear_sums = LinearGradientSums() if sum_linear_gradients else None
        self.device = device or torch.device("cpu")
        self.describe = f"rank {rank} (stage {stage})"
        self.versions = WeightVersions(module, self.describe)
        self.record_timeline = record_timeline
        self.timeline: list[TimelineEvent] = []
        self.newest_loss: float | None = None  # of the highest minibatch this rank has seen
        self._newest_minibatch = -1
        self._received: dict[int, Message] = {}
        self._gradients: dict[int, Message] = {}
        self._flight: dict[int, _InFlight] = {}
        self._accumulated: dict[str, torch.Tensor] = {}
        self._owned: set[str] = set()  # names whose sum is a tensor this executor allocated
        self.actions: tuple[Action, ...] = ()
        self.position = 0
        self._last_use: dict[int, int] = {}
        self.peak_in_flight = 0
        self.copied_bytes = 0  # weights the updates copied to keep a stashed version intact

    # ----- running ----------------------------------------------------------------------------

    def execute(
        self, actions: Sequence[Action], lookahead: Sequence[Action] = (), flush: bool = True
    ) -> None:
        """Run ``actions`` in order. ``lookahead`` (the actions that will follow, as far as
        they are known) decides which weight versions must outlive these actions, and the
        first receive of each stream in either is posted at once. With ``flush``, return only
        once every message sent has left; without it the sends complete while later actions
        run, so this rank does not wait for its peer to post its receive."""
        self.actions = tuple(actions)
        ahead = (*self.actions, *lookahead)
        self._last_use = {}
        for index, action in enumerate(ahead):
            if action.kind in _COMPUTE and action.version is not None:
                self._last_use[action.version] = index
        first, following = _receives_ahead(ahead)
        for stream in first:
            self.channel.expect(*stream)
        for position, action in enumerate(self.actions):
            self.position = position
            start = time.perf_counter()
            try:
                self._handlers[action.kind](self, action)
            except ExecutorError:
                raise
            except RuntimeError as error:
                if "could not" in str(error):
                    raise
                raise ExecutorError(
                    f"{self.describe} failed at action {action}: {error}"
                ) from error
            if self.record_timeline:
                end = time.perf_counter()
                self.timeline.append(
                    TimelineEvent(self.rank, str(action), action.kind.value, start, end)
                )
            if position in following:
                self.channel.expect(*following[position])
        self.position = len(self.actions)
        if flush:
            self.channel.flush()

    def _record_loss(self, minibatch: int, value: float) -> None:
        if minibatch >= self._newest_minibatch:
            self._newest_minibatch = minibatch
            self.newest_loss = value

    def restart(self) -> None:
        """After a drain: nothing is in flight; the live weights become version 0 again."""
        pending = self.linear_sums is not None and self.linear_sums.pending
        if self._flight or self._received or self._gradients or self._accumulated or pending:
            raise ExecutorError(
                f"{self.describe} cannot restart its pipeline with work in flight (minibatches: "
                f"{sorted(self._flight)}, gradients not yet applied: "
                f"{bool(self._accumulated) or pending}); drain it first"
            )
        self.versions.reset(0)
        self._newest_minibatch = -1

    # ----- messages ---------------------------------------------------------------------------

    def _recv_activation(self, action: Action) -> None:
        message = self.channel.recv(
            action.peer, TAG_ACTIVATION, f"the activations of minibatch {action.minibatch}"
        )
        for tensor in message.tensors:
            if tensor.is_floating_point():
                tensor.requires_grad_(True)
        self._received[action.minibatch] = message

    def _send_activation(self, action: Action) -> None:
        flight = self._flight[action.minibatch]
        self.channel.send(
            Message([t.detach() for t in flight.outputs]),
            action.peer,
            TAG_ACTIVATION,
            f"the activations of minibatch {action.minibatch}",
        )

    def _recv_grad(self, action: Action) -> None:
        self._gradients[action.minibatch] = self.channel.recv(
            action.peer, TAG_GRAD, f"the gradients of minibatch {action.minibatch}"
        )

    def _send_grad(self, action: Action) -> None:
        flight = self._flight.pop(action.minibatch)
        grads = []
        for tensor in flight.inputs:
            if tensor.is_floating_point():
                grads.append(tensor.grad if tensor.grad is not None else torch.zeros_like(tensor))
            else:
                grads.append(torch.zeros(0))
        self.channel.send(
            Message(grads, flight.scalars),
            action.peer,
            TAG_GRAD,
            f"the gradients of minibatch {action.minibatch}",
        )

    # ----- compute ----------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        i = action.minibatch
        if self.stage == 0:
            if self.inputs is None:
                raise ExecutorError(f"{self.describe} has no input for minibatch {i}")
            inputs = [t.to(self.device) for t in as_tensors(self.inputs(i))]
        else:
            inputs = self._received.pop(i).tensors
        params = self.versions.get(action.version)  # shares the live storage while current
        state = {**params, **dict(self.module.named_buffers())}
        with self._capture(params):
            outputs = as_tensors(functional_call(self.module, state, tuple(inputs)))
        flight = _InFlight(action.version, params, inputs, outputs)
        if self.stage == self.num_stages - 1:
            if self.loss is None:
                raise ExecutorError(f"{self.describe} has no loss for minibatch {i}")
            value = outputs[0] if len(outputs) == 1 else tuple(outputs)
            flight.loss = self.loss(value, i)
            loss_value = float(flight.loss.detach())
            flight.scalars = [float(i), loss_value]
            self._record_loss(i, loss_value)
        self._flight[i] = flight
        self.peak_in_flight = max(self.peak_in_flight, len(self._flight))

    def _capture(self, params: dict[str, torch.Tensor]) -> AbstractContextManager:
        """Where several backward passes make one update, Linear layers sum their weight
        gradients inside the GEMM (``linear_sums``) instead of returning them to be added."""
        return nullcontext() if self.linear_sums is None else self.linear_sums.capture(params)

    def _backward(self, action: Action) -> None:
        i = action.minibatch
        flight = self._flight[i]
        if flight.version != action.version:
            raise ExecutorError(
                f"{self.describe}: backward of minibatch {i} must use the forward's weights "
                f"(forward version: {flight.version}, backward version: {action.version})"
            )
        params = flight.params
        if flight.loss is not None:
            seed = None if self.loss_scale == 1.0 else torch.full_like(flight.loss, self.loss_scale)
            roots, grads = [flight.loss], [seed]
        else:
            message = self._gradients.pop(i)
            flight.scalars = message.scalars
            if len(message.scalars) >= 2:
                self._record_loss(int(message.scalars[0]), message.scalars[1])
            pairs = [
                (out, grad)
                for out, grad in zip(flight.outputs, message.tensors, strict=True)
                if out.requires_grad
            ]
            roots = [p[0] for p in pairs]
            grads = [p[1].to(p[0].device) for p in pairs]
        leaves = [p for p in params.values() if p.requires_grad]
        wanted = leaves + [t for t in flight.inputs if t.requires_grad]
        if roots and wanted:
            found = torch.autograd.grad(roots, wanted, grads, allow_unused=True)
        else:
            found = []
        shared = _repeated_ids(found)
        for name, grad in zip(
            [n for n, p in params.items() if p.requires_grad], found[: len(leaves)], strict=True
        ):
            if grad is not None:
                self._accumulate(name, grad, copy=id(grad) in shared)
        for tensor, grad in zip(
            [t for t in flight.inputs if t.requires_grad], found[len(leaves) :], strict=True
        ):
            tensor.grad = grad
        flight.outputs = []
        flight.params = {}
        flight.loss = None
        if self.stage == 0:
            self._flight.pop(i)
        self._release()

    def _accumulate(self, name: str, grad: torch.Tensor, copy: bool) -> None:
        """Add ``grad`` to the update's sum. Autograd returns a fresh tensor, so the first one is
        kept without a copy (a copy of a large gradient costs as much as a small backward); it
        is changed in place only once the sum is a tensor this executor made. ``copy`` is for a
        tensor autograd also returned elsewhere (the same gradient for two leaves)."""
        held = self._accumulated.get(name)
        if held is None:
            self._accumulated[name] = grad.clone() if copy else grad
            if copy:
                self._owned.add(name)
        elif name in self._owned:
            held += grad
        else:
            self._accumulated[name] = held + grad
            self._owned.add(name)

    # ----- updates ----------------------------------------------------------------------------

    def _take_linear_sums(self) -> None:
        """Move the sums the Linear layers kept into the update's gradients."""
        if self.linear_sums is None:
            return
        for name, total in self.linear_sums.take().items():
            held = self._accumulated.get(name)
            if held is not None:  # the same weight also reached autograd elsewhere
                total += held
            self._accumulated[name] = total
            self._owned.add(name)

    def _allreduce(self, action: Action) -> None:
        self._take_linear_sums()
        if self.num_replicas <= 1:
            return
        names = [n for n, p in self.module.named_parameters() if p.requires_grad]
        flat = (
            torch.cat(
                [
                    self._accumulated.get(n, torch.zeros_like(p)).reshape(-1)
                    for n, p in self.module.named_parameters()
                    if p.requires_grad
                ]
            )
            if names
            else torch.zeros(0)
        )
        if flat.numel():
            dist.all_reduce(flat, group=self.replica_group)
            offset = 0
            for n, p in self.module.named_parameters():
                if not p.requires_grad:
                    continue
                size = p.numel()
                self._accumulated[n] = flat[offset : offset + size].view_as(p)
                self._owned.add(n)
                offset += size

    def _step(self, action: Action) -> None:
        self._take_linear_sums()
        live = self.versions.live_version
        if self._last_use.get(live, -1) > self.position:
            self.versions.get(live)
        count = self.update_size
        gradients: dict[str, torch.Tensor] = {}
        for name, grad in self._accumulated.items():
            if count != 1:
                grad = grad.div_(count) if name in self._owned else grad / count
            gradients[name] = grad
        self._accumulated, self._owned = {}, set()
        if self.apply_update is None:
            raise ExecutorError(f"{self.describe} has no way to apply update {action.version}")
        self._release()
        fresh = self.versions.fresh(gradients)
        self.copied_bytes += self.apply_update(gradients, action.version, fresh) or 0
        self._check_fresh(fresh)
        self.versions.mark_stepped()
        if self.versions.live_version != action.version:
            raise ExecutorError(
                f"{self.describe}: update {action.version} made the live weights version "
                f"{self.versions.live_version}; the schedule and the updates disagree"
            )
        self._release()

    def _check_fresh(self, fresh: dict[str, torch.Tensor]) -> None:
        live = dict(self.module.named_parameters())
        for name, tensor in fresh.items():
            if live[name].data_ptr() != tensor.data_ptr():
                raise ExecutorError(
                    f"an update must leave the storage that a kept weight version shares as it was "
                    f"and give the parameter the fresh tensor ({self.describe}, parameter: "
                    f"{name}); apply updates with pl_pipedream.runtime.update.step"
                )

    def _release(self) -> None:
        """Drop the snapshots that no later action of the loaded list uses and no forward pass
        still holds for its backward (a dropped snapshot's tensors are reused)."""
        held = {flight.version for flight in self._flight.values() if flight.params}
        done = [
            v
            for v in self.versions.kept()
            if self._last_use.get(v, -1) <= self.position and v not in held
        ]
        self.versions.release(done)

    _handlers: dict[ActionKind, Callable[..., None]] = {
        ActionKind.RECV_ACTIVATION: _recv_activation,
        ActionKind.SEND_ACTIVATION: _send_activation,
        ActionKind.RECV_GRAD: _recv_grad,
        ActionKind.SEND_GRAD: _send_grad,
        ActionKind.FORWARD: _forward,
        ActionKind.BACKWARD: _backward,
        ActionKind.ALLREDUCE: _allreduce,
        ActionKind.STEP: _step,
    }


_COMPUTE = (ActionKind.FORWARD, ActionKind.BACKWARD)
_TAGS = {ActionKind.RECV_ACTIVATION: TAG_ACTIVATION, ActionKind.RECV_GRAD: TAG_GRAD}


def _receives_ahead(actions: Sequence[Action]) -> tuple[list[Stream], dict[int, Stream]]:
    """The streams (peer, tag) that ``actions`` receive from, and, for each receive that has a
    successor on its stream, that stream keyed by the receive's position: once a receive is
    done, the next one on its stream can be posted. A posted receive takes the stream's next
    message, whichever action awaits it, so posting early never changes what is received."""
    last: dict[Stream, int] = {}
    following: dict[int, Stream] = {}
    for position, action in enumerate(actions):
        if action.kind in _TAGS:
            stream = (action.peer, _TAGS[action.kind])
            if stream in last:
                following[last[stream]] = stream
            last[stream] = position
    return list(last), following


def _repeated_ids(tensors: Sequence[torch.Tensor | None]) -> set[int]:
    """Ids of the tensor objects that occur more than once in ``tensors``."""
    seen: set[int] = set()
    repeated: set[int] = set()
    for tensor in tensors:
        if tensor is not None:
            (repeated if id(tensor) in seen else seen).add(id(tensor))
    return repeated
