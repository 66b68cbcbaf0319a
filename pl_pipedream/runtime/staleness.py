"""Corrections for stale weights in the per-minibatch modes (docs/guide.md, "The sync modes").

In ``async`` and ``vertical_sync`` a stage runs minibatch i on weights d updates older than the
ones a synchronous run would use (d: the minibatch's delay at that stage). Three corrections act
on that delay, each optional and each exact against the rule it implements:

* **Weight prediction** (``predict``): the forward and backward passes of the minibatch run on
  W_v + d (W_v - W_(v-1)), an extrapolation of the last update d updates ahead, instead of W_v.
  Only the previous weight version is needed, so it works with any optimizer; for SGD with
  momentum it is W_v - d lr buf_v. The gradient still updates the latest weights.
* **Learning-rate warm-up per delay** (``WarmedUpdate``): the u-th update of a stage whose delay
  is d_s uses the learning rate times min(1, u / K_s), K_s = ``per_delay`` * d_s, so the stages
  with the stalest gradients take the smallest first steps and all reach the base rate after
  their own K_s updates (a stage without delay, or ``per_delay`` 0, is not warmed up).
* **Learning rate per delay** (``DelayScaledUpdate``, PipeMare, Yang et al. 2021, section 3.1):
  the update of stage s after u earlier ones steps with the learning rate divided by
  tau_s ** (1 - min(u / T, 1)), tau_s = max(1, d_s), so a stage whose gradients are d_s updates
  stale takes steps d_s times shorter; with T 0 the factor stays 1 / tau_s throughout, with
  T > 0 it anneals geometrically to 1 over the first T updates. Gradient descent on gradients
  d updates old is stable on a quadratic only up to a learning rate falling about as 1 / d
  (PipeMare, section 3): the shorter steps keep the stalest stages inside that bound.

The corrections compose: a stage's learning rate is the product of its factors. ``2bw`` is
left out: its delay is one version at every stage, so tau_s = max(1, 1) = 1 and the learning
rate per delay would change nothing, and its batch-level rule is not the per-minibatch one that
prediction and the warm-up implement.

A minibatch's delay is ``floor(i / r_s) - v`` (``delay_of``): r_s replicas of the stage share
one update per r_s minibatches, so floor(i / r_s) updates precede minibatch i's own update in a
synchronous run, and the rule runs it on version v. A stage's delay for the warm-up
(``stage_delay``) is the delay of its minibatches once the pipeline is full.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch
from torch import Tensor
from torch.optim import Optimizer

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.update import Update
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.rules import update_delay

__all__ = [
    "DelayScaledUpdate",
    "ScaledUpdate",
    "WarmedUpdate",
    "carry_counts",
    "check_corrections",
    "corrected_update",
    "delay_lr_factor",
    "delay_of",
    "predict",
    "stage_delay",
    "warmup_factor",
]


def check_corrections(
    sync: SyncMode,
    weight_prediction: bool,
    lr_warmup_per_delay: int,
    ties: Sequence[str] = (),
    delay_lr_updates: int | None = None,
) -> None:
    """Raise where a correction is asked for but its rule does not apply: outside the
    per-minibatch modes (no stage runs on stale weights between updates in ``flush`` and
    ``gpipe``; ``2bw``'s one version of delay is not this rule), and with tied parameters
    (``ties``: each described), whose versions of their own the rule does not cover.
    ``delay_lr_updates``: None (off), 0 (lr / tau_s throughout) or the T > 0 updates over
    which the learning rate per delay anneals to the base rate (``DelayScaledUpdate``)."""
    if not isinstance(lr_warmup_per_delay, int) or lr_warmup_per_delay < 0:
        raise ValueError(
            f"lr_warmup_per_delay must be a non-negative integer (lr_warmup_per_delay: "
            f"{lr_warmup_per_delay!r}); pass 0 to turn the warm-up off"
        )
    if delay_lr_updates is not None and (
        isinstance(delay_lr_updates, bool)
        or not isinstance(delay_lr_updates, int)
        or delay_lr_updates < 0
    ):
        raise ValueError(
            f"delay_lr_updates must be None or a non-negative integer (delay_lr_updates: "
            f"{delay_lr_updates!r}); pass None to turn it off, 0 to divide each stage's "
            "learning rate by its delay throughout, or T > 0 to anneal that to the base rate "
            "over T updates"
        )
    asked = [
        name
        for name, on in (
            ("weight_prediction=True", weight_prediction),
            (f"lr_warmup_per_delay={lr_warmup_per_delay}", lr_warmup_per_delay != 0),
            (f"delay_lr_updates={delay_lr_updates}", delay_lr_updates is not None),
        )
        if on
    ]
    if not asked:
        return
    if not sync.updates_per_minibatch:
        raise ValueError(
            f"the staleness corrections apply to sync '{SyncMode.ASYNC}' and "
            f"'{SyncMode.VERTICAL_SYNC}' only (sync: {sync}, asked: {', '.join(asked)}); "
            f"use sync='{SyncMode.ASYNC}' or leave the option at its default"
        )
    if ties:
        raise ValueError(
            f"the staleness corrections do not cover tied parameters, which have versions of "
            f"their own (tied: {'; '.join(ties)}, asked: {', '.join(asked)}); leave the option "
            f"at its default, use sync='{SyncMode.FLUSH}', or place every "
            "layer using the parameter on one stage with balance="
        )


def delay_of(minibatch: int, version: int, replicas: int = 1) -> int:
    """The updates between the weight ``version`` that minibatch ``minibatch`` runs on and the
    version a synchronous run would use, on a stage of ``replicas`` replicas."""
    return minibatch // replicas - version


@torch.no_grad()
def predict(
    current: Mapping[str, Tensor], previous: Mapping[str, Tensor], delay: int
) -> dict[str, Tensor]:
    """W_v + delay (W_v - W_(v-1)) per parameter: new leaves (requiring grad where ``current``'s
    do); a frozen parameter, which no update changes, is passed on as it is."""
    out = {}
    for name, weight in current.items():
        if not weight.requires_grad:
            out[name] = weight
            continue
        step = weight - previous[name]
        out[name] = weight.add(step, alpha=delay).requires_grad_(True)
    return out


def stage_delay(plan: Plan, sync: SyncMode, stage: int) -> int:
    """The delay in updates that the corrections of stage ``stage`` act on: the update delay
    of ``schedule.rules.update_delay`` in the per-minibatch modes, 0 in the others."""
    return update_delay(plan, sync, stage) if sync.updates_per_minibatch else 0


def warmup_factor(update: int, steps: int) -> float:
    """The learning rate's factor for the ``update``-th update (from 1) of a warm-up over
    ``steps`` updates: update / steps until it reaches 1 (1 at once when ``steps`` is 0)."""
    return 1.0 if steps <= 0 else min(1.0, update / steps)


def delay_lr_factor(update: int, delay: int, updates: int) -> float:
    """The learning rate's factor for the ``update``-th update (from 1) of a stage ``delay``
    updates stale: 1 / tau ** (1 - min((update - 1) / updates, 1)), tau = max(1, delay), so the
    first update takes lr / tau and the (updates + 1)-th on the base rate (``updates`` 0:
    1 / tau for every update)."""
    tau = max(1, delay)
    if tau == 1:
        return 1.0
    done = 0.0 if updates <= 0 else min(1.0, (update - 1) / updates)
    return 1.0 / tau ** (1.0 - done)


class ScaledUpdate:
    """An ``Update`` (``runtime.update``) that scales the learning rates of the updates it
    runs: the u-th call runs ``update`` with every param group's ``lr`` of ``optimizers()``
    times ``factor(u)``, then puts back the values it found (a learning-rate scheduler sets them
    between updates and keeps doing so). Updates are counted across drains, from the start of
    training. Wrapped in one another, the factors multiply."""

    def __init__(self, update: Update, optimizers: Callable[[], list[Optimizer]]):
        self.update = update
        self.optimizers = optimizers
        self.count = 0  # updates applied

    def factor(self, update: int) -> float:
        raise NotImplementedError

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        self.count += 1
        factor = self.factor(self.count)
        if factor == 1.0:
            return self.update(gradients, storage)
        groups = [g for opt in self.optimizers() for g in opt.param_groups]
        found = [g["lr"] for g in groups]
        for group in groups:
            group["lr"] = group["lr"] * factor
        try:
            return self.update(gradients, storage)
        finally:
            for group, lr in zip(groups, found, strict=True):
                group["lr"] = lr


class WarmedUpdate(ScaledUpdate):
    """A ``ScaledUpdate`` whose learning rates ramp up: ``warmup_factor(u, steps)``."""

    def __init__(self, update: Update, optimizers: Callable[[], list[Optimizer]], steps: int):
        super().__init__(update, optimizers)
        self.steps = steps

    def factor(self, update: int) -> float:
        return warmup_factor(update, self.steps)


class DelayScaledUpdate(ScaledUpdate):
    """A ``ScaledUpdate`` whose learning rates are divided by the stage's delay, annealed to
    the base rate over ``updates`` updates (0: throughout): ``delay_lr_factor``."""

    def __init__(
        self, update: Update, optimizers: Callable[[], list[Optimizer]], delay: int, updates: int
    ):
        super().__init__(update, optimizers)
        self.delay, self.updates = delay, updates

    def factor(self, update: int) -> float:
        return delay_lr_factor(update, self.delay, self.updates)


def corrected_update(
    update: Update,
    optimizers: Callable[[], list[Optimizer]],
    plan: Plan,
    sync: SyncMode,
    stage: int,
    lr_warmup_per_delay: int = 0,
    delay_lr_updates: int | None = None,
) -> Update:
    """``update`` of stage ``stage`` with the learning-rate corrections asked for (checked by
    ``check_corrections``): the warm-up per delay and the learning rate per delay, each wrapped
    around it where on, so their factors multiply; ``update`` itself where neither is."""
    delay = stage_delay(plan, sync, stage)
    if delay_lr_updates is not None:
        update = DelayScaledUpdate(update, optimizers, delay, delay_lr_updates)
    if lr_warmup_per_delay:
        update = WarmedUpdate(update, optimizers, lr_warmup_per_delay * delay)
    return update


def carry_counts(new: Update, old: Update) -> None:
    """Give the ``ScaledUpdate`` wrappers of ``new`` the updates counted by those of ``old``
    (a re-planned pipeline goes on with the same updates applied): wrapper by wrapper, from
    the outermost, while both have one."""
    while isinstance(new, ScaledUpdate) and isinstance(old, ScaledUpdate):
        new.count = old.count
        new, old = new.update, old.update
