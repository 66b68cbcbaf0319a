"""benchmarks/replan_throughput.py, tiny: the slowed-rank scenario runs off, auto and the static
plans auto used through the engine on two ranks, and prints the table and the verdicts."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import replan_throughput  # noqa: E402


@pytest.mark.slow
def test_the_tiny_benchmark_runs_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    (result,) = replan_throughput.main(["--tiny", "--scenario", "slow-rank", "--sync", "async"])
    assert result["off"] > 0 and result["auto"] > 0 and result["static"] > 0
    assert result["plans"][0] == "0-1|2-3"  # the equal split, then the plans auto moved to
    assert len(result["plans"]) == len(result["moves"]) + 1
    assert result["static"] == max(result["statics"].values())
    out = capsys.readouterr().out
    assert "slow-rank: auto/off" in out and "slow-rank: auto/static" in out
