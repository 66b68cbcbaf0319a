"""Divergence caught early: the logged training loss watched for a run that has stopped learning.

``DivergenceWatch`` sees the sequence of logged ``train_loss`` values (every rank logs the same
one, so every rank decides the same at the same step without a message) and returns one of two
verdicts:

* the loss is not finite. What the strategy then says depends on the data: the batch's inputs
  and targets are checked on every rank (``core.finite_data``), so a NaN that came with the
  data is reported as bad data, not as training gone wrong.
* the loss has given back its progress: the median of the last ``window`` logged losses lies
  above best + rise x (start - best) for ``patience`` logged losses in a row, where start is the
  median of the first ``window`` losses and best the lowest median of ``window`` consecutive
  ones. Medians, not single losses: with small batches one lucky batch sets a lowest loss that
  the run's typical losses lie far above. The progress counts only when it clears the batch
  noise, ``NOISE_MARGIN`` times the median change between consecutive logged losses over the
  last ``NOISE_STEPS`` (a run on noise that never learns has none to give back); without
  progress, a median that climbs that far and ``MIN_RISE`` x start above the start counts.
  Judged from the ``warmup``-th logged loss on. The defaults separate the measured curves of
  ``benchmarks/convergence.py`` (docs/divergence.md).

What each verdict does is the strategy's option ``divergence`` (``DIVERGENCE_ACTIONS``); the
messages speak of stale weights only in the modes that have them (``SyncMode.stale_weights``).

Pure Python (no torch): the strategy feeds it floats and the optimizer's ``param_groups``.
"""

from __future__ import annotations

import collections
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "DIVERGENCE_ACTIONS",
    "Divergence",
    "DivergenceWatch",
    "bad_data_message",
    "describe_optimizer",
    "divergence_message",
    "stops",
]

# What a verdict does: "error" (the default) stops on a non-finite loss and warns on a loss that
# gave back its progress; "strict" stops on both; "warn" warns on both; "off" watches nothing.
DIVERGENCE_ACTIONS = ("error", "strict", "warn", "off")
NOISE_MARGIN = 4.0  # progress counts once it clears this many median step-to-step changes
NOISE_STEPS = 100  # the changes between the last this many logged losses measure the noise
MIN_RISE = 0.2  # without progress, a climb above the start must also be this share of it


@dataclass(frozen=True)
class Divergence:
    """A verdict: why, and whether the loss is finite (a non-finite one is the severe kind)."""

    reason: str
    finite: bool


def stops(action: str, verdict: Divergence) -> bool:
    """Whether ``divergence=action`` stops the run on ``verdict`` (else it warns once)."""
    return action == "strict" or (action == "error" and not verdict.finite)


