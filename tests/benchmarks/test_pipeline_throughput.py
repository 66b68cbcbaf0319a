"""benchmarks/pipeline_throughput.py: the two views' batch sizes, the workloads' stage split, the
verdicts, and a quick run of every workload."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

import pytest
import throughput_configs as configs
import throughput_model as model
import throughput_report as report
import throughput_workloads as work
import torch

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def sizes(workload: str, **given: int) -> argparse.Namespace:
    args = argparse.Namespace(workload=workload, quick=False, **given)
    work.fill_defaults(args)
    return args


def test_equal_microbatch_multiplies_the_batch_and_equal_minibatch_splits_it() -> None:
    args = sizes("mlp", microbatch=128)
    rows = {
        name: (
            configs.Config.parse(name).rows(args),
            configs.Config.parse(name).microbatch_rows(args),
        )
        for name in ("single", "ours-async-1", "ours-flush-8", "torch-1F1B-8", "ours-async-4")
    }
    assert rows == {
        "single": (128, 128),
        "ours-async-1": (128, 128),
        "ours-flush-8": (1024, 128),
        "torch-1F1B-8": (1024, 128),
        "ours-async-4": (512, 128),
    }
    config = configs.Config.parse("torch-1F1B-8-minibatch")
    assert (config.rows(args), config.microbatch_rows(args), config.equal_minibatch) == (
        128,
        16,
        True,
    )
    unbound = configs.Config.parse("ours-async-1-unbound")
    assert (unbound.unbound, unbound.equal_minibatch, unbound.rows(args)) == (True, False, 128)


def test_a_configuration_name_is_checked() -> None:
    assert configs.config_name("ours-2bw-4-minibatch") == "ours-2bw-4-minibatch"
    listed = {*configs.CONFIGS}
    for names in (*configs.DEFAULT_CONFIGS.values(), *configs.QUICK_CONFIGS.values()):
        listed.update(names)
    assert all(configs.config_name(name) == name for name in listed)
    for wrong in ("ours-flush", "torch-Interleaved-8", "ours-flush-8-fast", "torch-1F1B-8-unbound"):
        with pytest.raises(argparse.ArgumentTypeError, match="a configuration is"):
            configs.config_name(wrong)


@pytest.mark.parametrize("workload", work.WORKLOADS)
def test_the_two_stages_compose_to_the_whole_model(workload: str) -> None:
    """Stage 0 then stage 1 computes what the whole model computes (gpt: the embedding first,
    the head last, half the blocks each), on the shape the messages are costed at."""
    args = sizes(workload, **work.QUICK[workload])
    layers = work.make_layers(args)
    first, last = (work.stage_layers(layers, args, stage) for stage in (0, 1))
    assert len(first) + len(last) == len(layers)
    x, y = work.make_batches(args, 4)[0]
    middle = first(x)
    assert middle.shape == work.activation_shape(args, 4)
    assert work.message_bytes(args, 4) == 4 * middle.numel()
    torch.testing.assert_close(last(middle), layers(x), rtol=0, atol=0)
    assert work.loss(last(middle), y).ndim == 0
    if workload == "gpt":
        assert work.balance(args) == [args.depth // 2 + 1] * 2
        assert type(first[0]).__name__ == "Embedding" and type(last[-1]).__name__ == "Head"
        assert sum(type(layer).__name__ == "Block" for layer in first) == args.depth // 2


def test_a_mode_of_several_stages_per_rank_is_not_simulated_on_two_stages_costs() -> None:
    """The stage costs are measured for one stage per rank: ours-zbv and ours-interleaved run
    (on 4 stages, ``stage_count``) without a prediction."""
    args = sizes("mlp")
    for name in ("ours-zbv-8", "ours-interleaved-8"):
        assert configs.config_name(name) == name
        assert model.simulated(args, configs.Config.parse(name), [], {}, {}) == (None, None)


def test_verdicts_compare_the_median_against_the_goal(capsys: pytest.CaptureFixture[str]) -> None:
    report.print_check("async-1 / torch-1F1B-8", [1.2, 1.0, 1.05], 1.1, higher=True)
    report.print_check("ms per step", [1.4, 1.6, 1.45], 1.5, higher=False)
    report.print_check("ms per step", [1.6, 1.4, 1.55], 1.5, higher=False)
    lines = capsys.readouterr().out.splitlines()
    assert "1.050  MISSED" in lines[0]
    assert "1.450  met" in lines[1]
    assert "1.550  MISSED" in lines[2]


def test_targets_without_their_configurations_say_so(capsys: pytest.CaptureFixture[str]) -> None:
    args = argparse.Namespace(workload="mlp")
    one = [{"samples": 100.0}]
    report.print_targets(args, {"single": one, "ours-flush-2": one})  # type: ignore[dict-item]
    out = capsys.readouterr().out
    assert "targets (" not in out  # no heading over an empty list
    assert "targets: none printed" in out
    report.print_targets(args, {"single": one, "ours-async-1": [{"samples": 180.0}]})  # type: ignore[dict-item]
    lines = capsys.readouterr().out.splitlines()
    assert "met/MISSED against the goal" in lines[1]
    assert lines[2].split()[:3] == ["async-1", "efficiency", "0.900"]


def quick(workload: str, *extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, str(BENCHMARKS / "pipeline_throughput.py"), "--quick"]
    command += ["--workload", workload, *extra]
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout


def table_rows(out: str, title: str) -> dict[str, list[str]]:
    """The rows of the table under ``title``: config -> its cells."""
    lines = out[out.index(title) :].splitlines()[2:]
    rows = {}
    for line in lines:
        if not line or line.startswith("ms/mb"):
            break
        cells = line.split()
        rows[cells[0]] = cells[1:]
    return rows


@pytest.mark.slow
@pytest.mark.bench
def test_quick_mlp_prints_both_views_and_the_simulator() -> None:
    """A benchmark's quick run: ``pytest --bench`` or ``-m bench`` runs it."""
    out = quick("mlp")
    micro = table_rows(out, "EQUAL MICROBATCH")
    mini = table_rows(out, "EQUAL MINIBATCH")
    assert set(micro) == {"single", "ours-flush-2"}
    assert set(mini) == {"torch-1F1B-2-minibatch"}
    for cells in (*micro.values(), *mini.values()):
        rate, ms_batch = float(cells[0]), float(cells[1])
        assert rate > 0 and ms_batch > 0
    # ms per batch from samples/s: batches of 2 x 16 rows at equal microbatch, of 16 rows split
    # in 2 at equal minibatch; ms per batch over ms per microbatch is m
    flush, torch_mini = micro["ours-flush-2"], mini["torch-1F1B-2-minibatch"]
    # (ms per batch printed to 0.1 ms, per microbatch to 0.01 ms)
    assert float(flush[1]) == pytest.approx(1e3 * 32 / float(flush[0]), abs=0.06)
    assert float(torch_mini[1]) == pytest.approx(1e3 * 16 / float(torch_mini[0]), abs=0.06)
    assert 2 * float(flush[2]) == pytest.approx(float(flush[1]), abs=0.07)
    assert "16 rows (a 0.00 MB message" in out and "8 rows (a 0.00 MB message" in out  # costs
    assert "flush-8 / torch-1F1B-8" not in out  # a check whose configurations did not run
    assert "  ours-flush-2                0 " in out and "  ours-flush-2                1 " in out


