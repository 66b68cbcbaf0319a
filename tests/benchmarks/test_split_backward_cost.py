"""benchmarks/split_backward_cost.py: a tiny run prints both stages' halves beside flush's."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_tiny_run_prints_the_halves_and_their_sum() -> None:
    command = [sys.executable, str(BENCHMARKS / "split_backward_cost.py")]
    command += ["--width", "16", "--rows", "4", "--microbatches", "2", "--batches", "2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    for name in ("last stage", "first stage"):
        line = next(line for line in result.stdout.splitlines() if f"  {name}:" in line)
        numbers = [float(n) for n in re.findall(r"\d+\.\d+", line)]
        assert len(numbers) == 5 and all(n >= 0 for n in numbers), line
        assert abs(numbers[1] + numbers[2] - numbers[3]) <= 0.11, line
