"""benchmarks/scale_table.py: the stash table's figures (no processes), and its model's rows."""

from __future__ import annotations

import argparse

import pytest
import scale_table

from pl_pipedream.schedule.modes import SyncMode

MIB = 2**20


def test_the_stash_table_prints_p_versions_at_the_input_stage_in_async_and_two_in_2bw(
    capsys: pytest.CaptureFixture[str],
) -> None:
    args = argparse.Namespace(stash_stages=[16], stage_mib=64.0, activation_mib=8.0, device_gib=2.0)
    scale_table.stash_table(args)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.count("|") == 5]
    rows = {line.split("|")[1].strip(): line for line in lines}
    versions = {mode: rows[mode].split("|")[2].split() for mode in scale_table.MODES}
    assert versions["async"] == ["16", "8", "1"]  # w_s + 1 at stages 0, 8, 15
    assert versions["vertical_sync"] == ["16", "16", "16"]
    assert versions["2bw"] == ["2", "2", "2"]
    assert versions["flush"] == ["1", "1", "1"]
    assert rows["async"].split("|")[3].strip() == str(16 * 17 // 2)


def test_the_most_stages_that_fit_is_the_edge_of_the_memory_rule() -> None:
    weights, activations, memory = 64 * MIB, 8 * MIB, 2 * 2**30
    for name in ("async", "2bw"):
        sync = SyncMode.parse(name)
        most = scale_table.most_stages(sync, weights, activations, memory, cap=512)
        fits = [
            scale_table.stash_and_activations(scale_table.sized(n, weights, activations), sync, 0)
            <= memory
            for n in (most, most + 1)
        ]
        assert fits == [True, False], name
    # async: p (weights + activations) <= 2 GiB; 2bw: 2 weights + p activations <= 2 GiB
    most = {
        name: scale_table.most_stages(SyncMode.parse(name), weights, activations, memory, 512)
        for name in ("async", "2bw")
    }
    assert most == {"async": 28, "2bw": 240}


def test_the_model_has_one_layer_per_stage_and_the_rows_are_microbatches_of_two() -> None:
    model = scale_table.deep_model(5, 16)
    assert len(model) == 5 and model[-1].out_features == 16
    data = scale_table.rows(4, 16)
    assert len(data) == scale_table.BATCHES * 4 * scale_table.ROWS
