"""Corrections for stale weights in the per-minibatch modes (docs/guide.md, "The sync modes").

In ``async`` and ``vertical_sync`` a stage runs minibatch i on weights d updates older than the
ones a synchronous run would use (d: the minibatch's delay at that stage). Two corrections act on
that delay, each optional and each exact against the rule it implements:

* **Weight prediction** (``predict``): the forward and backward passes of the minibatch run on
  W_v + d (W_v - W_(v-1)), an extrapolation of the last update d updates ahead, instead of W_v.
  Only the previous weight version is needed, so it works with any optimizer; for SGD with
  momentum it is W_v - d lr buf_v. The gradient still updates the latest weights.
* **Learning-rate warm-up per delay** (``WarmedUpdate``): the u-th update of a stage whose delay
  is d_s uses the learning rate times min(1, u / K_s), K_s = ``per_delay`` * d_s, so the stages
  with the stalest gradients take the smallest first steps and all reach the base rate after
  their own K_s updates (a stage without delay, or ``per_delay`` 0, is not warmed up).

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
    "WarmedUpdate",
    "check_corrections",
    "delay_of",
    "predict",
    "stage_delay",
    "warmup_factor",
]


def check_corrections(
    sync: SyncMode, weight_prediction: bool, lr_warmup_per_delay: int, ties: Sequence[str] = ()
) -> None:
    """Raise where a correction is asked for but its rule does not apply: outside the
    per-minibatch modes (no stage runs on stale weights between updates in ``flush`` and
    ``gpipe``; ``2bw``'s one version of delay is not this rule), and with tied parameters
    (``ties``: each described), whose versions of their own the rule does not cover."""
    if not isinstance(lr_warmup_per_delay, int) or lr_warmup_per_delay < 0:
        raise ValueError(
            f"lr_warmup_per_delay must be a non-negative integer (lr_warmup_per_delay: "
            f"{lr_warmup_per_delay!r}); pass 0 to turn the warm-up off"
        )
    asked = [
        name
        for name, on in (
            ("weight_prediction=True", weight_prediction),
            (f"lr_warmup_per_delay={lr_warmup_per_delay}", lr_warmup_per_delay != 0),
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


class WarmedUpdate:
    """An ``Update`` (``runtime.update``) whose learning rates ramp up: the u-th call runs
    ``update`` with every param group's ``lr`` of ``optimizers()`` times
    ``warmup_factor(u, steps)``, then puts back the values it found (a learning-rate scheduler
    sets them between updates and keeps doing so). Updates are counted across drains, from the
    start of training."""

    def __init__(self, update: Update, optimizers: Callable[[], list[Optimizer]], steps: int):
        self.update = update
        self.optimizers = optimizers
        self.steps = steps
        self.count = 0  # updates applied

    def __call__(self, gradients: dict[str, Tensor], storage: dict[str, Tensor]) -> int:
        self.count += 1
        factor = warmup_factor(self.count, self.steps)
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
