"""``LossWatch``: the verdict on a logged loss, bad data told apart, warn once then off.
(Every rank alike: tests/core/test_divergence.py's runs and tests/engine/test_pipeline.py.)"""

from __future__ import annotations

import math

import pytest
import torch

from pl_pipedream.core.errors import BadData, TrainingDiverged
from pl_pipedream.core.loss_watch import LossWatch

RULE = (0.9, 3, 5)


def explain(reason: str) -> str:
    return f"explained: {reason}"


def test_off_watches_nothing_and_notes_nothing() -> None:
    watch = LossWatch("off", RULE)
    watch.note(0, torch.tensor([[math.nan]]), 1)
    assert watch.watch is None and watch.judge(math.nan, 0, 5, explain) is None


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ValueError, match="divergence_patience"):
        LossWatch("off", (0.9, 0, 5))


def test_a_non_finite_loss_with_finite_data_is_training_diverged() -> None:
    watch = LossWatch("error", RULE)
    watch.note(0, (torch.ones(2, 3), torch.zeros(2)), 2)
    verdict = watch.judge(math.inf, 0, 7, explain)
    assert verdict is not None and verdict.stop
    assert type(verdict.error) is TrainingDiverged
    assert str(verdict.error).startswith("explained: the training loss is not finite")


def test_a_non_finite_loss_with_nan_in_the_data_is_bad_data() -> None:
    watch = LossWatch("error", RULE)
    assert watch.judge(1.0, None, 0, explain) is None
    watch.note(0, torch.ones(4, 2), 2)
    bad = torch.ones(4, 2)
    bad[3, 1] = math.nan
    watch.note(1, bad, 2)
    verdict = watch.judge(math.nan, 1, 9, explain)
    assert verdict is not None and isinstance(verdict.error, BadData)
    assert "global step: 9, batch of the fit: 1, microbatch: 1" in str(verdict.error)


def test_warn_gives_one_verdict_then_stops_watching() -> None:
    watch = LossWatch("warn", RULE)
    verdict = watch.judge(math.nan, None, 3, explain)
    assert verdict is not None and not verdict.stop
    assert watch.watch is None and watch.judge(math.nan, None, 4, explain) is None
