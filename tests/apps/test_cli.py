"""``pl-pipedream plan`` and ``simulate``: the table, the JSON contract, and clear errors."""

from __future__ import annotations

import dataclasses
import itertools
import json

import pytest

from pl_pipedream.apps.cli import main
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import SYNC_MODES, rules
from pl_pipedream.schedule.modes import SyncMode


def test_plan_json_has_the_documented_fields(profiles_dir, capsys) -> None:
    code = main(
        [
            "plan",
            "--profile",
            str(profiles_dir / "vgg16.txt"),
            "--workers",
            "4",
            "--bandwidth",
            "1e9",
            "--json",
        ]
    )
    assert code == 0
    data = json.loads(capsys.readouterr().out)
    assert data["slowest_stage_time"] > 0
    assert [stage["replicas"] for stage in data["stages"]] == [3, 1]
    assert all(isinstance(node, str) for stage in data["stages"] for node in stage["nodes"])


def test_plan_with_microbatches_admits_only_replica_counts_that_divide_them(
    profiles_dir, capsys
) -> None:
    """VGG-16 on 4 workers plans 3-1; one microbatch per batch admits no replicated stage."""
    base = ["plan", "--profile", str(profiles_dir / "vgg16.txt"), "--workers", "4"]
    base += ["--bandwidth", "1e9", "--json"]
    assert main(base) == 0
    assert [s["replicas"] for s in json.loads(capsys.readouterr().out)["stages"]] == [3, 1]
    assert main([*base, "--microbatches", "1"]) == 0
    stages = json.loads(capsys.readouterr().out)["stages"]
    assert [s["replicas"] for s in stages] == [1, 1, 1, 1]
    assert main([*base, "--microbatches", "0"]) == 2
    assert "microbatches must be a positive integer (microbatches: 0)" in capsys.readouterr().err


