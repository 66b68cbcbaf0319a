"""benchmarks/checkpoint_cost.py: the layer count for a size, and the quick run's figures."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import checkpoint_cost
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_layer_count_makes_the_asked_size() -> None:
    layers = checkpoint_cost.layer_count(1.0, 4096)
    assert layers == 16
    assert abs(layers * 4 * (4096 * 4096 + 4096) / 2**30 - 1.0) < 0.01
    assert checkpoint_cost.layer_count(1e-9, 64) == 1


def test_sane_needs_every_figure_positive() -> None:
    row = {"save_s": 1.0, "save_peak": 1, "resume_first_step_s": 2.0, "resume_peak": 1}
    row["resume_setup_s"] = 1.5
    assert checkpoint_cost.sane([{**row, "checkpoint_bytes": 10}])
    assert not checkpoint_cost.sane([{**row, "checkpoint_bytes": 0}])
    assert not checkpoint_cost.sane([])


@pytest.mark.slow
@pytest.mark.bench
def test_the_quick_run_prints_every_ranks_figures(tmp_path: Path) -> None:
    """8 x Linear(256) on 2 ranks: a save and a resume, each rank's time and peak memory,
    and the checkpoint on disk at least as large as the weights it holds."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / "checkpoint_cost.py"), "--quick"]
    command += ["--out", str(tmp_path)]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "8 x Linear(256), 2 MiB of weights, sgd, flush, [2] ranks" in result.stdout
    rows = json.loads((tmp_path / "checkpoint_cost.json").read_text())
    assert [(r["ranks"], r["rank"], r["stage"]) for r in rows] == [(2, 0, 0), (2, 1, 1)]
    weights = 8 * 4 * (256 * 256 + 256)
    for row in rows:
        assert weights <= row["checkpoint_bytes"] < weights + 2**20
        assert 0 < row["save_s"] < 60 and 0 < row["resume_first_step_s"] < 120
        assert 0 < row["resume_setup_s"] <= row["resume_first_step_s"]
        assert 2**20 < row["save_peak"] < 4 * 2**30 and 2**20 < row["resume_peak"] < 4 * 2**30
        assert f"2 | {row['rank']} | {row['stage']} | 2 | " in result.stdout
    assert not (tmp_path / "n2" / "run.ckpt").exists()  # removed without --keep
