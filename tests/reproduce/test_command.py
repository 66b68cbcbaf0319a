"""``pl-pipedream reproduce``: Table 1's rows beside the planner's prediction, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pl_pipedream.apps.cli import main
from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile
from pl_pipedream.published import load_profile
from pl_pipedream.reproduce.epochs import scale_profile
from pl_pipedream.reproduce.table import read_table

CLUSTER_A_4X4 = Topology.from_lists([4, 4], [1.2e10, 1.25e9])  # PCIe in a server, 10 Gbps out


def direct(name: str) -> tuple[str, float]:
    """The planner called directly on cluster A 4x4: (replicas per stage, speedup over DP)."""
    result = plan(load_profile(name), CLUSTER_A_4X4)
    return result.shape, result.speedup_over_data_parallel


def reproduce(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    """The command on the table and profiles that ship with the package."""
    code = main(["reproduce", "--no-own-profile", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_two_rows_print_the_paper_and_the_planner_side_by_side(capsys) -> None:
    code, out, _ = reproduce(capsys, "vgg16_A_4x4", "alexnet_A_4x4")
    assert code == 0
    header, *rows = out.strip().split("\n\n")[0].splitlines()
    assert header.split()[:2] == ["row", "paper"]
    assert [row.split()[0] for row in rows] == ["vgg16_A_4x4", "alexnet_A_4x4"]
    for row, name, paper in zip(rows, ("vgg16", "alexnet"), ("5.28x", "4.92x"), strict=True):
        shape, speedup = direct(name)
        cells = row.split()
        assert cells[1] == "15-1"  # the paper's configuration, from the CSV
        assert cells[2] == shape  # ours: replicated stages, so written as the shape
        assert cells[3] == "-"  # our own profile was not asked for
        assert cells[4] == paper
        assert cells[6] == f"{speedup:.2f}x"  # an epoch's fill is 3 of 20,000 minibatches
        assert cells[8] == f"{speedup / float(paper[:-1]):.2f}"
    assert "Paper config and paper speedup: PipeDream (SOSP 2019) Table 1" in out


def test_json_carries_the_planners_numbers(capsys) -> None:
    code, out, _ = reproduce(capsys, "vgg16_A_4x4", "--json")
    assert code == 0
    (row,) = json.loads(out)
    shape, speedup = direct("vgg16")
    assert row["row"] == "vgg16_A_4x4"
    assert row["paper_config"] == "15-1"
    assert row["paper_speedup_epoch"] == 5.28
    assert row["our_config"] == shape
    # An epoch of 20,019 minibatches of 64 images, plus the pipeline's fill of stages - 1.
    stages = len(shape.split("-"))
    epoch_speedup = speedup * 20_019 / (20_019 + stages - 1)
    assert row["predicted_speedup"] == pytest.approx(epoch_speedup)
    assert row["ratio"] == pytest.approx(epoch_speedup / 5.28)
    assert row["plan"]["topology"] == CLUSTER_A_4X4.to_dict()


def test_a_model_without_a_published_profile_gets_no_prediction(capsys, tmp_path) -> None:
    markdown = tmp_path / "table1.md"
    code, out, _ = reproduce(capsys, "awdlm_A_1x4", "--markdown", str(markdown))
    assert code == 0
    row = out.strip().splitlines()[1]
    assert row.split()[:2] == ["awdlm_A_1x4", "straight"]
    assert "no published profile" in row
    assert "4.25x (epoch)" in row
    assert row.split()[-4:] == ["-", "-", "-", "-"]  # no prediction, ratio or GPipe figure
    text = markdown.read_text()
    assert (
        "| awdlm_A_1x4 | straight | no published profile | - | 4.25x (epoch) | - | - | - | - |"
        in text
    )
    assert "the paper's figures" in text


def test_an_unknown_row_is_an_error_that_lists_the_rows(capsys) -> None:
    code, out, err = reproduce(capsys, "vgg19_A_4x4")
    assert code == 2 and out == ""
    assert "(row: vgg19_A_4x4)" in err
    assert "vgg16_A_4x4" in err


def test_a_missing_table_names_the_option(capsys, tmp_path) -> None:
    missing = tmp_path / "table1.csv"
    code = main(["reproduce", "--table", str(missing), "vgg16_A_4x4"])
    err = capsys.readouterr().err
    assert code == 2
    assert f"(--table: {missing})" in err
    assert "pass --table PATH" in err


def test_our_own_profile_plans_a_row_and_the_png_and_json_carry_it(capsys, tmp_path) -> None:
    """AlexNet profiled here (cached in tmp_path), planned at speed factor 140 on cluster A 4x4."""
    png, cache = tmp_path / "table1.png", tmp_path / "cache"
    argv = ["reproduce", "alexnet_A_4x4"]
    argv += ["--cache", str(cache), "--png", str(png), "--json"]
    assert main(argv) == 0
    (row,) = json.loads(capsys.readouterr().out)
    measured = Profile.load(cache / "alexnet.json")
    assert row["own_plan"] is not None and row["own_config"]
    scaled = scale_profile(measured, 256, 140.0)
    expected = plan(scaled, CLUSTER_A_4X4)
    assert row["own_plan"]["stages"] == json.loads(expected.to_json())["stages"]
    minibatches = -(-1_281_167 // 256)
    dp = minibatches * expected.data_parallel_time
    pipedream = (minibatches + expected.num_stages - 1) * expected.slowest_stage_time
    assert row["own_predicted_speedup"] == pytest.approx(dp / pipedream)
    assert row["own_ratio"] == pytest.approx(dp / pipedream / 4.92)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_reproduce_run_from_an_empty_directory_reads_what_the_package_ships(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing beside the checkout or in the working directory: the table and the profiles are
    the package's own, and the command plans every row that has a published profile."""
    monkeypatch.chdir(tmp_path)
    code, out, err = reproduce(capsys, "--json")
    assert (code, err) == (0, "")
    rows = json.loads(out)
    assert [row["row"] for row in rows] == [row.id for row in read_table()]
    assert all(row["plan"] is not None for row in rows if row["profile"] is not None)
    assert list(tmp_path.iterdir()) == []  # --no-own-profile: no cache written


def test_the_profiles_given_with_profiles_replace_the_shipped_ones(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "vgg16.txt").write_text(load_profile("alexnet").to_graph_txt())
    code, out, _ = reproduce(capsys, "vgg16_A_4x4", "--profiles", str(tmp_path), "--json")
    (row,) = json.loads(out)
    assert (code, row["our_config"]) == (0, direct("alexnet")[0])
    code, _, err = reproduce(capsys, "alexnet_A_4x4", "--profiles", str(tmp_path))
    assert code == 2
    assert f"(--profiles: {tmp_path}, profile: alexnet.txt)" in err