def test_plan_table_names_the_configuration(profiles_dir, capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--profile",
                str(profiles_dir / "vgg16.txt"),
                "--workers",
                "4",
                "--bandwidth",
                "1e9",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "3-1 on 4 workers" in out
    assert "speedup over DP" in out


def test_unparsable_profile_is_a_clear_error(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("node1 -- Linear -- forward_compute_time=oops\n")
    assert main(["plan", "--profile", str(bad), "--workers", "2", "--bandwidth", "1e9"]) == 2
    err = capsys.readouterr().err
    assert "bad.txt, line 1" in err


def test_missing_profile_is_a_clear_error(tmp_path, capsys) -> None:
    assert (
        main(
            [
                "plan",
                "--profile",
                str(tmp_path / "none.txt"),
                "--workers",
                "2",
                "--bandwidth",
                "1e9",
            ]
        )
        == 2
    )
    assert "cannot be read" in capsys.readouterr().err


def test_simulate_a_plan_file_with_each_mode(tmp_path, capsys) -> None:
    """The default microbatches: what the replicas share, raised to the stages for 2bw and to
    a multiple of the ranks for interleaved (which runs the plan recut into chunks)."""
    path = tmp_path / "plan.json"
    path.write_text(Plan.from_balance([2, 2, 2]).to_json())
    for sync in SYNC_MODES:
        args = ["simulate", "--plan", str(path), "--sync", sync, "--batches", "2", "--json"]
        assert main(args) == 0
        data = json.loads(capsys.readouterr().out)
        assert data["sync"] == sync
        assert data["num_minibatches"] == (6 if sync in ("2bw", "interleaved") else 2)


def test_simulate_without_microbatches_takes_the_fewest_the_mode_accepts(tmp_path, capsys) -> None:
    """Every plan of 2-3 stages with 1-3 replicas each, in ``2bw`` (whose warm-up raises the
    count): the default is the schedule rules' own fewest, so each one simulates."""
    plans = [
        Plan.from_balance([2] * len(replicas), replicas=list(replicas))
        for stages in (2, 3)
        for replicas in itertools.product((1, 2, 3), repeat=stages)
    ]
    assert len(plans) == 36
    for plan in plans:
        path = tmp_path / "plan.json"
        path.write_text(plan.to_json())
        args = ["simulate", "--plan", str(path), "--sync", "2bw", "--batches", "2", "--json"]
        assert main(args) == 0, (plan.shape, capsys.readouterr().err)
        data = json.loads(capsys.readouterr().out)
        assert data["num_minibatches"] == 2 * rules.fewest_microbatches(plan, SyncMode.TWO_BW)


def test_simulate_zero_bubble_compares_the_flushed_modes(tmp_path, capsys) -> None:
    path = tmp_path / "plan.json"
    path.write_text(Plan.from_balance([1, 1, 1]).to_json())
    base = ["simulate", "--plan", str(path), "--microbatches", "4", "--batches", "2"]
    assert main([*base, "--sync", "zero_bubble", "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "\nzero_bubble " in out and "\nflush " in out and "\ngpipe " in out
    assert "async " not in out.split("mode            ms/minibatch")[1]
    assert main([*base, "--sync", "flush", "--json"]) == 0
    assert "compare" not in json.loads(capsys.readouterr().out)
    assert main([*base, "--sync", "flush", "--compare", "--json", "--weight-share", "0.3"]) == 0
    rows = json.loads(capsys.readouterr().out)["compare"]
    assert [row["sync"] for row in rows] == list(SYNC_MODES)
    assert all(row["result"]["num_minibatches"] == 8 for row in rows if row["result"])


def test_simulate_compares_the_modes_of_several_stages_per_rank(tmp_path, capsys) -> None:
    """interleaved and zbv run the plan recut into two chunks per rank, each rank's work kept."""
    plan = Plan.from_balance([2, 2])
    stages = tuple(dataclasses.replace(s, forward_ms=1.0, backward_ms=2.0) for s in plan.stages)
    path = tmp_path / "plan.json"
    path.write_text(dataclasses.replace(plan, stages=stages).to_json())
    base = ["simulate", "--plan", str(path), "--microbatches", "4", "--batches", "1"]
    assert main([*base, "--sync", "flush", "--compare", "--json"]) == 0
    rows = {row["sync"]: row["result"] for row in json.loads(capsys.readouterr().out)["compare"]}
    assert rows["flush"]["total_ms"] == pytest.approx(4 * 3.0 + 3.0)  # (p - 1)(F + B)
    assert rows["interleaved"]["total_ms"] == pytest.approx(4 * 3.0 + 1.5)  # ... / v
    assert rows["zbv"]["total_ms"] == pytest.approx(4 * 3.0 + 0.5)  # (p - 1) F / 2
    assert rows["zbv"]["stages_of_rank"] == [[0, 3], [1, 2]]
    assert main([*base, "--sync", "interleaved", "--no-table"]) == 0
    out = capsys.readouterr().out
    assert "placement            interleaved, 2 stages per rank" in out
    assert "\ninterleaved " in out and "\nzbv " in out and "\nflush " in out
    small = tmp_path / "small.json"
    small.write_text(Plan.from_balance([1, 1]).to_json())
    assert main(["simulate", "--plan", str(small), "--compare", "--microbatches", "2"]) == 0
    assert "zbv             left out: v needs a layer per chunk (layers: 2, chunks: 4)" in (
        capsys.readouterr().out
    )


def test_simulate_validates_every_rank(tmp_path, capsys, monkeypatch) -> None:
    """A schedule whose last rank lost a receive: the full validation names it, no figures."""
    import pl_pipedream.schedule as schedule_package

    real = schedule_package.build

    def broken(*args, **kwargs):  # type: ignore[no-untyped-def]
        schedule = real(*args, **kwargs)
        *first, last = schedule.actions
        return dataclasses.replace(schedule, actions=(*first, last[1:]))

    monkeypatch.setattr(schedule_package, "build", broken)
    path = tmp_path / "plan.json"
    path.write_text(Plan.from_balance([1, 1, 1]).to_json())
    assert main(["simulate", "--plan", str(path), "--batches", "2", "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "every send needs exactly one matching partner" in captured.err


def test_simulate_rejects_an_unknown_mode(tmp_path, capsys) -> None:
    with pytest.raises(SystemExit) as exit:
        main(["simulate", "--plan", str(tmp_path / "plan.json"), "--sync", "fast"])
    assert exit.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("content", "words"),
    [
        (None, ["plan file must be a readable file", "No such file", "--output"]),
        ("", ["plan file must be JSON", "line 1 column 1", "--output"]),
        ("not json at all", ["plan file must be JSON", "line 1 column 1", "--output"]),
        ('{"stages": [{"nodes": 1}]}', ["must hold a plan", "TypeError", "--output"]),
        ("[1, 2]", ["must hold a plan", "--output"]),
    ],
)
def test_simulate_a_missing_or_garbage_plan_is_a_clear_error(
    tmp_path, capsys, content, words
) -> None:
    """Exit code 2 and one line naming the file and how to write a good one; no traceback."""
    path = tmp_path / "plan.json"
    if content is not None:
        path.write_text(content)
    assert main(["simulate", "--plan", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pl-pipedream simulate: error: "), err
    assert str(path) in err and "Traceback" not in err
    for word in words:
        assert word in err, (word, err)
