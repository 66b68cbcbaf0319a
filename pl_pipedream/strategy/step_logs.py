"""What ``training_step`` logs reaches every rank, as one device would log it.

The user's ``training_step`` runs on the last stage only, once per microbatch, while rank 0 owns
the loggers and the progress bar, and callbacks monitor metrics on every rank. So on the last
stage ``self.log`` (and ``self.log_dict``) inside ``training_step`` is captured, not logged
(``StepLogCapture``); each value becomes a number keyed by its name and options, which rides back
with the microbatch's loss in the gradient messages (``runtime.losses``), the path
``train_loss`` takes, so no collective runs per step. Every rank then logs a batch's values in
the step where that batch's loss first reaches it (``log_finished``), with the options the
user gave.

A batch's value is its microbatches' values reduced by the metric's own ``reduce_fx``: the mean
(weighted by ``batch_size`` when the user gave it, which then logs their sum), the sum, the
maximum or the minimum. A metric that is a mean, sum, maximum or minimum over the batch's samples
therefore gets one device's value. ``sync_dist`` needs no collective (every rank already logs
the same value), and ``torchmetrics.Metric`` objects are refused: their state lives on the last
stage (log the tensor the metric returns instead).

The strategy logs each batch's mean loss as ``train_loss`` (``LOSS_NAME``). A ``training_step``
that logs ``train_loss`` itself keeps the name (``LossName``): the strategy then logs nothing
under it, so Lightning holds the user's value with the user's options, as on one device.
"""

from __future__ import annotations

import json
import numbers
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import Tensor, nn

from pl_pipedream.runtime.losses import Logged
from pl_pipedream.runtime.streams import HostValue, read_later
from pl_pipedream.strategy import lightning_patches

__all__ = ["LOSS_NAME", "LossName", "StepLogCapture", "combine", "log_finished"]

LOSS_NAME = "train_loss"  # what the strategy logs each batch's loss as
_LOSS_KEY = json.dumps([LOSS_NAME])[:-1]  # how a captured key of that name begins

_REDUCTIONS = {
    "mean": "mean",
    "avg": "mean",
    "sum": "sum",
    "max": "max",
    "min": "min",
    torch.mean: "mean",
    torch.sum: "sum",
    sum: "sum",
    torch.max: "max",
    max: "max",
    torch.min: "min",
    min: "min",
}


class StepLogCapture:
    """What ``training_step`` logged on each microbatch of one batch, as (key, value) pairs; a
    key is the JSON of ``[name, prog_bar, logger, on_step, on_epoch, reduce_fx, batch_size]``."""

    def __init__(self) -> None:
        self._logged: dict[int, dict[str, tuple[str, float | HostValue]]] = {}

    def capture(self, module: nn.Module, j: int) -> AbstractContextManager[None]:
        """Capture the ``self.log`` calls of ``module`` as microbatch ``j``'s, for the duration."""
        logged = self._logged.setdefault(j, {})

        def log(
            name: str,
            value: Any,
            prog_bar: bool = False,
            logger: bool | None = None,
            on_step: bool | None = None,
            on_epoch: bool | None = None,
            reduce_fx: Any = "mean",
            enable_graph: bool = False,
            sync_dist: bool = False,
            sync_dist_group: Any = None,
            add_dataloader_idx: bool = True,
            batch_size: int | None = None,
            metric_attribute: str | None = None,
            rank_zero_only: bool = False,
        ) -> None:
            options = [prog_bar, logger, on_step, on_epoch, _reduction(name, reduce_fx)]
            key = json.dumps([name, *options, batch_size])
            logged[name] = (key, _number(name, value))  # a name logged twice: the last counts

        return lightning_patches.capture_logs(module, log)

    def logged(self, j: int) -> tuple[tuple[str, float | HostValue], ...]:
        """What microbatch ``j`` logged (handed over once)."""
        return tuple(self._logged.pop(j, {}).values())


