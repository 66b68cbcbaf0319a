"""benchmarks/linear_sums_threshold.py: a tiny run prints a row per width."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_tiny_run_prints_each_width_with_both_costs() -> None:
    command = [sys.executable, str(BENCHMARKS / "linear_sums_threshold.py")]
    command += ["--widths", "8", "16", "--microbatches", "2", "--repeats", "4"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("  width")]
    assert [int(re.findall(r"\d+", row)[0]) for row in rows] == [8, 16]
    for row in rows:
        plain, fused, difference, add = (float(n) for n in re.findall(r"[-+]?\d+\.\d+", row))
        assert plain > 0 and fused > 0 and add > 0, row
        assert abs(fused - plain - difference) <= 0.11, row
