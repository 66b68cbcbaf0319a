"""strategy.step_logs: what training_step logs, captured per microbatch and reduced per batch."""

from __future__ import annotations

import json

import pytest
import torch
from lightning.pytorch import LightningModule
from torchmetrics.classification import BinaryAccuracy

from pl_pipedream.strategy.step_logs import LossName, StepLogCapture, combine


class Logs(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.acc = BinaryAccuracy()


def captured(calls) -> tuple:  # type: ignore[no-untyped-def]
    """What one microbatch logged when ``calls(module)`` ran inside the capture."""
    module, capture = Logs(), StepLogCapture()
    with capture.capture(module, 0):
        calls(module)
    assert "log" not in module.__dict__  # LightningModule.log is back
    return capture.logged(0)


def key(name: str, **options) -> str:  # type: ignore[no-untyped-def]
    settings = {"prog_bar": False, "logger": None, "on_step": None, "on_epoch": None}
    settings |= {"reduce_fx": "mean", "batch_size": None} | options
    return json.dumps([name, *settings.values()])


def test_log_and_log_dict_are_captured_with_their_options_not_logged() -> None:
    def calls(module: Logs) -> None:
        module.log("a", torch.tensor([0.5]), prog_bar=True, on_epoch=True, reduce_fx=torch.max)
        module.log_dict({"b": 2, "c": torch.tensor(3.0)}, logger=False, batch_size=4)
        module.log("a", torch.tensor(0.75), prog_bar=True, on_epoch=True, reduce_fx="MAX")

    assert captured(calls) == (
        (key("a", prog_bar=True, on_epoch=True, reduce_fx="max"), 0.75),  # the last call counts
        (key("b", logger=False, batch_size=4), 2.0),
        (key("c", logger=False, batch_size=4), 3.0),
    )


@pytest.mark.parametrize(
    ("value", "reduce_fx", "match"),
    [
        ("metric", "mean", "log the tensor the metric returns"),
        (torch.ones(2), "mean", r"one-element tensor \(name: x, shape: \(2,\)\)"),
        ("text", "mean", "value: str"),
        (1.0, torch.median, "takes min, max, mean or sum"),
    ],
)
def test_what_cannot_travel_is_refused_naming_the_fix(value, reduce_fx, match) -> None:  # type: ignore[no-untyped-def]
    def calls(module: Logs) -> None:
        module.log("x", module.acc if value == "metric" else value, reduce_fx=reduce_fx)

    with pytest.raises(ValueError, match=match):
        captured(calls)


def test_a_batch_reduces_its_microbatches_with_the_metrics_own_reduce_fx() -> None:
    microbatches = (
        ((key("m"), 1.0), (key("s", reduce_fx="sum"), 2.0), (key("w", batch_size=1), 1.0)),
        ((key("m"), 2.0), (key("s", reduce_fx="sum"), 3.0), (key("w", batch_size=3), 5.0)),
        ((key("m"), 6.0), (key("hi", reduce_fx="max"), 7.0), (key("lo", reduce_fx="min"), 7.0)),
        ((key("hi", reduce_fx="max"), 5.0), (key("lo", reduce_fx="min"), 5.0)),
    )
    got = {name: value for name, (value, _) in combine(microbatches).items()}
    # the mean over the microbatches that logged it; weighted by batch_size where given
    assert got == {"m": 3.0, "s": 5.0, "w": 4.0, "hi": 7.0, "lo": 5.0}
    options = {name: opts for name, (_, opts) in combine(microbatches).items()}
    assert options["w"]["batch_size"] == 4 and options["m"]["batch_size"] is None
    assert list(got) == ["m", "s", "w", "hi", "lo"]  # the order the names were first logged


def test_a_name_logged_with_other_options_on_another_microbatch_is_refused() -> None:
    microbatches = (((key("m"), 1.0),), ((key("m", prog_bar=True), 2.0),))
    with pytest.raises(ValueError, match=r"same options on every microbatch \(name: m"):
        combine(microbatches)


def test_the_strategy_leaves_train_loss_to_a_training_step_that_logs_it() -> None:
    theirs = [(captured(lambda m: m.log("train_loss", 2.0)),)]
    others = [(captured(lambda m: m.log("train_loss_x", 1.0)),)]
    name = LossName()
    assert name.strategy_logs(theirs, 0) is False  # the user's first value comes first
    assert name.strategy_logs([], 1) is False  # and the name stays theirs
    mine = LossName()
    assert [mine.strategy_logs(others, step) for step in range(3)] == [True] * 3


def test_a_train_loss_logged_only_after_the_strategys_is_refused_naming_the_fix() -> None:
    name = LossName()
    assert name.strategy_logs([], 0)
    late = [(captured(lambda m: m.log("train_loss", 2.0)),)]
    with pytest.raises(ValueError, match=r"first logged by training_step at step: 3\); log it"):
        name.strategy_logs(late, 3)