class LossName:
    """Whether the strategy logs a batch's loss as ``train_loss`` in this fit: until
    ``training_step`` is seen logging that name itself. Lightning refuses one name logged with
    two sets of options, so the user's first value must come before the strategy logged its own:
    from the first batch that finishes."""

    def __init__(self) -> None:
        self.users = False  # training_step logs train_loss itself
        self._logged = False  # the strategy has logged its own in this fit

    def strategy_logs(self, batches: list[tuple[Logged, ...]], step: int) -> bool:
        """Whether the strategy logs this step's loss, given what ``training_step`` logged for
        the batches that finished (``log_finished``'s ``batches``) at global step ``step``."""
        if not self.users and any(
            key.startswith(_LOSS_KEY)
            for microbatches in batches
            for logged in microbatches
            for key, _ in logged
        ):
            if self._logged:
                raise ValueError(
                    f"PipeDreamStrategy logs each batch's loss as {LOSS_NAME} unless "
                    f"training_step logs that name itself from the first batch on (name: "
                    f"{LOSS_NAME}, first logged by training_step at step: {step}); log it at "
                    f"every training step, or under another name, e.g. "
                    f"self.log('my_{LOSS_NAME}', loss)"
                )
            self.users = True
        self._logged = self._logged or not self.users
        return not self.users


def _reduction(name: str, reduce_fx: Any) -> str:
    key = reduce_fx.lower() if isinstance(reduce_fx, str) else reduce_fx
    try:
        return _REDUCTIONS[key]
    except (KeyError, TypeError):
        raise ValueError(
            f"self.log(..., reduce_fx=...) takes min, max, mean or sum (name: {name}, "
            f"reduce_fx: {reduce_fx!r}); log a tensor per batch and reduce it yourself"
        ) from None


def _number(name: str, value: Any) -> float | HostValue:
    if isinstance(value, Tensor):
        if value.numel() != 1:
            raise ValueError(
                f"self.log in training_step takes a one-element tensor (name: {name}, shape: "
                f"{tuple(value.shape)}); log value.mean() or one element"
            )
        return read_later(value.detach().reshape(()))
    if isinstance(value, numbers.Number) and not isinstance(value, complex):
        return float(value)  # type: ignore[arg-type]
    kind = type(value).__name__
    fix = (
        "log the tensor the metric returns, self.log(name, self.metric(preds, target)), which "
        "on_epoch=True averages over the epoch's batches"
        if hasattr(value, "compute") and hasattr(value, "update")
        else "log a number or a one-element tensor"
    )
    raise ValueError(
        "under PipeDreamStrategy, self.log in training_step takes numbers and tensors: the "
        f"step runs on the last stage only and its value travels to every rank (name: {name}, "
        f"value: {kind}); {fix}"
    )


def combine(microbatches: tuple[Logged, ...]) -> dict[str, tuple[float, dict[str, Any]]]:
    """One batch's value per name, with the options to log it (``module.log``'s keywords),
    from what each of its microbatches logged, in the order the names were first logged."""
    gathered: dict[str, list[tuple[list[Any], float]]] = {}
    for logged in microbatches:
        for key, value in logged:
            name, *options = json.loads(key)
            gathered.setdefault(name, []).append((options, value))
    return {name: _reduce(name, entries) for name, entries in gathered.items()}


def _reduce(name: str, entries: list[tuple[list[Any], float]]) -> tuple[float, dict[str, Any]]:
    prog_bar, logger, on_step, on_epoch, reduce_fx, _ = entries[0][0]
    if any(options[:5] != entries[0][0][:5] for options, _ in entries):
        raise ValueError(
            f"training_step logs a name with the same options on every microbatch (name: "
            f"{name}, options: {sorted({str(o[:5]) for o, _ in entries})}); pass the same "
            "prog_bar, logger, on_step, on_epoch and reduce_fx each time"
        )
    values = [value for _, value in entries]
    sizes = [options[5] for options, _ in entries]
    batch_size = sum(sizes) if all(size is not None for size in sizes) else None
    if reduce_fx == "mean" and batch_size:
        value = sum(v * s for v, s in zip(values, sizes, strict=True)) / batch_size
    elif reduce_fx == "mean":
        value = sum(values) / len(values)
    elif reduce_fx == "sum":
        value = sum(values)
    else:
        value = max(values) if reduce_fx == "max" else min(values)
    options = {
        "prog_bar": prog_bar,
        "logger": logger,
        "on_step": on_step,
        "on_epoch": on_epoch,
        "reduce_fx": reduce_fx,
        "batch_size": batch_size,
    }
    return value, options


def log_finished(module: Any, batches: list[tuple[Logged, ...]], device: torch.device) -> None:
    """Log, on this rank, what ``training_step`` logged for each of ``batches`` (one entry per
    microbatch each), batch after batch (``combine``)."""
    for microbatches in batches:
        if not any(microbatches):
            continue
        for name, (value, options) in combine(microbatches).items():
            module.log(name, torch.tensor(value, device=device), **options)
