"""The stage executor: runs one rank's action list, exactly as the schedule module built it.

There is no schedule in here. Each action kind has one handler: receive or send a message, run
a forward or backward pass on a weight version; ``ALLREDUCE`` and ``STEP``, the update side, are
``runtime.stage_updates``'. What a run needs from outside comes with it (``execute``): the first
stage's inputs and the last stage's loss (a ``Feed``), and the ``Update`` that applies a ``STEP``;
what each forward pass leaves for its backward pass is an ``InFlight`` (``runtime.feed``).

Where every update averages the same number of microbatches (the batch-mean modes), the last
stage scales the seed of its backward pass by ``loss_scale`` (``schedule.modes.update_settings``):
every stage then sums gradients that are already divided, and no stage spends a pass over its
gradients on the division.

With ``weight_prediction`` (``async``, ``vertical_sync``), a forward pass whose weight version v
is d > 0 updates stale runs on the prediction W_v + d (W_v - W_(v-1)) (``runtime.staleness``),
which its backward pass reuses; the forward of version v therefore keeps version v - 1 stashed
until it has run.

Every forward pass, and the last stage's loss, runs in the stage's precision context, and the last
stage's backward seeds carry its loss scale (``runtime.precision``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from pl_pipedream.runtime.boundary import CrossingError, explain, flatten, unflatten
from pl_pipedream.runtime.channel import Channel, PeerError
from pl_pipedream.runtime.feed import Feed, InFlight
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.functional import StageCall
from pl_pipedream.runtime.lookahead import (
    ExecutorError,
    batch_of,
    last_uses,
    minibatch_of,
    peer_of,
    run_posting_ahead,
    version_of,
)
from pl_pipedream.runtime.losses import LossBook
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.runtime.ranks import describe
from pl_pipedream.runtime.recompute import Activations, Replay, detached, rng_state
from pl_pipedream.runtime.split_backward import Owed, SplitBackward
from pl_pipedream.runtime.stage_updates import Needed, StageUpdates
from pl_pipedream.runtime.staleness import delay_of, predict
from pl_pipedream.runtime.stash import WeightStash
from pl_pipedream.runtime.streams import Ahead, SideStreams, prefetch_each, read_later, settle
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.runtime.tied_versions import TiedVersions
from pl_pipedream.runtime.ties import TiedGradients
from pl_pipedream.runtime.timeline import Recording, TimelineEvent
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import UpdateSettings
from pl_pipedream.trees import map_tensors

__all__ = ["ExecutorError", "StageExecutor"]


class StageExecutor(SplitBackward):
    """Runs the actions of one rank for one stage module (a split backward's two halves:
    ``runtime.split_backward``)."""

    def __init__(
        self,
        module: nn.Module,
        rank: int,
        stage: int,
        num_stages: int,
        channel: Channel,
        settings: UpdateSettings,
        replica_group: Any = None,
        num_replicas: int = 1,
        device: torch.device | None = None,
        record_timeline: bool = False,
        ties: TiedGradients | None = None,
        microbatches: int | None = None,
        tied_versions: TiedVersions | None = None,
        weight_prediction: bool = False,
        recompute: bool = False,
        precision: StagePrecision | None = None,
        losses: LossBook | None = None,
    ) -> None:
        self.module = module
        self.precision = precision or StagePrecision()  # runtime.precision: autocast, loss scale
        self.weight_prediction = weight_prediction  # runtime.staleness.predict, per forward
        self.tied_versions = tied_versions  # per-minibatch modes: tied versions of their own
        self.rank = rank
        self.stage = stage
        self.num_stages = num_stages
        self.channel = channel
        self.num_replicas = num_replicas
        self.loss_scale = settings.loss_scale
        self.device = device or torch.device("cpu")
        self.describe = describe(rank, stage)
        tied = tied_versions.names if tied_versions else set()
        self.stash = WeightStash(module, self.describe, tied)
        # the module's forward on a version's tensors
        self._call = StageCall(module, self.describe, _before_first(module, stage))
        self.record_timeline = record_timeline
        self.recording = Recording(rank)  # while record_timeline is on
        self.losses = losses or LossBook()  # the training losses this rank knows (shared by its
        # stages in a chunked plan: runtime.losses, runtime.chunks)
        self._feed: Feed | None = None
        self._update: Update | None = None
        self._received: dict[int, Message] = {}
        self._gradients: dict[int, Message] = {}
        self._flight: dict[int, InFlight] = {}
        self._owed: dict[int, Owed] = {}  # weight halves to come (runtime.split_backward)
        self.updates = StageUpdates(  # the update side: sums, replica all-reduce, step
            module,
            self.stash,
            rank,
            stage,
            settings,
            self.losses,
            replica_group,
            num_replicas,
            ties,
            microbatches,  # per batch; None: replicas do not share losses
            channel.timeout,  # the replica group's deadline too (``PipelineRunner.create``)
        )
        self.actions: tuple[Action, ...] = ()
        self.position = 0
        self._last_use: dict[int, int] = {}
        self.activations = Activations(recompute, self.device)  # runtime.recompute
        self._ahead: dict[int, Ahead] = {}  # first stage, GPU: inputs being copied
        self._side = SideStreams()  # the stream those copies run on

    # ----- running ----------------------------------------------------------------------------

    def execute(
        self,
        actions: Sequence[Action],
        feed: Feed | None = None,
        update: Update | None = None,
        lookahead: Sequence[Action] = (),
        flush: bool = True,
    ) -> None:
        """Run ``actions`` in order, forwards taking inputs and losses from ``feed`` and
        ``STEP`` applying ``update``. ``lookahead`` (the actions that will follow, as far as
        they are known) decides which weight versions must outlive these actions, and the
        first receive of each link in either is posted at once. With ``flush``, return only
        once every message sent has left; without it the sends complete while later actions
        run, so this rank does not wait for its peer to post its receive."""
        self.set_feed(feed, update)
        try:
            self._run(actions, lookahead)
        finally:
            self.set_feed(None, None)
        if flush:
            self.channel.flush()

    def set_feed(self, feed: Feed | None, update: Update | None) -> None:
        """What the next actions take their inputs and losses from, and apply updates with."""
        self._feed, self._update = feed, update

    def _run(self, actions: Sequence[Action], lookahead: Sequence[Action]) -> None:
        self.load(actions, lookahead)
        run_posting_ahead(self.actions, lookahead, self.channel, self.run_one)
        self.unload()

    def load(self, actions: Sequence[Action], lookahead: Sequence[Action]) -> None:
        """Take ``actions`` (this stage's) as the list to run; ``lookahead`` (this stage's
        actions that will follow) decides which weight versions outlive them."""
        self.actions = tuple(actions)
        self._last_use = last_uses((*self.actions, *lookahead), self.weight_prediction)
        if self.stage == 0 and self._feed is not None:  # on a GPU: inputs copied ahead
            forwards = [minibatch_of(a) for a in self.actions if a.kind is ActionKind.FORWARD]
            self._ahead = prefetch_each(forwards, self._feed.inputs, self.device, self._side)

    def run_one(self, action: Action, position: int) -> None:
        """Run ``action``, the one at ``position`` of the loaded list."""
        self.position = position
        if self.record_timeline:  # on a GPU: the action's own time, not its launch's
            settle(self.device)
        start = time.perf_counter()
        try:
            self._handlers[action.kind](self, action)
        except (ExecutorError, PeerError):
            raise
        except RuntimeError as error:
            raise ExecutorError(f"{self.describe} failed at action {action}: {error}") from error
        if self.record_timeline:
            settle(self.device)
            self.recording.add(action, start, time.perf_counter())

    def unload(self) -> None:
        """After the loaded list ran."""
        self.position = len(self.actions)
        self._ahead = {}

    @property
    def timeline(self) -> list[TimelineEvent]:
        """The actions run while ``record_timeline`` was on."""
        return self.recording.events

    def take_timeline(self) -> list[TimelineEvent]:
        """The timeline so far, which then starts again empty: a reader that needs only the
        actions since its last read (the re-plan check) keeps it short."""
        return self.recording.take()

    def restart(self) -> None:
        """After a drain: nothing is in flight; the live weights become version 0 again."""
        if self._flight or self._owed or self._received or self._gradients or self.updates.pending:
            raise ExecutorError(
                f"{self.describe} cannot restart its pipeline with work in flight (minibatches: "
                f"{sorted(self._flight)}, gradients not yet applied: {self.updates.pending}); "
                f"drain it first"
            )
        if self.tied_versions is not None:
            self.tied_versions.restart()
        self.stash.reset(0)
        self.losses.clear()  # the next run counts minibatches from 0

    def memory_peaks(self) -> tuple[int, int]:
        """The peaks of the weight versions stashed beyond the live ones and of the activations
        kept for backward passes, in bytes (``core.memory_report``)."""
        return int(self.stash.peak_bytes), int(self.activations.peak_bytes)

    def close(self) -> None:
        """Take the update side's hooks off the module."""
        self.updates.close()

    # ----- messages ---------------------------------------------------------------------------

    def _recv_activation(self, action: Action) -> None:
        self._received[minibatch_of(action)] = self.channel.recv(
            peer_of(action), Tag.ACTIVATION, f"the activations of minibatch {minibatch_of(action)}"
        )

    def _send_activation(self, action: Action) -> None:
        flight = self._flight[minibatch_of(action)]
        self.channel.send(
            Message(flight.outputs, fingerprint=flight.fingerprint, structure=flight.structure),
            peer_of(action),
            Tag.ACTIVATION,
            f"the activations of minibatch {minibatch_of(action)}",
        )
        if flight.replay is not None:  # recompute: the backward pass makes them again
            flight.outputs = []

    def _recv_grad(self, action: Action) -> None:
        self._gradients[minibatch_of(action)] = self.channel.recv(
            peer_of(action), Tag.GRAD, f"the gradients of minibatch {minibatch_of(action)}"
        )

    def _send_grad(self, action: Action) -> None:
        flight = self._flight.pop(minibatch_of(action))
        # One entry per tensor received; an empty one where no gradient flows (integer
        # tensors, tensors that did not ask for one, or that the stage did not use).
        grads = [t.grad if t.grad is not None else _NO_GRADIENT for t in flight.inputs]
        self.channel.send(
            Message(grads, self.losses.of(batch_of(action))),
            peer_of(action),
            Tag.GRAD,
            f"the gradients of minibatch {minibatch_of(action)}",
        )

    # ----- compute ----------------------------------------------------------------------------

    def _forward(self, action: Action) -> None:
        i, version = minibatch_of(action), version_of(action)
        inputs: list[torch.Tensor] = []
        if self.stage == 0:
            if self._feed is None:
                raise ExecutorError(f"{self.describe} has no input for minibatch {i}")
            ahead = self._ahead.pop(i, None)
            if ahead is not None:
                value = ahead.take()
            else:
                value = map_tensors(lambda t: t.to(self.device), self._feed.inputs(i))
            received = None
        else:
            message = self._received.pop(i)
            inputs, value = message.tensors, unflatten(message.tensors, message.structure)
            received = message.fingerprint
        check = self._feed.fingerprint if self._feed is not None else None
        fingerprint = check(i, received) if check is not None else None
        params = self.stash.get(version)  # shares the live storage while current
        delay = delay_of(i, version, self.num_replicas) if self.weight_prediction else 0
        predicted = version > 0 and delay > 0
        if predicted:  # W_v + d (W_v - W_(v-1)), for this minibatch's forward and backward
            params = predict(params, self.stash.get(version - 1), delay)
        if self.tied_versions is not None:
            params = {**params, **self.tied_versions.params_for(i, self._update)}
        drop = self.activations.recompute and self.stage < self.num_stages - 1
        replay = Replay(value, rng_state(self.device)) if drop else None
        held = self.updates.hold()
        with self.precision.forward():
            saving = self.activations.forward(i, value, params.values(), drop)
            with self.updates.capture(params, held), saving, self.updates.recording(i):
                output = self._call(params, value)  # one argument, as nn.Sequential passes it
            loss = self._loss(output, i) if self.stage == self.num_stages - 1 else None
        flight = InFlight(version, params, inputs, [], fingerprint=fingerprint, predicted=predicted)
        flight.replay, flight.held = replay, held
        if loss is None:
            try:
                flight.outputs, flight.structure = flatten(output)
            except CrossingError as error:
                raise ExecutorError(explain(error, self.module, self.describe)) from None
        else:
            flight.loss = loss
            logged = self._feed.logged(i) if self._feed and self._feed.logged is not None else ()
            self.losses.add_later(batch_of(action), i, read_later(loss), logged)  # GPU: no wait
        if replay is not None:  # keep the input only; the outputs go once sent, graph now
            flight.outputs = detached(flight.outputs)
        self._flight[i] = flight
        self.activations.done(i, (value,) if replay else (*inputs, *flight.outputs))

    def _loss(self, output: Any, i: int) -> torch.Tensor:
        """The last stage's loss of minibatch ``i`` (in the forward's precision context)."""
        if self._feed is None:
            raise ExecutorError(f"{self.describe} has no loss for minibatch {i}")
        return self._feed.loss(output, i)

    def _backward(self, action: Action) -> None:
        i = minibatch_of(action)
        flight = self._flight[i]
        roots, grads = self._seeds(action, flight)
        params = flight.params
        leaves = [p for p in params.values() if p.requires_grad]
        wanted = leaves + [t for t in flight.inputs if t.requires_grad]
        if roots and wanted:
            found = torch.autograd.grad(roots, wanted, grads, allow_unused=True)
        else:
            found = ()
        names = [n for n, p in params.items() if p.requires_grad]
        self.updates.add(names, found[: len(leaves)])
        for tensor, grad in zip(
            [t for t in flight.inputs if t.requires_grad], found[len(leaves) :], strict=True
        ):
            tensor.grad = grad
        flight.outputs = []
        flight.params = {}
        flight.loss = None
        self._weights_done(i)

    def _weights_done(self, i: int) -> None:
        """Minibatch ``i``'s weight gradients are in the update's sums: free what it held."""
        if self.tied_versions is not None:  # minibatch i's tied gradient: an update of its own
            self.tied_versions.contribute(i, self.updates.sums)
        self.activations.release(i)
        if self.stage == 0:
            self._flight.pop(i, None)
        self.updates.release(self._needed())

    # ----- updates (runtime.stage_updates) ----------------------------------------------------

    def _allreduce(self, action: Action) -> None:
        self.updates.allreduce(action)

    def _step(self, action: Action) -> None:
        self.updates.step(action, self._update, self._needed())

    def _needed(self) -> Needed:
        """The weight versions a later action uses or a forward pass holds for its backward."""
        held = frozenset(f.version for f in self._flight.values() if f.params and not f.predicted)
        return Needed(self._last_use, self.position, held | self._owed_versions())

    _handlers: dict[ActionKind, Callable[..., None]] = {
        ActionKind.RECV_ACTIVATION: _recv_activation,
        ActionKind.SEND_ACTIVATION: _send_activation,
        ActionKind.RECV_GRAD: _recv_grad,
        ActionKind.SEND_GRAD: _send_grad,
        ActionKind.FORWARD: _forward,
        ActionKind.BACKWARD: _backward,
        ActionKind.BACKWARD_INPUT: SplitBackward._backward_input,
        ActionKind.BACKWARD_WEIGHT: SplitBackward._backward_weight,
        ActionKind.ALLREDUCE: _allreduce,
        ActionKind.STEP: _step,
    }


_NO_GRADIENT = torch.zeros(0)


def _before_first(module: nn.Module, stage: int) -> str | None:
    """What feeds the stage's first layer, as an error names it: the last layer of the stage
    before (by index, where the children are named by it: ``core.stage``); None on stage 0."""
    if stage == 0:
        return None
    first = next(iter(module._modules), "")
    last = f"the last of stage {stage - 1}"
    return f"layer {int(first) - 1} ({last})" if first.isdigit() else last
