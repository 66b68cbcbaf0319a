"""benchmarks/fault_trials.py: the quick run's verdicts, and how trials are drawn and judged."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import fault_trials
import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_trials_are_drawn_from_the_seed_and_kill_after_the_first_save() -> None:
    first = [fault_trials.pick(random.Random(3), 3) for _ in range(2)]
    assert first[0] == first[1]  # the same seed, the same trial
    trials = [fault_trials.pick(random.Random(s), 3) for s in range(200)]
    assert {t.phase for t in trials} == set(fault_trials.PHASES)
    assert {t.victim for t in trials} == {0, 1, 2}
    for t in trials:
        if t.phase == "train":  # after the first checkpoint (step 5), before the last step
            assert fault_trials.EVERY < t.at < fault_trials.STEPS
        if t.phase == "checkpoint":  # a file of the second save or later: one save is whole
            assert t.at > (4 if t.victim == 0 else 2)


def test_a_trial_passes_only_when_every_check_does() -> None:
    good = fault_trials.Trial(3, 1, "train", 7, killed=True, exit_seconds=1.5, naming=2)
    good.loads = True
    assert good.ok
    for change in (
        {"exit_seconds": None},
        {"naming": 1},  # one of the two survivors does not name rank 1
        {"left_behind": 1},
        {"loads": False},
        {"killed": False},
    ):
        bad = fault_trials.Trial(**{**good.__dict__, **change})
        assert not bad.ok, change


@pytest.mark.slow
@pytest.mark.bench
def test_the_quick_run_kills_in_each_phase_and_every_check_holds(tmp_path: Path) -> None:
    """One SIGKILL in training, in validation and inside a save, on 2 ranks: the survivor exits
    within the timeout naming the dead rank, nothing is left behind, last.ckpt loads.
    A benchmark's quick run: ``pytest --bench`` or ``-m bench`` runs it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / "fault_trials.py"), "--quick"]
    command += ["--out", str(tmp_path), "--timeout", "20"]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=140)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    rows = [line for line in result.stdout.splitlines() if line.startswith("  ") and " | " in line]
    rows = [r for r in rows if r.strip()[0].isdigit()]
    assert [r.split("|")[3].strip() for r in rows] == ["train", "validation", "checkpoint"]
    for line in rows:
        cells = [c.strip() for c in line.split("|")]
        assert float(cells[5]) < 20  # the survivor exited within the timeout
        assert cells[6] == "1/1" and cells[7] == "0" and cells[8].startswith("step ")
    assert "passed every check: 3" in result.stdout


def skip_if_lightning_killed_first(out: Path, rank: int) -> None:
    """Lightning's launcher (rank 0) polls the ranks it started every 5 s and SIGKILLs every
    process once one died: when that comes before ``rank``'s error, there is nothing to check."""
    rank0, log = (out / "rank0.log").read_text(), (out / f"rank{rank}.log").read_text()
    if "Forcefully terminating" in rank0 and "Error" not in log:
        pytest.skip(f"Lightning's launcher killed rank {rank} before it reported")


@pytest.mark.slow
@pytest.mark.bench
def test_the_last_stage_killed_in_validation_is_named_by_the_first(tmp_path: Path) -> None:
    """3 ranks, rank 2 (the last stage) killed at a validation batch: rank 0 waits in the metrics
    broadcast and names rank 2 (it printed gloo's bare "Connection reset by peer" before).
    One trial of the benchmark's harness: ``pytest --bench`` or ``-m bench`` runs it."""
    trial = fault_trials.Trial(3, 2, "validation", 5, batch=1)
    fault_trials.run_trial(trial, tmp_path, timeout=20)
    assert trial.killed and trial.exit_seconds is not None and trial.exit_seconds < 20
    skip_if_lightning_killed_first(tmp_path, 1)
    assert trial.naming == 2, (tmp_path / "rank0.log").read_text()[-3000:]
    assert "could not receive them from rank 2" in (tmp_path / "rank0.log").read_text()
    assert trial.left_behind == 0 and trial.loads


@pytest.mark.slow
@pytest.mark.bench
def test_a_writer_killed_in_a_save_is_named_by_every_other_writer(tmp_path: Path) -> None:
    """3 ranks, rank 2 killed halfway through its shard of a save: rank 0 (the lead) names it and
    passes the error on to rank 1, which named rank 0 before (it waited for the lead's
    outcome); the previous last.ckpt (step 10) loads.
    One trial of the benchmark's harness: ``pytest --bench`` or ``-m bench`` runs it."""
    trial = fault_trials.Trial(3, 2, "checkpoint", 6)
    fault_trials.run_trial(trial, tmp_path, timeout=20)
    assert trial.killed and trial.exit_seconds is not None and trial.exit_seconds < 20
    skip_if_lightning_killed_first(tmp_path, 1)
    assert trial.naming == 2, (tmp_path / "rank1.log").read_text()[-3000:]
    assert "from rank 2" in (tmp_path / "rank1.log").read_text()
    assert trial.left_behind == 0 and trial.loads and trial.checkpoint == "step 10"
