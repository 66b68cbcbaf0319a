"""benchmarks/planner_speed.py on one small profile: its table and its verdict line."""

from __future__ import annotations

import planner_speed
import pytest


@pytest.mark.bench
def test_every_topology_of_one_profile_and_the_verdict(capsys) -> None:
    """The benchmark's quick run on one profile (``pytest --bench`` or ``-m bench`` runs it): its
    verdict is a timing, which a busy machine can miss."""
    assert planner_speed.main(["--profile", "alexnet"])  # the published ones by default
    lines = capsys.readouterr().out.splitlines()
    rows = [line.split() for line in lines if line.startswith("alexnet ")]
    assert [" ".join(row[1:4]) for row in rows] == list(planner_speed.TOPOLOGIES)
    assert all(row[4] == "22" for row in rows)  # alexnet's antichain states
    assert lines[-1].startswith("every case under 1 s: yes (slowest: alexnet on ")


def test_a_case_over_the_limit_says_no(profiles_dir, capsys) -> None:
    assert not planner_speed.main(
        ["--profiles", str(profiles_dir), "--profile", "vgg16", "--limit", "0", "--repeats", "1"]
    )
    assert capsys.readouterr().out.splitlines()[-1].startswith("every case under 0 s: NO")


@pytest.mark.parametrize("folder", [True, False])
def test_an_unknown_profile_is_named(profiles_dir, folder: bool) -> None:
    argv = ["--profiles", str(profiles_dir)] if folder else []
    with pytest.raises(SystemExit, match=r"no such profile .* \(profile: nope\); pick from alex"):
        planner_speed.main([*argv, "--profile", "nope"])
