"""A rank of several stages (chunks, ``planner.chunks``): a ``StageExecutor`` per stage, the
rank's action list dispatched to them action by action.

The schedule gives a chunked rank one list (``schedule.chunked``); every action names its stage,
and that stage's executor runs it, positions counted in its own actions so that it releases its
weight versions as a rank of one stage does. The stages share what belongs to the rank: the
channel, the losses it knows (they ride back with gradients whichever stage sends them), the
timeline and the update.

- **Messages.** Every message to another rank goes over the rank's one channel, whose links pair
  sends and receives in order; the validator holds every schedule to that
  (``schedule.checks.check_link_order``), so messages of different boundaries to the same peer
  never cross. A message between two stages of this rank (the turn of a V) is handed over in
  memory (``Loopback``): its tensors copied, as a channel delivers them, so that the receiving
  stage's in-place operations cannot reach the sending stage's graph.
- **Updates.** Each stage's ``STEP`` hands its mean gradient to the rank's ``RankUpdate``, which
  applies the rank's update once every stage it holds has stepped: the optimizer over the
  rank's layers steps once per batch, as on one device. The modes that run chunked plans flush
  every batch, so no stage computes between its ``STEP`` and the rank's update.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import nn

from pl_pipedream.planner.plan import Stage
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.lookahead import ExecutorError, run_posting_ahead
from pl_pipedream.runtime.timeline import Recording, TimelineEvent
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule.actions import Action

__all__ = ["ChunkedExecutor", "Loopback", "RankUpdate", "chunk_of"]


def chunk_of(module: nn.Module, stage: Stage) -> nn.Sequential:
    """``stage``'s layers out of ``module`` (a rank's layers, children named by their index in
    the pipeline, ``core.stage``), under the same names."""
    nodes = sorted(stage.nodes, key=int)
    return nn.Sequential(OrderedDict((node, module.get_submodule(node)) for node in nodes))


class Loopback:
    """The rank's channel as its stages use it: a message to the rank itself is handed over in
    memory, first in, first out per tag (the schedule sends it before it is received)."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel
        self.rank = channel.rank
        self.timeout = channel.timeout
        self._held: dict[int, deque[Message]] = {}  # by tag

    def send(self, message: Message, peer: int, tag: int, what: str) -> None:
        if peer != self.rank:
            self.channel.send(message, peer, tag, what)
            return
        tensors = [t.detach().clone().requires_grad_(t.requires_grad) for t in message.tensors]
        self._held.setdefault(tag, deque()).append(replace(message, tensors=tensors))

    def recv(self, peer: int, tag: int, what: str) -> Message:
        if peer != self.rank:
            return self.channel.recv(peer, tag, what)
        held = self._held.get(tag)
        if not held:
            raise ExecutorError(
                f"a stage takes a message from another stage of its rank only once it is sent "
                f"(rank {self.rank}: {what} not sent yet); run a schedule made by schedule.build"
            )
        return held.popleft()

    def expect(self, peer: int, tag: int) -> None:
        if peer != self.rank:
            self.channel.expect(peer, tag)

    def flush(self) -> None:
        self.channel.flush()


class RankUpdate:
    """The rank's ``Update``, applied once every one of its ``stages`` has stepped: each stage's
    ``STEP`` adds its gradients (and the storage its kept versions need) and waits."""

    def __init__(self, stages: Sequence[int]) -> None:
        self.stages = frozenset(stages)
        self._stepped: set[int] = set()
        self._gradients: dict[str, torch.Tensor] = {}
        self._storage: dict[str, torch.Tensor] = {}

    def of_stage(self, stage: int, update: Update | None) -> Update | None:
        """The ``Update`` that stage ``stage``'s executor applies (None: none given)."""
        if update is None:
            return None

        def apply(gradients: dict[str, torch.Tensor], storage: dict[str, torch.Tensor]) -> int:
            return self.add(stage, gradients, storage, update)

        return apply

    def add(
        self,
        stage: int,
        gradients: dict[str, torch.Tensor],
        storage: dict[str, torch.Tensor],
        update: Update,
    ) -> int:
        if stage in self._stepped:
            raise ExecutorError(
                f"each stage of a rank steps once per update of the rank (stage {stage} stepped "
                f"twice before stages {sorted(self.stages - self._stepped)}); run a schedule "
                "made by schedule.build"
            )
        self._stepped.add(stage)
        self._gradients.update(gradients)
        self._storage.update(storage)
        if self._stepped != self.stages:
            return 0
        gradients, storage = self._gradients, self._storage
        self._stepped, self._gradients, self._storage = set(), {}, {}
        return update(gradients, storage)

    @property
    def stepped(self) -> list[int]:
        """The stages that stepped in the update under way (none: no update half applied)."""
        return sorted(self._stepped)


