"""The divergence rule on loss sequences, the message, and (slow) the rule inside real runs."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.strategy.divergence import (
    DivergenceWatch,
    describe_optimizer,
    divergence_message,
)

SCRIPT = Path(__file__).with_name("divergence_script.py")


def first_report(losses: list[float], **rule: float) -> int | None:
    """The 0-based index of the loss at which the watch reports, None if it never does
    (judging from the first loss on unless ``warmup`` is given)."""
    watch = DivergenceWatch(**{"warmup": 0, **rule})  # type: ignore[arg-type]
    return next((i for i, loss in enumerate(losses) if watch.observe(loss)), None)


def test_a_healthy_noisy_descent_is_never_reported() -> None:
    # from 2.3 down to ~0.05, with batch-to-batch spikes of up to +0.9 (one step each)
    losses = [2.3 * 0.97**i + (0.9 if i % 17 == 0 else 0.0) for i in range(600)]
    assert first_report(losses) is None


def test_a_rise_that_stays_is_reported_after_patience_steps() -> None:
    losses = [2.3, 2.0, 1.5, 1.0] + [2.2] * 10  # above 1.0 + 0.5 * (2.3 - 1.0) = 1.65
    assert first_report(losses, rise=0.5, patience=5, window=5) == 4 + 4


def test_a_rise_below_the_threshold_is_not_reported() -> None:
    losses = [2.3, 2.0, 1.5, 1.0] + [1.6] * 50  # 1.6 < 1.65
    assert first_report(losses, rise=0.5, patience=5, window=5) is None


def test_a_run_stuck_at_chance_after_a_blow_up_is_reported() -> None:
    # the newcomer's shape: a quick drop, then a jump, then chance level (log 10 = 2.30);
    # defaults: 3 of 5 above 0.7 + 0.9 * (2.31 - 0.7) = 2.149
    losses = [2.31, 2.1, 1.4, 0.9, 0.7, 6.0, 14.0, 3.1, 2.4] + [2.30] * 20
    assert first_report(losses) == 7


def test_spikes_that_keep_coming_back_are_reported_and_rare_ones_are_not() -> None:
    up, down = 3.0, 1.0
    every_other = [2.0, 1.0] + [up, down] * 10
    assert first_report(every_other, rise=0.5, patience=3, window=5) == 6
    every_third = [2.0, 1.0] + [up, down, down] * 10  # at most 2 of any 5
    assert first_report(every_third, rise=0.5, patience=3, window=5) is None


def test_a_climb_from_the_start_is_reported_and_a_flat_start_is_not() -> None:
    # no progress yet: measured against 0.2 x the first loss (2.3 + 0.9 * 0.46 = 2.714)
    assert first_report([2.3, 2.3, 5.0, 5.0, 5.0]) == 4
    assert first_report([2.30, 2.31, 2.29, 2.32, 2.60, 2.62, 2.28, 2.65] * 5) is None


def test_the_rise_is_judged_only_after_the_warmup() -> None:
    losses = [2.3, 1.0] + [2.3] * 30
    assert first_report(losses) == 4
    assert first_report(losses, warmup=20) == 19  # the 20th logged loss
    assert first_report([2.3, 1.0, 2.3, 2.3, 2.3], warmup=20) is None  # a short noisy run


@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_a_non_finite_loss_is_reported_at_once(value: float) -> None:
    watch = DivergenceWatch()
    assert watch.observe(2.3) is None
    assert watch.observe(value) == f"the training loss is not finite (loss: {value})"


def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(
        ValueError, match=r"divergence_patience: 0, divergence_window: 5\); for example"
    ):
        DivergenceWatch(rise=0.5, patience=0)
    with pytest.raises(ValueError, match=r"divergence_patience: 6, divergence_window: 5"):
        DivergenceWatch(patience=6, window=5)
    with pytest.raises(ValueError, match=r"divergence_rise: -1"):
        DivergenceWatch(rise=-1)


def test_the_optimizer_is_described_from_its_param_groups() -> None:
    sgd = [{"lr": 0.1, "momentum": 0.9}, {"lr": 0.1, "momentum": 0.9}]
    assert describe_optimizer(sgd) == "lr 0.1, momentum 0.9"
    assert (
        describe_optimizer([{"lr": 3e-3, "betas": (0.9, 0.999)}]) == "lr 0.003, betas (0.9, 0.999)"
    )


def test_the_message_names_mode_delays_optimizer_and_remedies() -> None:
    text = divergence_message("why", 12, SyncMode.ASYNC, [2, 1, 0], "lr 0.1, momentum 0.9")
    for part in (
        "training diverged: why (global step: 12, sync: async",
        "stage delays in updates: [2, 1, 0], optimizer: lr 0.1, momentum 0.9)",
        "lower the learning rate",
        "weight_prediction=True",
        'sync="flush"',
        'sync="2bw"',
    ):
        assert part in text


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(SCRIPT), *args]
    return subprocess.run(
        command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=150
    )


@pytest.mark.slow
def test_the_newcomers_run_stops_on_every_rank_in_its_first_epoch(tmp_path: Path) -> None:
    """Issue 13: digits MLP, 3 stages, SGD lr 0.1 momentum 0.9, batch 32, async, defaults."""
    result = run(tmp_path, "--sync", "async", "--momentum", "0.9", "--epochs", "1")
    assert result.returncode != 0
    expected = "sync: async, stage delays in updates: [2, 1, 0], optimizer: lr 0.1, momentum 0.9); "
    # the one message, raised by each of the 3 ranks (rank 0 here, the others re-run the script)
    assert result.stderr.count("TrainingDiverged: training diverged: ") == 3, result.stderr[-3000:]
    assert result.stderr.count(expected) == 3
    assert "weight_prediction=True" in result.stderr
    assert 'sync="2bw"' in result.stderr
    assert "Connection closed by peer" not in result.stderr
    assert not (tmp_path / "finished").exists()


@pytest.mark.slow
def test_a_healthy_run_is_not_stopped(tmp_path: Path) -> None:
    """The same model and lr with momentum 0 learns, as one device does: no report."""
    result = run(tmp_path, "--sync", "async", "--momentum", "0.0", "--epochs", "2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "training diverged" not in result.stderr
    assert float((tmp_path / "finished").read_text()) > 0.7  # val_acc (one device: 0.80)
