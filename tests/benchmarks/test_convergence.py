"""benchmarks/convergence.py: the quick run end to end, and its time-to-accuracy arithmetic."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import convergence
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_epochs_to_a_target() -> None:
    assert convergence.epochs_to([0.1, 0.5, 0.8, 0.7], 0.75) == 3
    assert convergence.epochs_to([0.1, 0.5], 0.75) is None


def test_the_default_rule_warns_on_a_blow_up_stops_on_nan_and_passes_a_descent() -> None:
    nan = float("nan")
    descent = [2.3 - 0.065 * i for i in range(21)]  # 2.3 down to 1.0, past the warm-up
    # the median of 5 above 1.13 + 0.9 * (2.17 - 1.13) = 2.07 from the 3rd high loss on, 3 times
    blow_up = [nan, nan, *descent, 4.0, 5.0, 3.0, 2.3, 2.5]
    assert convergence.flagged_at(blow_up) == (2 + 21 + 4, False)  # warns
    assert convergence.flagged_at([nan, *descent, 1.5, 0.9, 1.6, 0.8]) is None
    assert convergence.flagged_at([nan, *descent, nan]) == (1 + 21, True)  # stops


@pytest.mark.slow
@pytest.mark.bench
def test_the_quick_run_writes_curves_png_and_table(tmp_path: Path) -> None:
    """Issue 13's newcomer for 2 epochs: one device and flush learn, async does not (and the
    default divergence rule warns on it; the benchmark runs with divergence="warn").
    A benchmark's quick run: ``pytest --bench`` or ``-m bench`` runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable,
        str(BENCHMARKS / "convergence.py"),
        "--quick",
        "--out",
        str(tmp_path),
    ]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=150)
    assert result.returncode == 0, result.stderr[-3000:]
    # divergence="warn": the async run warned once (rank 0) and trained on to the end
    assert result.stderr.count("UserWarning: training diverged: ") == 1
    with (tmp_path / "convergence.csv").open() as file:
        rows = list(csv.DictReader(file))
    final = {r["config"]: float(r["val_acc"]) for r in rows if r["epoch"] == "2"}
    assert set(final) == {"one device", "async", "flush"}
    assert abs(final["flush"] - final["one device"]) < 1e-3  # flush equals one device
    assert final["async"] < final["one device"] - 0.2
    assert (tmp_path / "convergence.png").stat().st_size > 5000
    line = next(x for x in result.stdout.splitlines() if x.startswith("digits-3st-lr0.1-m0.9"))
    cells = [c.strip() for c in line.split("|")]
    assert cells[2].startswith("1 (") or cells[2].startswith("2 (")  # one device reaches it
    assert cells[3].startswith("- (") and "~" in cells[3]  # async never; warned
