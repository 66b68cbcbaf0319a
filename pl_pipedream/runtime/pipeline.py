"""One rank's pipeline across Lightning steps: feed a batch, keep going, drain on demand.

A *run* is the stretch of training between two drains. In step ``t`` of a run the rank executes
its segment ``t`` of the schedule (every forward of batch ``t`` and whatever backward passes
and updates the schedule interleaves with them). In the asynchronous modes nothing is flushed
between steps; when training stops, or before validation or a checkpoint, ``drain`` runs the
remaining backward passes and updates, and the next step starts a new run.

Every rank logs the same training loss in step ``t``: the mean of the newest batch whose every
backward pass has reached the first stage by the end of step ``t`` (the schedule says which; all
of its losses have reached every rank by then, ``runtime.losses``). In the flushed modes that is
batch ``t`` itself; in the others it lags by the pipeline's depth. After a drain it is the run's
last batch, and it stays the loss until a later batch completes.

What else the last stage's loss function logged for a batch's minibatches travels with their
losses; ``take_logged`` hands it over once per batch, for every batch that finished since the
last call (a drain finishes several at once), in batch order.

A step does not wait for its messages to leave (a gloo send completes only once the peer has
posted its receive, which would tie the ranks together at every step); the sends of one step
complete during the next, and a drain waits for all of them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime import ranks
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.chunks import ChunkedExecutor, Loopback, chunk_of
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.losses import Logged, LossBook
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.runtime.staleness import carry_counts, check_corrections
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.runtime.tied_versions import TiedVersions
from pl_pipedream.runtime.ties import TiedGradients
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule.actions import WEIGHT_GRADS, Action
from pl_pipedream.schedule.memory import frames_in_flight
from pl_pipedream.schedule.modes import SyncMode, update_settings
from pl_pipedream.schedule.stream import SegmentStream

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """Drives a ``StageExecutor`` through the per-step segments of a ``SegmentStream``; every
    ``STEP`` applies ``update``."""

    def __init__(
        self,
        plan: Plan,
        sync: SyncMode,
        microbatches: int,
        executor: StageExecutor | ChunkedExecutor,
        update: Update,
    ) -> None:
        self.plan = plan
        self.sync = sync
        self.microbatches = microbatches
        self.executor = executor
        self.update = update
        # the executor runs only what the validator checked, over this rank's neighbourhood
        self.stream = SegmentStream.of_rank(plan, sync, microbatches, executor.rank)
        self.lookahead = plan.num_stages + 2
        self.step = 0  # Lightning steps since the last drain
        self.batches = 0  # batches fed since the pipeline was built
        self.loss: float | None = None  # the mean loss of the newest finished batch
        self.loss_batch: int | None = None  # which of the batches fed ``loss`` belongs to
        self._finished: dict[int, int] = {}  # batch -> backward passes done at the first stage
        self._taken = -1  # the batch of ``loss`` in this run (-1: none yet)
        self._logged: list[tuple[Logged, ...]] = []  # finished batches' logged values, not taken
        self._first_stage = plan.stages[0].ranks
        # Each segment is asked for up to lookahead + 2 times (as a step's own, as lookahead,
        # by the loss bookkeeping): each is built once, and dropped once its step has passed.
        self._segments: dict[tuple[int, int], tuple[Action, ...]] = {}
        self.groups: list[Any] = []  # process groups made for this pipeline alone
        self.data_group: Any = None  # replicas that compare their data (a plan of one stage)

    @classmethod
    def create(
        cls,
        plan: Plan,
        sync: SyncMode,
        microbatches: int,
        module: nn.Module,
        rank: int,
        update: Update,
        device: torch.device,
        timeout: float,
        record_timeline: bool = False,
        ties: Sequence[Tie] = (),
        weight_prediction: bool = False,
        recompute: bool = False,
        precision: StagePrecision | None = None,
    ) -> PipelineRunner:
        """The pipeline of ``rank`` running ``module`` (its stage's layers): a channel, replica
        groups and a group per tied parameter (``ties``, every one of the pipeline, in the same
        order on every rank) of its own (every rank must call this at the same point).
        ``weight_prediction``: forwards run on predicted weights (``runtime.staleness``);
        ``recompute``: stages keep only their inputs (``runtime.recompute``); ``precision``:
        the forward passes' context and the loss scale (``runtime.precision``)."""
        check_corrections(sync, weight_prediction, 0, [t.describe() for t in ties])
        # A replica all-reduce waits for a stopped replica as long as a receive waits for a peer.
        deadline = timedelta(seconds=timeout)
        replica_groups = [
            dist.new_group(list(s.ranks), timeout=deadline) if s.replicas > 1 else None
            for s in plan.stages
        ]
        # A receive posted ahead that training never matched stays posted: the messages of each
        # pipeline get a group of their own, so it cannot take a later pipeline's message.
        messages = dist.new_group(list(range(plan.num_workers)))
        # per-minibatch modes: a tied parameter has versions of its own (runtime.tied_versions)
        versioned = sync.updates_per_minibatch
        tied = TiedGradients.create(() if versioned else ties, rank, timeout)
        held_stages = plan.stages_of_rank(rank)
        describe = ranks.describe(rank, held_stages[0].index)
        channel = Channel(rank, device, timeout, describe, messages)
        # A send older on its link than the messages the schedule can leave unreceived there has
        # been received: waiting for it only frees its frame (runtime.channel). Other links:
        # a tie's contributions are received p minibatches later at most (runtime.tied_versions);
        # evaluation and predictions flow one way, where the bound only paces the sender.
        tags = {"a": Tag.ACTIVATION, "g": Tag.GRAD}
        channel.pending_per_link = {
            (peer, tags[tensor]): count
            for (peer, tensor), count in frames_in_flight(plan, sync, microbatches, rank).items()
        }
        channel.max_pending = plan.num_stages + 1
        held = versioned and any(t.name_on(rank) is not None for t in ties)
        delay = plan.num_stages - 1
        versions = TiedVersions(ties, rank, module, channel, delay, describe) if held else None

        def executor_of(stage: Stage, layers: nn.Module, link: Any, losses: Any) -> StageExecutor:
            return StageExecutor(
                layers,
                rank,
                stage.index,
                plan.num_stages,
                link,
                update_settings(sync, microbatches, stage.replicas),
                replica_group=replica_groups[stage.index],
                num_replicas=stage.replicas,
                device=device,
                record_timeline=record_timeline,
                ties=tied,
                microbatches=microbatches,
                tied_versions=versions,
                weight_prediction=weight_prediction,
                recompute=recompute,
                precision=precision,
                losses=losses,
            )

        executor: StageExecutor | ChunkedExecutor
        if len(held_stages) == 1:
            executor = executor_of(held_stages[0], module, channel, None)
        else:  # several stages (chunks): an executor each, one channel and loss book
            losses, loop = LossBook(), Loopback(channel)
            executor = ChunkedExecutor(
                {s.index: executor_of(s, chunk_of(module, s), loop, losses) for s in held_stages},
                channel,
            )
        runner = cls(plan, sync, microbatches, executor, update)
        runner.groups = [group for group in replica_groups if group is not None] + tied.groups
        if plan.num_stages == 1:  # no boundary for stage 0's fingerprints to cross
            runner.data_group = replica_groups[0]
        return runner

    def carry_over(self, old: PipelineRunner) -> None:
        """Go on from ``old``, a drained runner this one replaces (a re-plan): what counts for
        the whole fit, the batches fed (the divergence check finds a loss's batch by it), the
        newest loss and its batch, and the updates counted by its learning-rate corrections
        (``runtime.staleness.carry_counts``)."""
        self.batches, self.loss, self.loss_batch = old.batches, old.loss, old.loss_batch
        carry_counts(self.update, old.update)

    @property
    def drained(self) -> bool:
        return self.step == 0

    def train_batch(
        self,
        inputs: Callable[[int], Any],
        loss: Callable[[Any, int], torch.Tensor],
        drain: bool = False,
        fingerprint: Callable[[int, float | None], float] | None = None,
        logged: Callable[[int], tuple[tuple[str, Any], ...]] | None = None,
    ) -> None:
        """Run this rank's segment for the next batch; ``inputs``/``loss``/``fingerprint``/
        ``logged`` take the microbatch index within the batch (``Feed``). With ``drain``, the
        pipeline drains right after it."""
        if fingerprint is not None and self.data_group is not None:
            self._compare_replicas(fingerprint)
        first = self.step * self.microbatches
        feed = Feed(
            lambda i: inputs(i - first),
            lambda output, i: loss(output, i - first),
            None if fingerprint is None else lambda i, got: fingerprint(i - first, got),
            None if logged is None else lambda i: logged(i - first),
        )
        self.executor.execute(
            self._segment(self.executor.rank, self.step),
            feed,
            self.update,
            lookahead=self._upcoming(drain),
            flush=False,
        )
        self._note_finished(self.step)
        self.step += 1
        self.batches += 1
        for key in [k for k in self._segments if k[1] < self.step]:
            del self._segments[key]
        if drain:
            self.drain()

    def _compare_replicas(self, fingerprint: Callable[[int, float | None], float]) -> None:
        """The data check of a plan of one stage, where no activations carry stage 0's
        fingerprints on: the replicas take the highest and the lowest of each microbatch's
        fingerprints (one all-reduce of 2 m numbers) and every replica checks its own against
        whichever of the two differs from it, so all of them stop at the same step."""
        m = self.microbatches
        own = torch.tensor([fingerprint(j, None) for j in range(m)], dtype=torch.float64)
        extremes = torch.cat([own, -own])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=self.data_group)
        for j in range(m):
            high, low = float(extremes[j]), -float(extremes[m + j])
            if high != low:
                fingerprint(j, low if float(own[j]) == high else high)

    def _note_finished(self, t: int) -> None:
        """After step ``t``: count the first stage's backward passes of its segments and take
        the mean loss of the newest batch they finished (``LossBook.mean``; a batch this rank
        does not know whole, which the schedule rules out, is passed over)."""
        for rank in self._first_stage:
            for action in self._segment(rank, t):
                if action.kind in WEIGHT_GRADS and action.stage == 0 and action.batch is not None:
                    self._finished[action.batch] = self._finished.get(action.batch, 0) + 1
        done = [b for b, count in self._finished.items() if count == self.microbatches]
        self._take_loss(max(done, default=-1))

    def _take_loss(self, batch: int) -> None:
        losses = self.executor.losses
        for b in range(batch, self._taken, -1):
            mean = losses.mean(b, self.microbatches)
            if mean is not None:
                for done in range(self._taken + 1, b + 1):
                    if done == b or losses.mean(done, self.microbatches) is not None:
                        self._logged.append(losses.logged(done, self.microbatches))
                self.loss, self._taken = mean, b
                self.loss_batch = self.batches - self.step + b  # the run began at batches - step
                losses.forget_before(b)
                for old in [k for k in self._finished if k < b]:
                    del self._finished[old]
                return

    def take_logged(self) -> list[tuple[Logged, ...]]:
        """What the loss function logged for each batch finished since the last call, per
        minibatch, in batch order (every rank gets the same)."""
        logged, self._logged = self._logged, []
        return logged

    def _upcoming(self, drain: bool) -> list[Action]:
        """The actions after this step's segment: the drain, or the next segments. Only these
        have their receives posted ahead, so none waits for a message that never comes (a peer
        that finished and closed its connection fails such a receive at once)."""
        rank = self.executor.rank
        if drain:
            return list(self.stream.drain(rank, self.step))
        upcoming: list[Action] = []
        for later in range(self.step + 1, self.step + 1 + self.lookahead):
            upcoming.extend(self._segment(rank, later))
        return upcoming

    def _segment(self, rank: int, t: int) -> tuple[Action, ...]:
        segment = self._segments.get((rank, t))
        if segment is None:
            segment = self._segments[(rank, t)] = self.stream.segment(rank, t)
        return segment

    def drain(self) -> None:
        """Finish every minibatch in flight and apply its update; the next batch starts a run."""
        if self.drained:
            return
        self.executor.execute(
            self.stream.drain(self.executor.rank, self.step - 1), None, self.update, flush=False
        )
        if self.executor.tied_versions is not None:  # every holder applies every tied update
            self.executor.tied_versions.finish(self.update)  # (before waiting for sends to leave)
        self.executor.channel.flush()
        self._take_loss(self.step - 1)  # every batch of the run has finished
        self.executor.restart()
        self._segments.clear()
        self._finished.clear()
        self._taken = -1
        self.step = 0

    def close(self, failed: bool = False) -> None:
        """Wait for the sends still under way (unless training failed: a peer that stopped
        would never take them), then give back the pipeline's process groups."""
        groups, self.groups = self.groups, []
        self.executor.close()
        try:
            self.executor.channel.close(flush=not failed)
        finally:
            for group in groups:
                dist.destroy_process_group(group)
