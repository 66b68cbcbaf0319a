"""Divergence caught early: the logged training loss watched for a run that has stopped learning.

A stale-weight mode (``async``, ``vertical_sync``, ``2bw``) with a large learning rate and momentum
can blow up where one device trains: its gradients come from weights up to p - 1 updates old and
momentum amplifies the error, so the loss jumps far above the best it reached and the run sits at
chance accuracy for as long as it is allowed to. ``DivergenceWatch`` sees the sequence of logged
``train_loss`` values (every rank logs the same one, so every rank decides the same at the same
step without a message) and reports a divergence when a value is not finite, or when ``patience``
of the last ``window`` values have given back more than ``rise`` of the progress made: they lie
above lowest + rise x (first - lowest), the progress counted as at least ``MIN_PROGRESS`` x first
(so a run that climbs from its first step is caught too, and a flat noisy start is not). A lone
spike passes; a loss that keeps jumping back up does not. The rise is judged from the ``warmup``-th
logged loss on (20 by default): a handful of small batches says little, and their losses can
differ by more than the first one's progress. Measuring against the run's own
progress makes the rule independent of the loss's scale and of how low a healthy run goes; the
defaults separate the measured curves of ``benchmarks/convergence.py`` (README, "Statistical
efficiency").

Pure Python (no torch): the strategy feeds it floats and the optimizer's ``param_groups``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "DIVERGENCE_ACTIONS",
    "DivergenceWatch",
    "TrainingDiverged",
    "describe_optimizer",
    "divergence_message",
]

DIVERGENCE_ACTIONS = ("error", "warn", "off")
MIN_PROGRESS = 0.2  # the progress a rise is measured against is at least this share of the first


class TrainingDiverged(RuntimeError):
    """The training loss diverged (raised on every rank at the same step, with one message)."""


class DivergenceWatch:
    """Watches logged losses; ``observe`` returns why the run diverged, or None.

    Args:
        rise: how far above the lowest loss so far a loss must lie, as a share of the progress
            made (the first loss minus the lowest, at least ``MIN_PROGRESS`` x the first).
        patience: how many of the last ``window`` logged losses must lie that far up.
        window: the logged losses looked at (``patience <= window``).
        warmup: logged losses before the rise is judged (a non-finite loss counts at once).
    """

    def __init__(
        self, rise: float = 0.9, patience: int = 3, window: int = 5, warmup: int = 20
    ) -> None:
        if not (rise > 0 and isinstance(patience, int) and 1 <= patience <= window):
            raise ValueError(
                "divergence_rise must be positive and divergence_patience an integer from 1 to "
                f"divergence_window (divergence_rise: {rise!r}, divergence_patience: "
                f"{patience!r}, divergence_window: {window!r}); for example "
                "PipeDreamStrategy(divergence_rise=0.9, divergence_patience=3, "
                "divergence_window=5)"
            )
        self.rise = float(rise)
        self.patience = patience
        self.window = int(window)
        self.warmup = int(warmup)
        self.first: float | None = None
        self.lowest = math.inf
        self.recent: list[bool] = []  # the last ``window`` losses: above the threshold or not
        self.steps = 0  # losses observed

    def observe(self, loss: float) -> str | None:
        """Take the next logged loss; the reason when the run has diverged, else None."""
        self.steps += 1
        if not math.isfinite(loss):
            return f"the training loss is not finite (loss: {loss})"
        if self.first is None:
            self.first = loss
        self.lowest = min(self.lowest, loss)
        progress = max(self.first - self.lowest, MIN_PROGRESS * abs(self.first))
        threshold = self.lowest + self.rise * progress
        self.recent = [*self.recent, loss > threshold][-self.window :]
        if self.steps < self.warmup or sum(self.recent) < self.patience:
            return None
        return (
            f"{sum(self.recent)} of the last {len(self.recent)} logged training losses gave back "
            f"more than {self.rise:g} of the progress made (loss: {loss:.4g}, lowest: "
            f"{self.lowest:.4g}, first: {self.first:.4g})"
        )


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
) -> str:
    """The error every rank raises (the same text on each): the rule, the values, the remedies."""
    remedies = "lower the learning rate or the momentum"
    if mode in (SyncMode.ASYNC, SyncMode.VERTICAL_SYNC):
        remedies += ", PipeDreamStrategy(weight_prediction=True)"
    if mode is not SyncMode.FLUSH:
        remedies += ', sync="flush" (one device\'s updates)'
    if mode in (SyncMode.ASYNC, SyncMode.VERTICAL_SYNC):
        remedies += ' or sync="2bw" (a delay of 1 batch)'
    return (
        f"training diverged: {reason} (global step: {step}, sync: {mode}, stage delays in "
        f"updates: {list(delays)}, optimizer: {optimizer}); stale weights amplified by a large "
        f"learning rate or momentum do this: {remedies}, or "
        'PipeDreamStrategy(divergence="warn"|"off") to go on'
    )
