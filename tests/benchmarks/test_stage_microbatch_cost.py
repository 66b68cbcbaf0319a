"""benchmarks/stage_microbatch_cost.py: a tiny run prints the CPU time per microbatch."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_a_tiny_run_prints_the_cost_per_microbatch() -> None:
    command = [sys.executable, str(BENCHMARKS / "stage_microbatch_cost.py")]
    command += ["--microbatches", "2", "--batches", "3", "--warmup", "1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    found = re.search(r"RESULT (\d+\.\d) us CPU per microbatch", result.stdout)
    assert found is not None and float(found.group(1)) > 0, result.stdout