class ChunkedExecutor:
    """Runs one rank's actions over ``executors`` (one per stage it holds, by stage index),
    which share one ``Loopback`` over ``channel``, one ``LossBook`` and the rank's update."""

    def __init__(self, executors: dict[int, StageExecutor], channel: Channel) -> None:
        self.executors = executors
        self.channel = channel
        self.rank = channel.rank
        first = next(iter(executors.values()))
        self.losses = first.losses
        self.tied_versions = None  # the chunked modes refuse tied parameters at setup
        self._update = RankUpdate(list(executors))
        self.recording = Recording(self.rank)
        for executor in executors.values():
            executor.recording = self.recording  # one timeline, in the rank's order

    @property
    def record_timeline(self) -> bool:
        return any(executor.record_timeline for executor in self.executors.values())

    @record_timeline.setter
    def record_timeline(self, on: bool) -> None:
        for executor in self.executors.values():
            executor.record_timeline = on

    def execute(
        self,
        actions: Sequence[Action],
        feed: Feed | None = None,
        update: Update | None = None,
        lookahead: Sequence[Action] = (),
        flush: bool = True,
    ) -> None:
        """``StageExecutor.execute`` over the rank's stages: each action runs on its stage's
        executor; the rank's receives are posted ahead over the one channel."""
        for index, executor in self.executors.items():
            executor.set_feed(feed, self._update.of_stage(index, update))
        try:
            self._run(actions, lookahead)
        finally:
            for executor in self.executors.values():
                executor.set_feed(None, None)
        if flush:
            self.channel.flush()

    def _run(self, actions: Sequence[Action], lookahead: Sequence[Action]) -> None:
        for index, executor in self.executors.items():
            executor.load(_of(actions, index), _of(lookahead, index))
        positions = dict.fromkeys(self.executors, 0)

        def run(action: Action, _: int) -> None:
            self._executor(action).run_one(action, positions[action.stage])
            positions[action.stage] += 1

        run_posting_ahead(actions, lookahead, self.channel, run)
        for executor in self.executors.values():
            executor.unload()

    def _executor(self, action: Action) -> StageExecutor:
        executor = self.executors.get(action.stage)
        if executor is None:
            raise ExecutorError(
                f"rank {self.rank} runs the actions of the stages it holds (action {action}; "
                f"stages: {sorted(self.executors)}); run the schedule of this rank"
            )
        return executor

    @property
    def timeline(self) -> list[TimelineEvent]:
        return self.recording.events

    def take_timeline(self) -> list[TimelineEvent]:
        return self.recording.take()

    def restart(self) -> None:
        """After a drain: every stage starts again at version 0."""
        if self._update.stepped:
            raise ExecutorError(
                f"rank {self.rank} cannot restart its pipeline with an update half applied "
                f"(stages stepped: {self._update.stepped}); drain it first"
            )
        for executor in self.executors.values():
            executor.restart()

    def memory_peaks(self) -> tuple[int, int]:
        """Each stage's peaks added up: at most, the rank's own peaks."""
        peaks = [executor.memory_peaks() for executor in self.executors.values()]
        return sum(p[0] for p in peaks), sum(p[1] for p in peaks)

    def close(self) -> None:
        for executor in self.executors.values():
            executor.close()


def _of(actions: Sequence[Action], stage: int) -> list[Action]:
    return [action for action in actions if action.stage == stage]
