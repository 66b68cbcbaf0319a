"""benchmarks/replan_throughput.py, tiny: the slowed-rank scenario runs off, auto and the static
plans auto used through the engine on two ranks, one round, and prints the table, where auto's
seconds went, and the verdicts."""

from __future__ import annotations

import pytest
import replan_throughput


@pytest.mark.slow
def test_the_tiny_benchmark_runs_every_variant(capsys: pytest.CaptureFixture[str]) -> None:
    (result,) = replan_throughput.main(["--tiny", "--scenario", "slow-rank", "--sync", "async"])
    assert result["off"] > 0 and result["auto"] > 0 and result["static"] > 0
    (plans,) = result["plans"]  # one round: the equal split, then the plans auto moved to
    assert plans[0] == "0-1|2-3"
    assert len(plans) == len(result["moves"][0]) + 1
    assert result["static"] == max(result["statics"].values())
    assert all(len(values) == 1 for values in result["runs"].values())
    assert set(result["segments"][0]) >= {"before", "until_move", "moves", "after"}
    out = capsys.readouterr().out
    assert "slow-rank: auto/off" in out and "slow-rank: auto/static" in out