@pytest.mark.slow
@pytest.mark.bench
def test_quick_gpt_and_overhead_run() -> None:
    """The quick runs of ``gpt`` and ``overhead`` (``pytest --bench`` or ``-m bench`` runs them):
    ``async`` with one microbatch has no fill and drain, so it is not slower than 1F1B with 2
    microbatches (ideal 1.5; bound 0.8 for a busy machine); our fixed cost per step is within 10
    times ``Schedule1F1B``'s per microbatch (about 4 on a quiet machine, docs/performance.md),
    and the verdict printed beside it is the one its figure gives."""
    out = quick("gpt", "--no-simulate")
    assert "GPT: embedding + 2 decoder blocks" in out
    micro = table_rows(out, "EQUAL MICROBATCH")
    assert set(micro) == {"ours-async-1", "torch-1F1B-2"}
    assert "sim ms" not in out and "EQUAL MINIBATCH" not in out
    ours, theirs = (float(micro[name][0]) for name in ("ours-async-1", "torch-1F1B-2"))
    assert theirs > 0 and ours / theirs >= 0.8, (ours, theirs)
    out = quick("overhead", "--no-simulate")
    assert "fixed cost, ms per microbatch" in out
    lines = out.splitlines()
    ours_line = next(line for line in lines if line.startswith("  ours-flush-1 <= 1.5")).split()
    torch_line = next(line for line in lines if line.startswith("  torch-1F1B-2 ")).split()
    ours_ms, torch_ms = float(ours_line[3]), float(torch_line[1])
    assert ours_line[4] == ("met" if ours_ms <= 1.5 else "MISSED")
    assert 0 < torch_ms and 0 < ours_ms <= 10 * torch_ms, (ours_ms, torch_ms)