class DivergenceWatch:
    """Watches logged losses; ``observe`` returns a ``Divergence`` when the run diverged.

    Args:
        rise: how much of its progress (start - best) the median of the recent losses must
            have given back.
        patience: in how many consecutive logged losses it must have.
        window: the losses each median is taken over.
        warmup: logged losses before the progress is judged (a non-finite loss counts at once).
    """

    def __init__(
        self, rise: float = 0.9, patience: int = 3, window: int = 5, warmup: int = 20
    ) -> None:
        if not (rise > 0 and isinstance(patience, int) and 1 <= patience <= window):
            raise ValueError(
                "divergence_rise must be positive and divergence_patience an integer from 1 to "
                f"divergence_window (divergence_rise: {rise!r}, divergence_patience: "
                f"{patience!r}, divergence_window: {window!r}); for example "
                "divergence_rise=0.9, divergence_patience=3, divergence_window=5"
            )
        self.rise = float(rise)
        self.patience = patience
        self.window = int(window)
        self.warmup = int(warmup)
        self.start: float | None = None  # the median of the first ``window`` losses
        self.best = math.inf  # the lowest median of ``window`` consecutive losses
        self.recent: list[float] = []  # the last ``window`` losses
        self.steps: collections.deque[float] = collections.deque(maxlen=NOISE_STEPS)
        self.observed = 0  # finite losses observed
        self.above = 0  # consecutive logged losses whose median lay above the threshold

    def observe(self, loss: float) -> Divergence | None:
        """Take the next logged loss; a verdict when the run has diverged, else None."""
        if not math.isfinite(loss):
            return Divergence(f"the training loss is not finite (loss: {loss})", finite=False)
        self.observed += 1
        if self.recent:
            self.steps.append(abs(loss - self.recent[-1]))
        self.recent = [*self.recent, loss][-self.window :]
        if len(self.recent) < self.window:
            return None
        median = statistics.median(self.recent)
        if self.start is None:
            self.start = median
        self.best = min(self.best, median)
        threshold = self._threshold()
        self.above = self.above + 1 if median > threshold else 0
        if self.observed < self.warmup or self.above < self.patience:
            return None
        return Divergence(
            f"the median of the last {self.window} logged training losses gave back more than "
            f"{self.rise:g} of the progress made, {self.patience} times in a row (median: "
            f"{median:.4g}, best: {self.best:.4g}, start: {self.start:.4g})",
            finite=True,
        )

    def _threshold(self) -> float:
        assert self.start is not None
        noise = NOISE_MARGIN * statistics.median(self.steps)
        progress = self.start - self.best
        if progress > noise:
            return self.best + self.rise * progress
        return self.start + max(noise, MIN_RISE * abs(self.start))


def describe_optimizer(param_groups: Iterable[Mapping[str, Any]]) -> str:
    """``lr 0.1, momentum 0.9`` from an optimizer's param groups (each distinct group once;
    Adam's ``betas`` stand for its momentum)."""
    seen: list[str] = []
    for group in param_groups:
        parts = [f"lr {group['lr']:g}"] if "lr" in group else []
        if "momentum" in group:
            parts.append(f"momentum {group['momentum']:g}")
        elif "betas" in group:
            parts.append("betas (" + ", ".join(f"{b:g}" for b in group["betas"]) + ")")
        text = ", ".join(parts)
        if text and text not in seen:
            seen.append(text)
    return "; ".join(seen) or "no learning rate found"


def divergence_message(
    reason: str,
    step: int,
    mode: SyncMode,
    delays: Sequence[int],
    optimizer: str,
    front_end: str = "PipeDreamStrategy",
    clipping: str | None = "Trainer(gradient_clip_val=1.0)",
) -> str:
    """What every rank raises or warns (the same text on each): the rule, the values, the
    remedies; stale weights are named only in the modes that have them. ``front_end``: the
    class whose arguments the remedies quote; ``clipping``: the call that clips, if any."""
    values = f"global step: {step}, sync: {mode}"
    remedies = "lower the learning rate or the momentum"
    if not mode.stale_weights:
        cause = (
            f"sync={str(mode)!r} updates as one device does, so one device's training diverges "
            "on this run too"
        )
        if clipping is not None:
            remedies += f", or clip gradients ({clipping})"
    else:
        values += f", stage delays in updates: {list(delays)}"
        cause = "stale weights amplified by a large learning rate or momentum do this"
        if mode.updates_per_minibatch:
            remedies += f", {front_end}(weight_prediction=True)"
        remedies += ', sync="flush" (one device\'s updates)'
        if mode.updates_per_minibatch:
            remedies += ' or sync="2bw" (a delay of 1 batch)'
    return (
        f"training diverged: {reason} ({values}, optimizer: {optimizer}); {cause}: {remedies}; "
        f'{front_end}(divergence="warn"|"off") trains on regardless'
    )


def bad_data_message(loss: float, step: int, batch: int, microbatch: int) -> str:
    """What every rank raises when a non-finite loss came with non-finite data."""
    return (
        f"the training data hold a NaN or inf value, and the training loss is not finite "
        f"(loss: {loss}, global step: {step}, batch of the fit: {batch}, microbatch: "
        f"{microbatch}); the data, not the training, are at fault: find and repair or drop the "
        "examples with non-finite values (e.g. torch.isfinite(x).all() per example in the "
        "Dataset)"
    )
