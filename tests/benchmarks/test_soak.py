"""benchmarks/soak.py: the quick run's verdicts, and the flatness rule on made-up series."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

import pytest
import soak

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_slope_is_per_step_least_squares() -> None:
    assert soak.slope([0, 1, 2, 3], [5, 7, 9, 11]) == pytest.approx(2.0)
    assert soak.slope([0, 1, 2, 3], [1, 3, 1, 3]) == pytest.approx(0.4)


def test_a_growing_series_is_not_flat_and_a_plateau_is() -> None:
    steps = list(range(0, 2000, 20))
    plateau = [100e6 + min(s, 300) * 1e4 for s in steps]  # warms up, then stays
    growing = [100e6 + s * 2e3 for s in steps]  # 2 KB a step: 2 MB over the second half
    per_100, spread, flat = soak.verdict("rss", steps, plateau)
    assert (per_100, spread, flat) == (0.0, 0.0, True)
    per_100, spread, flat = soak.verdict("rss", steps, growing)
    assert per_100 == pytest.approx(2e5) and spread == pytest.approx(980 * 2e3) and not flat
    fds = [40 + (s > 1500) for s in steps]  # one more descriptor late in the run
    assert not soak.verdict("fds", steps, fds)[2]
    assert soak.verdict("stash", steps, [4096 * (s % 40 == 0) for s in steps])[2]


@pytest.mark.slow
@pytest.mark.bench
def test_the_quick_soak_is_flat(tmp_path: Path) -> None:
    """400 async steps on 2 ranks with validation and checkpoints every 40: every rank's
    resident memory, stash, file descriptors and threads are flat over the second half.
    A benchmark's quick run: ``pytest --bench`` or ``-m bench`` runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / "soak.py"), "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "every series flat after warm-up: yes" in result.stdout
    with (tmp_path / "soak.csv").open() as file:
        rows = list(csv.DictReader(file))
    assert {r["rank"] for r in rows} == {"0", "1"}
    assert max(int(r["step"]) for r in rows) == 400
    assert max(int(r["stash"]) for r in rows if r["rank"] == "0") > 0  # async stashes on stage 0
    assert (tmp_path / "soak.png").stat().st_size > 5000
