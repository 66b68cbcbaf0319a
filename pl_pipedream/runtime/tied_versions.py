"""Tied parameters in the per-minibatch modes (``async``, ``vertical_sync``; docs/guide.md,
"Tied parameters"): every holder uses, for minibatch i, the tied parameter after
max(0, i - (p-1)) updates, and update i applies the gradient of minibatch i summed over every use.

A tied parameter therefore has a version of its own, apart from its stage's weight stash (which
leaves it out). Right after its backward pass of minibatch i, each holder keeps its partial
gradient of i and sends it to every other holder (one tag per tie, non-blocking; zeros where this
stage did not use it). Lazily, just before the first forward pass that needs tied version v, a
holder applies the tied updates it has not applied yet up to v, receiving the partial gradients
it lacks. Every forward pass of Lightning batch t runs during Lightning step t on every rank, and
a holder applies update u just before its forward of minibatch u + p (the first to need version
u + 1), so every holder applies it in the same Lightning step (same learning rate). The partial
gradients are summed in the order of the holder ranks on every holder, and only the tied
parameter gets a gradient in that update (the optimizer skips parameters whose ``.grad`` is None;
its per-parameter state, e.g. Adam's step count, is touched by the tied updates only), so the
copies stay bit-identical. The update goes through the stage's ``Update``, so Lightning's hooks of
an update (clipping included) run for it with only the tied parameter's ``.grad`` set. A drain
applies every update still owed (``finish``) before it waits for its sends to leave (a holder's
last partial gradients leave only once the other holder receives them there).

An update gives the tied parameter new storage, so the snapshot a forward pass took (shared
storage, a leaf of its own) stays as it was until its backward pass.

In a straight pipeline stage s has run its backward of minibatch i - p before its forward of i
(w_s = p - 1 - s warm-up forwards), and stage 0, the last to finish a minibatch, has run its
backward of i - p before any stage runs its forward of i: the contributions update i - p needs
exist when they are awaited. Replicated stages admit more minibatches (NOAM) and split them among
replicas; the strategy refuses ties with them in these modes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.frames import Message
from pl_pipedream.runtime.gradient_sums import GradientSums
from pl_pipedream.runtime.tags import tie_tag
from pl_pipedream.runtime.update import Update

__all__ = ["TiedVersions"]


class _Held(NamedTuple):
    """A tie this rank holds, with its name in the stage module and its message tag."""

    tie: Tie
    name: str
    tag: int


class TiedVersions:
    """The tied parameters of one rank's stage under the per-minibatch rule; ``delay`` is p - 1.

    ``ties``: every tie of the pipeline, in the same order on every rank (tie k's messages use
    ``tie_tag(k)``); this rank keeps those it holds."""

    def __init__(
        self,
        ties: Sequence[Tie],
        rank: int,
        module: nn.Module,
        channel: Channel,
        delay: int,
        describe: str,
    ) -> None:
        self.held = [
            _Held(tie, name, tie_tag(k))
            for k, tie in enumerate(ties)
            if (name := tie.name_on(rank)) is not None
        ]
        self.rank = rank
        self.module = module
        self.channel = channel
        self.delay = delay
        self.describe = describe
        self.version = 0  # tied updates applied in this run
        self.contributed = 0  # backward passes whose partial gradients this rank has sent
        self._own: dict[int, dict[str, torch.Tensor]] = {}

    @property
    def names(self) -> set[str]:
        return {held.name for held in self.held}

    def _expect(self) -> None:
        for held in self.held:
            for peer in held.tie.ranks:
                if peer != self.rank:
                    self.channel.expect(peer, held.tag)

    def params_for(self, i: int, update: Update | None) -> dict[str, torch.Tensor]:
        """The tied parameters minibatch i uses: version max(0, i - delay), applying the updates
        still owed up to it first (``update``: the stage's ``Update``)."""
        self._expect()
        self._apply_to(max(0, i - self.delay), update)
        live = dict(self.module.named_parameters())
        return {held.name: live[held.name].data.requires_grad_(True) for held in self.held}

    def contribute(self, i: int, accumulated: GradientSums | dict[str, torch.Tensor]) -> None:
        """After the backward pass of minibatch i: take its partial gradients out of the stage's
        update (``accumulated``) and send them to the other holders."""
        if i != self.contributed:
            raise RuntimeError(
                f"{self.describe} ran the backward pass of minibatch {i} after that of "
                f"{self.contributed - 1}; tied parameters need them in order"
            )
        self._expect()
        live = dict(self.module.named_parameters())
        own = {}
        for held in self.held:
            grad = accumulated.pop(held.name, None)
            own[held.name] = torch.zeros_like(live[held.name]) if grad is None else grad.detach()
            for peer in held.tie.ranks:
                if peer != self.rank:
                    what = f"the gradient of tied parameter {held.tie.describe()} for minibatch {i}"
                    self.channel.send(Message([own[held.name]]), peer, held.tag, what)
        self._own[i] = own
        self.contributed += 1

    def finish(self, update: Update | None) -> None:
        """At a drain: apply every update owed (one per backward pass run in this run)."""
        self._apply_to(self.contributed, update)

    def restart(self) -> None:
        if self.version != self.contributed or self._own:
            raise RuntimeError(
                f"{self.describe} cannot restart with tied updates owed (applied: "
                f"{self.version}, minibatches: {self.contributed}); drain the pipeline first"
            )
        self.version = self.contributed = 0

    def _apply_to(self, version: int, update: Update | None) -> None:
        while self.version < version:
            u = self.version
            own = self._own.pop(u, None)
            if own is None:
                raise RuntimeError(
                    f"{self.describe} needs tied update {u} before its own backward pass of "
                    f"minibatch {u} (tied minibatches run: {self.contributed}); the schedule "
                    "and the tie rule disagree"
                )
            if update is None:
                raise RuntimeError(f"{self.describe} has no way to apply tied update {u}")
            gradients = {held.name: self._sum(held, u, own[held.name]) for held in self.held}
            live = dict(self.module.named_parameters())
            # new storage: a forward's snapshot keeps the old values for its backward
            storage = {name: torch.empty_like(live[name].detach()) for name in gradients}
            update(gradients, storage)
            for name, tensor in storage.items():
                if live[name].data_ptr() != tensor.data_ptr():
                    raise RuntimeError(
                        f"a tied update must make the tensor it was given the parameter's "
                        f"storage ({self.describe}, parameter: {name}); apply updates with "
                        "pl_pipedream.runtime.update.step"
                    )
            self.version += 1

    def _sum(self, held: _Held, u: int, own: torch.Tensor) -> torch.Tensor:
        """Minibatch u's gradient over every holder, added in the order of the holder ranks."""
        total = None
        for peer in held.tie.ranks:
            if peer == self.rank:
                part = own
            else:
                what = f"the gradient of tied parameter {held.tie.describe()} for minibatch {u}"
                part = self.channel.recv(peer, held.tag, what).tensors[0].to(own.device)
                self.channel.expect(peer, held.tag)
            total = part.clone() if total is None else total.add_(part)
        assert total is not None
        return total
