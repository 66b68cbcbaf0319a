"""The update side of a stage executor: an update's gradients summed, averaged and applied.

Gradients of an update are summed over its backward passes (``add``); at ``ALLREDUCE`` over the
stage's replicas, in one message with their BatchNorm statistics, the losses they know shared too
(``allreduce``); at ``STEP`` each tied parameter's over its holders, and then every sum is divided
by ``update_size``, so an update sees the mean gradient, as single-device training on the same
minibatches would (``update_size`` is 1 where the last stage's backward seeds were scaled
instead). Where an update sums several backward passes (``sum_linear_gradients``), Linear layers
add their weight gradients into the sum inside the GEMM that computes them (``capture``,
``runtime.linear_sums``), saving a pass over the gradients per backward, on a stage where some
weight is large enough for that to pay (``UpdateSettings.fused_linear_min_elements``). Where the
backward is split (``split_backward``), those products wait for the weight half instead
(``hold``, ``add_held``); on a stage of small layers, the input half computes every gradient,
as a whole backward does, and the weight half has nothing to add.
``schedule.modes.update_settings`` chooses these for a mode.

A ``STEP`` means the same in every mode: the mean gradient is final and the ``Update`` applies it
to the live weights (in the modes that step inside the pipeline) or holds it for the trainer's
own optimizer step (in the flushed modes). The live version is kept first where a later action
still uses it; after every backward pass and step, the versions that nothing needs any more are
released (``release``).

A replica that stops breaks its peers' all-reduce, where the backend names only an address and
port. The peers then raise a ``PeerError`` that names it by rank and stage, worded as a
neighbour that stopped is (``ranks.peer_failure``); with more than two replicas, the backend
does not say which one stopped, and the error names every other replica as a candidate.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.runtime.frames import PeerError
from pl_pipedream.runtime.gradient_sums import GradientSums
from pl_pipedream.runtime.linear_sums import HeldProducts, LinearGradientSums, pays
from pl_pipedream.runtime.lookahead import ExecutorError
from pl_pipedream.runtime.losses import LossBook
from pl_pipedream.runtime.ranks import describe, group_failure
from pl_pipedream.runtime.running_stats import RunningStats
from pl_pipedream.runtime.stash import WeightStash
from pl_pipedream.runtime.ties import TiedGradients
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule.actions import Action
from pl_pipedream.schedule.modes import UpdateSettings

__all__ = ["Needed", "StageUpdates", "replica_stopped"]


@dataclass(frozen=True)
class Needed:
    """The weight versions the executor still needs where it stands: ``last_use`` gives the
    position of the last loaded action that uses each version (``lookahead.last_uses``),
    ``position`` the action running, ``held`` the versions forward passes keep for their
    backward passes."""

    last_use: Mapping[int, int]
    position: int
    held: frozenset[int] = frozenset()

    def later(self, version: int) -> bool:
        """Whether an action after this one uses ``version``."""
        return self.last_use.get(version, -1) > self.position


class StageUpdates:
    """The updates of one stage on one rank (see the module docstring). ``replicas`` ranks of
    the stage average their gradients over ``replica_group`` (made with a deadline of
    ``timeout`` seconds, if any); ``losses`` (a batch's minibatch losses, ``microbatches`` per
    batch) are shared among them, unless ``microbatches`` is None."""

    def __init__(
        self,
        module: nn.Module,
        stash: WeightStash,
        rank: int,
        stage: int,
        settings: UpdateSettings,
        losses: LossBook,
        replica_group: Any = None,
        replicas: int = 1,
        ties: TiedGradients | None = None,
        microbatches: int | None = None,
        timeout: float | None = None,
    ) -> None:
        self.module = module
        self.stash = stash
        self.rank = rank
        self.stage = stage
        self.describe = describe(rank, stage)
        self.update_size = settings.update_size
        summed = settings.sum_linear_gradients or settings.split_backward
        fused = summed and pays(module.parameters(), settings.fused_linear_min_elements)
        self.linear_sums = LinearGradientSums() if fused else None
        self.holds_products = settings.split_backward and fused  # for the weight halves
        self.losses = losses
        self.replica_group = replica_group  # its ranks: to name a replica that stopped
        self.replica_ranks = dist.get_process_group_ranks(replica_group) if replica_group else []
        self.replicas = replicas
        self.ties = ties or TiedGradients(())  # tied parameters: summed over their holders
        self.running_stats = RunningStats.of(module, replicas, self.describe)  # BatchNorm's
        self.microbatches = microbatches
        self.timeout = timeout
        self.sums = GradientSums()  # of the update under way
        self.copied_bytes = 0  # weights the updates copied to keep a stashed version intact

    @property
    def pending(self) -> bool:
        """Gradients (or BatchNorm statistics) gathered that no update has applied yet."""
        linear = self.linear_sums is not None and self.linear_sums.pending
        stats = self.running_stats is not None and self.running_stats.pending
        return bool(self.sums) or linear or stats

    def hold(self) -> HeldProducts | None:
        """Where the backward is split and the Linear layers fused, what a forward's Linear
        layers leave for its weight half (None otherwise)."""
        return HeldProducts() if self.holds_products else None

    def capture(
        self, params: dict[str, torch.Tensor], held: HeldProducts | None = None
    ) -> AbstractContextManager:
        """Where several backward passes make one update and the stage's weights are large
        enough, Linear layers sum their weight gradients inside the GEMM (``linear_sums``)
        instead of returning them to be added; with ``held`` (``hold``), their products wait
        there for ``add_held``."""
        if self.linear_sums is None:
            return nullcontext()
        return self.linear_sums.capture(params, held)

    def add_held(self, held: HeldProducts | None) -> None:
        """A weight half: the Linear products ``held`` kept, added into the update's sums."""
        if held is not None and self.linear_sums is not None:
            held.add_into(self.linear_sums)

    def recording(self, minibatch: int) -> AbstractContextManager:
        """A replicated stage records the BatchNorm updates of ``minibatch``'s forward, to
        combine them among the replicas at the all-reduce (``runtime.running_stats``)."""
        stats = self.running_stats
        return nullcontext() if stats is None else stats.forward(minibatch)

    def add(self, names: list[str], grads: tuple[torch.Tensor | None, ...]) -> None:
        """Add one backward pass's gradients of the parameters ``names`` to the update's sums."""
        self.sums.add(names, grads)

    def _take_linear_sums(self) -> None:
        """Move the sums the Linear layers kept into the update's gradients."""
        if self.linear_sums is not None:
            self.sums.add_totals(self.linear_sums.take())

    def allreduce(self, action: Action) -> None:
        """``ALLREDUCE``: the update's sums (and BatchNorm statistics) summed over the stage's
        replicas, and the losses of ``action``'s batch shared among them."""
        self._take_linear_sums()
        if self.replicas <= 1:
            return
        tied = self.ties.names  # summed over every holder rank at the step instead
        reduced = [
            (n, p) for n, p in self.module.named_parameters() if p.requires_grad and n not in tied
        ]
        stats = self.running_stats
        extra = None if stats is None else stats.message(action.replica)
        with self._among_replicas(f"the gradients of update {action.version}"):
            extra = self.sums.all_reduce(reduced, self.replica_group, extra)
        if stats is not None and extra is not None:  # the same message, after the gradients
            stats.combine(extra)
        if self.microbatches is not None and action.batch is not None:
            with self._among_replicas(f"the losses of batch {action.batch}"):
                self.losses.share(action.batch, self.microbatches, self.replica_group)

    @contextmanager
    def _among_replicas(self, what: str) -> Iterator[None]:
        """A collective over the stage's replicas that fails names the replica that stopped."""
        start = time.monotonic()
        try:
            yield
        except (ExecutorError, PeerError):
            raise
        except RuntimeError as error:
            waited = time.monotonic() - start
            others = [r for r in self.replica_ranks if r != self.rank]
            raise replica_stopped(
                self.describe, what, self.stage, others, error, waited, self.timeout
            ) from None

    def step(self, action: Action, update: Update | None, needed: Needed) -> None:
        """``STEP``: the update's mean gradient applied through ``update``, making the live
        weights ``action.version``; the live version is kept first if a later action uses it."""
        self._take_linear_sums()
        self.ties.reduce(self.sums, self.module)
        if needed.later(self.stash.live_version):
            self.stash.get(self.stash.live_version)
        gradients = self.sums.mean(self.update_size)
        if update is None:
            raise ExecutorError(f"{self.describe} has no way to apply update {action.version}")
        self.release(needed)
        storage = self.stash.storage_for_update(gradients)
        self.copied_bytes += update(gradients, storage)
        self.stash.mark_stepped(storage)
        if self.stash.live_version != action.version:
            raise ExecutorError(
                f"{self.describe}: update {action.version} made the live weights version "
                f"{self.stash.live_version}; the schedule and the updates disagree"
            )
        self.release(needed)

    def close(self) -> None:
        """Take the BatchNorm hooks off the module."""
        if self.running_stats is not None:
            self.running_stats.close()

    def release(self, needed: Needed) -> None:
        """Drop the snapshots that no later action of the loaded list uses and no forward pass
        still holds for its backward (a dropped snapshot's tensors are reused)."""
        done = [v for v in self.stash.kept() if not needed.later(v) and v not in needed.held]
        self.stash.release(done)


def replica_stopped(
    who: str,
    what: str,
    stage: int,
    others: Sequence[int],
    cause: BaseException,
    waited: float | None,
    timeout: float | None,
) -> PeerError:
    """``who`` could not sum ``what`` with the other replicas of ``stage`` (ranks ``others``):
    the error names the replica that stopped, or, with several, each that may have."""
    named = [describe(rank, stage) for rank in others]
    return PeerError(group_failure(who, what, "replica", named, cause, waited, timeout))
