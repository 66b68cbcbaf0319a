"""Bad input stops with a message that names the rule, the values and the fix; no hangs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.schedule import SegmentStream
from tests.runtime.launched import Rank, launch
from tests.strategy import failing_script
from tests.strategy.test_lightning_features import Net, loader, trainer

SCRIPT = Path(__file__).with_name("failing_script.py")


def test_balance_that_does_not_cover_the_layers() -> None:
    with pytest.raises(PlanError, match=r"layers: 6, sum of balance: 5\); change balance"):
        Plan.from_balance([3, 2], [str(i) for i in range(6)])


def test_too_few_microbatches_for_2bw() -> None:
    with pytest.raises(ValueError, match="2bw"):
        SegmentStream(Plan.from_balance([1, 1, 1]), "2bw", 2)


@pytest.mark.slow
def test_devices_different_from_the_plan() -> None:
    strategy = PipeDreamStrategy(balance=[2, 2, 2], start_method="fork", timeout=30)
    with pytest.raises(Exception, match=r"plan workers: 3, devices: 2\); use Trainer\(devices=3\)"):
        trainer(devices=2, strategy=strategy).fit(Net(), loader(2))


def _run(fail: str, tmp_path: Path) -> subprocess.CompletedProcess:
    """``failing_script.py`` run as a user runs it (the launcher's report is part of the check)."""
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--fail", fail],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_nan_loss_stops_every_rank_with_one_message(tmp_path: Path) -> None:
    """The NaN of batch 2 travels with the gradients; step 3 logs batch 2's loss (2 stages, 2
    microbatches: one step behind) and both ranks stop there with the same error."""
    result = _run("nan", tmp_path)
    assert result.returncode != 0
    message = (
        "TrainingDiverged: training diverged: the training loss is not finite (loss: nan) "
        "(global step: 3, sync: async, stage delays in updates: [1, 0], optimizer: lr 0.1, "
        "momentum 0.9)"
    )
    ranks, report = result.stderr.split("\npl-pipedream: rank ", 1)
    assert ranks.count(message) == 2  # rank 0's and rank 1's
    assert report.count(message) == 1  # the report repeats the first one's error, last


def forked(tmp_path: Path, *argv: str, timeout: float) -> list[Rank]:
    """``failing_script``'s ``main(argv)`` on 2 ranks forked from this process as a launcher
    starts them (``tests.runtime.launched``), working in ``tmp_path``."""
    folder = tmp_path / "ranks"
    main = failing_script.main
    return launch(2, lambda _: main(list(argv)), folder=folder, timeout=timeout, cwd=tmp_path)


@pytest.mark.slow
def test_nan_loss_unwatched_trains_on_as_on_one_device(tmp_path: Path) -> None:
    ranks = forked(tmp_path, "--fail", "nan", "--divergence", "off", timeout=180)
    assert [rank.code for rank in ranks] == [0, 0], [rank.stderr[-2000:] for rank in ranks]
    assert "not finite" not in "".join(rank.stderr for rank in ranks)


@pytest.mark.slow
def test_a_dead_rank_is_named_by_the_others(tmp_path: Path) -> None:
    """Rank 1 exits in step 2 (``os._exit``): rank 0 stops with an error naming it."""
    start = time.perf_counter()
    ranks = forked(tmp_path, "--fail", "die", timeout=150)
    seconds = time.perf_counter() - start
    error = ranks[0].error
    assert ranks[0].code == 1 and ranks[1].code == 3, [rank.stderr[-2000:] for rank in ranks]
    assert "rank 0 (stage 0) could not" in error
    assert "from rank 1" in error
    assert seconds < 150
