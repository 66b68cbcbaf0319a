"""benchmarks/torch_schedules.py: where torch's stages sit, the 4-stage cut (ours and torch's),
the configurations, the verdicts, and a quick run of the multi-stage schedules, ours and torch's."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import throughput_configs as configs
import throughput_workloads as work
import torch
import torch_schedules as schedules

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import SyncMode

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def sizes(workload: str, **given: int) -> argparse.Namespace:
    args = argparse.Namespace(workload=workload, quick=True, **given)
    work.fill_defaults(args)
    return args


def test_every_torch_schedule_is_listed_and_its_stages_cover_each_index_once() -> None:
    from torch.distributed.pipelining import schedules as torch_schedules

    shipped = {n.removeprefix("Schedule") for n in torch_schedules.__all__ if "Schedule" in n}
    assert set(schedules.SCHEDULES) == {n for n in shipped if not n.startswith("Pipeline")}
    assert schedules.stages_of("1F1B", 1) == [1]
    assert schedules.stages_of("Interleaved1F1B", 0) == [0, 2]
    assert schedules.stages_of("ZBVZeroBubble", 0) == [0, 3]
    for name in schedules.SCHEDULES:
        held = [i for rank in range(2) for i in schedules.stages_of(name, rank)]
        assert sorted(held) == list(range(schedules.stage_count(name))), name


@pytest.mark.parametrize("workload", ["mlp", "gpt"])
def test_the_four_stages_compose_to_the_whole_model(workload: str) -> None:
    args = sizes(workload, depth=4)
    layers = work.make_layers(args)
    parts = schedules.cut(layers, args, 4)
    assert sum(len(part) for part in parts) == len(layers)
    x, _ = work.make_batches(args, 2)[0]
    value = x
    for part in parts:
        value = part(value)
    torch.testing.assert_close(value, layers(x), rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"cut into 4 equal stages \(depth: 2\)"):
        schedules.cut(layers, sizes(workload, depth=2), 4)


@pytest.mark.parametrize("workload", ["mlp", "gpt"])
@pytest.mark.parametrize(
    ("sync", "torch_schedule"), [("interleaved", "LoopedBFS"), ("zbv", "DualPipeV")]
)
def test_our_chunked_modes_train_the_stages_torch_places_where_torch_places_them(
    workload: str, sync: str, torch_schedule: str
) -> None:
    """Like for like: ``ours-interleaved``/``ours-zbv`` give the strategy a balance of the 4
    stages torch's loop/V schedules cut, and the strategy's placement (``Plan.from_balance`` as
    ``strategy.planning`` calls it) puts them on the ranks torch does."""
    args = sizes(workload, depth=4)
    assert configs.stage_count(sync) == 4 and configs.stage_count("zero_bubble") == 2
    parts = schedules.cut(work.make_layers(args), args, schedules.stage_count(torch_schedule))
    balance = work.balance(args, configs.stage_count(sync))
    assert balance == [len(part) for part in parts]
    plan = Plan.from_balance(balance, placement=SyncMode(sync).placement, num_ranks=2)
    for rank in range(2):
        held = [stage.index for stage in plan.stages_of_rank(rank)]
        assert held == schedules.stages_of(torch_schedule, rank), (sync, rank)


def test_the_default_configurations_are_known_and_cover_every_schedule_at_every_m() -> None:
    names = schedules.default_configs((4, 8))
    assert len(names) == 1 + 2 * (5 + len(schedules.SCHEDULES))
    assert all(schedules.config_name(name) == name for name in names)
    assert "torch-DualPipeV-8" in names and "ours-zero_bubble-4" in names
    assert "ours-interleaved-4" in names and "ours-zbv-8" in names
    for wrong in ("torch-Interleaved-8", "ours-2bw-8", "torch-1F1B-8-minibatch"):
        with pytest.raises(argparse.ArgumentTypeError, match="a configuration is"):
            schedules.config_name(wrong)


def test_targets_compare_the_best_of_each_side_within_a_repeat(
    capsys: pytest.CaptureFixture[str],
) -> None:
    runs = {
        "ours-flush-8": [100.0, 90.0],
        "ours-zero_bubble-8": [110.0, 80.0],
        "torch-1F1B-8": [100.0, 100.0],
        "torch-ZBVZeroBubble-8": [105.0, 85.0],
    }
    schedules.print_targets(argparse.Namespace(workload="gpt"), runs)
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    # zero_bubble over 1F1B: 1.10 and 0.80, median 0.95
    assert lines[1].split()[:2] == ["zero_bubble-8", "/"] and "0.950  MISSED" in lines[1]
    # best ours over best torch: 110 / 105 and 90 / 100
    assert "best ours-8 / best torch-8 >= 1.0" in lines[2] and "(1.048, 0.900)" in lines[2]
    runs["ours-zbv-8"] = [100.0, 120.0]  # a chunked mode is one of our flushed modes
    schedules.print_targets(argparse.Namespace(workload="gpt"), runs)
    lines = [line for line in capsys.readouterr().out.splitlines() if line]
    assert "best ours-8 / best torch-8 >= 1.0" in lines[2] and "(1.048, 1.200)" in lines[2]


@pytest.mark.slow
@pytest.mark.bench
def test_quick_run_of_the_v_and_loop_schedules_ours_and_torchs() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / "torch_schedules.py"), "--quick"]
    configs = ["ours-zero_bubble-4", "ours-interleaved-4", "ours-zbv-4"]
    configs += ["torch-ZBVZeroBubble-4", "torch-1F1B-4"]
    result = subprocess.run(
        [*command, "--configs", *configs], env=env, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "FAILED" not in result.stdout, result.stdout[-3000:]
    rows = {
        line.split()[0]: line.split()[1:]
        for line in result.stdout.splitlines()
        if line.startswith(("ours-", "torch-"))
    }
    assert set(rows) == set(configs)
    assert all(float(cells[0]) > 0 for cells in rows.values())
    assert rows["torch-1F1B-4"][1] == "1.000"
    assert "best ours-4 / best torch-4 >= 1.0" in result.stdout
