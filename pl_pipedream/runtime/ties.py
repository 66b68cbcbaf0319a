"""Tied parameters: one parameter that layers on several stages use (docs/guide.md, "Tied
parameters").

Every stage whose layers use a tied parameter holds a copy of it. Its gradient for an update is
the sum over all its uses, as autograd gives on one device: before each update, every holder
rank adds its own partial sum (the backward passes it ran) in one all-reduce over the ranks of
all holding stages, replicas included. A replicated stage's replicas therefore take part with
their partial sums and leave the tied parameter out of their own replica all-reduce, so no
contribution is counted twice. Every holder then divides by the same update size and steps with
the same optimizer state, so the copies stay bit-identical (gloo's all-reduce gives every rank
the same sum). A holder that stops makes the others' all-reduce fail: they raise a ``PeerError``
naming it by rank and stage, at the pipeline's deadline if it hangs.

This holds for the modes where every stage uses the same weight version for a minibatch and
makes one update per batch (the flushed modes and ``2bw``); the per-minibatch modes give a tied
parameter a version rule of its own (``runtime.tied_versions``), which holds for a straight
pipeline only: ``check_ties`` refuses the rest at setup.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime.frames import PeerError
from pl_pipedream.runtime.gradient_sums import GradientSums
from pl_pipedream.runtime.ranks import describe, group_failure
from pl_pipedream.schedule.modes import SyncMode

__all__ = ["TiedGradients", "check_ties"]


class TiedGradients:
    """Sums the gradients of this stage's tied parameters over every holder before an update.

    ``create`` makes one process group per tie (every rank must call it, in the same order; the
    pipeline gives them back at close); ``reduce`` runs the all-reduces of the ties this rank
    holds, in that order."""

    def __init__(
        self,
        held: Sequence[tuple[str, Any, Tie]],
        groups: Sequence[Any] = (),
        rank: int = 0,
        timeout: float | None = None,
    ) -> None:
        self.held = list(held)  # (local name, process group, tie) of each tie this rank holds
        self.groups = list(groups)  # every group made, to give back at close
        self.rank = rank
        self.timeout = timeout  # the groups' deadline: the pipeline's

    @classmethod
    def create(cls, ties: Sequence[Tie], rank: int, timeout: float | None = None) -> TiedGradients:
        deadline = None if timeout is None else timedelta(seconds=timeout)
        groups, held = [], []
        for tie in ties:
            group = dist.new_group(list(tie.ranks), timeout=deadline)
            groups.append(group)
            name = tie.name_on(rank)
            if name is not None:
                held.append((name, group, tie))
        return cls(held, groups, rank, timeout)

    @property
    def names(self) -> set[str]:
        return {name for name, _, _ in self.held}

    def reduce(
        self, accumulated: GradientSums | dict[str, torch.Tensor], module: nn.Module
    ) -> set[str]:
        """Replace each held tie's partial gradient sum in ``accumulated`` by the sum over all
        holders (zeros where this rank had no use of it); returns the names replaced."""
        if not self.held:
            return set()
        params = dict(module.named_parameters())
        for name, group, tie in self.held:
            partial = accumulated.get(name)
            total = torch.zeros_like(params[name]) if partial is None else partial.detach().clone()
            start = time.monotonic()
            try:
                dist.all_reduce(total, group=group)
            except RuntimeError as error:
                raise self._stopped(tie, error, time.monotonic() - start) from None
            accumulated[name] = total
        return self.names

    def _stopped(self, tie: Tie, cause: BaseException, waited: float) -> PeerError:
        """The all-reduce of ``tie`` failed: name the other holders, one of which stopped."""
        stages = dict(zip(tie.stages, tie.stage_ranks, strict=True))
        me = next(describe(self.rank, s) for s, ranks in stages.items() if self.rank in ranks)
        others = [describe(r, s) for s, ranks in stages.items() for r in ranks if r != self.rank]
        what = f"the gradient of the tied parameter {tie.describe()}"
        text = group_failure(me, what, "fellow holder", others, cause, waited, self.timeout)
        return PeerError(text)


def check_ties(
    mode: SyncMode,
    ties: Sequence[str],
    replicas: Sequence[int] = (),
    front_end: str = "PipeDreamStrategy",
) -> None:
    """Raise for tied parameters (``ties``: each described) where their rule is not built: the
    per-minibatch modes give a tied parameter a version of its own (``runtime.tied_versions``),
    which holds for a straight pipeline only (``replicas``: each stage's replica count).
    ``front_end``: the class whose arguments the fix quotes."""
    if ties and mode.updates_per_minibatch and any(r > 1 for r in replicas):
        raise ValueError(
            f"tied parameters (one parameter used by layers on several stages) train in sync "
            f"'{mode}' only without replicated stages (replicas: {list(replicas)}, tied: "
            f"{'; '.join(ties)}); use {front_end}(sync='{SyncMode.FLUSH}'), "
            f"'{SyncMode.GPIPE}' or '{SyncMode.TWO_BW}', a plan without replicas, or place "
            "every layer using the parameter on one stage with balance="
        )
