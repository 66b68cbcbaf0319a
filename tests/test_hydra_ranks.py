"""hydra_ranks: rank 0 of a Hydra job starts ranks 1..n-1 as copies of exactly this job.

The children here are tiny Python processes (``python -c``) that stand in for
``python -m pl_pipedream.apps.train``: they report the environment they were started with. Hydra's
job state is faked. How ranks are watched and reported is tested in tests/runtime/test_ranks.py;
here, that the app's block ends with that report.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from hydra.core.override_parser.overrides_parser import OverridesParser

from pl_pipedream import hydra_ranks
from pl_pipedream.hydra_ranks import RankFailure, _free_port, child_command, other_ranks

RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def parsed(overrides: list[str]) -> dict[str, object]:
    parser = OverridesParser.create()
    return {o.key_or_group: o.value() for o in parser.parse_overrides(overrides)}


# ----- the command line ---------------------------------------------------------------------------


def test_a_child_reruns_exactly_this_job_in_its_output_dir() -> None:
    folder = "/runs/multirun/2024-01-01/12-00-00/1 a=b'c"
    command = child_command(
        ["sync=flush", "model.hidden=[32,32]"],
        ["hydra.mode=MULTIRUN", "hydra.sweep.dir=/runs/m", "hydra.verbose=true"],
        folder,
        "train",
        ["/extra/configs"],
    )
    assert command[:3] == [sys.executable, "-m", "pl_pipedream.apps.train"]
    overrides = command[3:]
    assert "--config-name=train" in overrides and "--config-dir=/extra/configs" in overrides
    assert "hydra.verbose=true" in overrides
    assert not any(o.startswith(("hydra.mode", "hydra.sweep", "--multirun")) for o in overrides)
    values = parsed([o for o in overrides if not o.startswith("--")])
    assert values["hydra.run.dir"] == folder
    assert values["hydra.output_subdir"] is None
    assert values["sync"] == "flush" and values["model.hidden"] == [32, 32]


def test_overrides_that_would_sweep_or_move_the_child_are_dropped() -> None:
    kept = ["hydra.verbose=true", "hydra/job_logging=disabled", "hydra.job.chdir=false"]
    dropped = [
        "hydra.mode=MULTIRUN",
        "hydra.run.dir=/elsewhere",
        "hydra.sweep.subdir=${hydra.job.num}",
        "hydra.job.name=train",
        "hydra.output_subdir=.hydra",
        "hydra/sweeper=basic",
        "+hydra.sweeper.params.x=1,2",
        "hydra/launcher=basic",
        "~hydra.launcher.n_jobs",
    ]
    command = child_command([], dropped + kept, "/out", None)
    assert command == [
        sys.executable,
        "-m",
        "pl_pipedream.apps.train",
        *kept,
        "hydra.run.dir='/out'",
        "hydra.output_subdir=null",
    ]


@pytest.mark.parametrize(
    "folder",
    [
        "/a b/c:d=e",
        "/it's/here",
        "/ends/in\\",
        "/before\\'quote",
        "C:\\runs\\x",
        "C:\\runs\\",
    ],
)
def test_the_output_dir_survives_hydras_parser(folder: str) -> None:
    assert parsed(child_command([], [], folder, None)[3:])["hydra.run.dir"] == folder


def test_a_free_port_can_be_bound() -> None:
    port = _free_port()
    assert 1024 <= port < 65536
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
        server.bind(("127.0.0.1", port))


# ----- starting the ranks -------------------------------------------------------------------------

REPORT = (
    "import json, os, sys\n"
    "name = sys.argv[-1].split('=')[1]\n"
    "names = ('LOCAL_RANK', 'NODE_RANK', 'WORLD_SIZE', 'MASTER_ADDR', 'MASTER_PORT')\n"
    "json.dump({k: os.environ.get(k) for k in names}, open(name + '.json', 'w'))\n"
    "sys.exit(int(os.environ.get('EXIT_' + os.environ['LOCAL_RANK'], '0')))\n"
)


@pytest.fixture
def hydra_job(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[tuple]:
    """A Hydra job in ``tmp_path`` whose children run REPORT; returns child_command's calls."""
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    config = SimpleNamespace(
        overrides=SimpleNamespace(task=["sync=flush"], hydra=["hydra.verbose=true"]),
        runtime=SimpleNamespace(
            output_dir=str(tmp_path / "out"),
            cwd=str(tmp_path),
            config_sources=[
                SimpleNamespace(provider="hydra", path="pkg://hydra.conf"),
                SimpleNamespace(provider="command-line", path="/extra/configs"),
            ],
        ),
        job=SimpleNamespace(config_name="train", name="job"),
    )
    monkeypatch.setattr(hydra_ranks.HydraConfig, "get", staticmethod(lambda: config))
    calls: list[tuple] = []

    def command(*args: object) -> list[str]:
        calls.append(args)
        return [sys.executable, "-c", REPORT]

    monkeypatch.setattr(hydra_ranks, "child_command", command)
    return calls


def reports(folder: Path) -> dict[str, dict[str, str]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))}


def test_one_process_or_a_rank_already_set_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in RANK_VARIABLES:
        monkeypatch.delenv(name, raising=False)

    def no_hydra() -> None:
        raise AssertionError("asked Hydra for the job")

    monkeypatch.setattr(hydra_ranks.HydraConfig, "get", staticmethod(no_hydra))
    before = dict(os.environ)
    with other_ranks(1):
        assert dict(os.environ) == before
    monkeypatch.setenv("SLURM_NTASKS", "4")  # srun started a task per device
    with other_ranks(4):
        assert dict(os.environ) == {**before, "SLURM_NTASKS": "4"}
    monkeypatch.setenv("SLURM_NTASKS", "1")  # one task (e.g. an interactive allocation): start
    with pytest.raises(AssertionError, match="asked Hydra"):
        with other_ranks(4):
            pass
    monkeypatch.setenv("LOCAL_RANK", "1")  # a child, or a rank started by torchrun or SLURM
    with other_ranks(4):
        assert os.environ["LOCAL_RANK"] == "1" and "WORLD_SIZE" not in os.environ


def test_the_ranks_share_one_world_and_the_environment_comes_back(
    hydra_job: list[tuple], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.2")
    with other_ranks(3):
        mine = {name: os.environ[name] for name in RANK_VARIABLES}
    assert hydra_job == [
        (["sync=flush"], ["hydra.verbose=true"], str(tmp_path / "out"), "train", ["/extra/configs"])
    ]
    assert mine["LOCAL_RANK"] == "0"
    assert (mine["NODE_RANK"], mine["WORLD_SIZE"], mine["MASTER_ADDR"]) == ("0", "3", "127.0.0.2")
    assert mine["MASTER_PORT"].isdigit()
    children = reports(tmp_path)  # each child was named job_rank<r> and ran in the job's cwd
    assert children == {f"job_rank{rank}": {**mine, "LOCAL_RANK": str(rank)} for rank in (1, 2)}
    assert os.environ["MASTER_ADDR"] == "127.0.0.2"
    assert not any(name in os.environ for name in RANK_VARIABLES if name != "MASTER_ADDR")


@pytest.mark.slow
def test_a_failed_child_fails_the_block(
    hydra_job: list[tuple], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXIT_2", "3")
    with pytest.raises(RankFailure, match=r"^pl-pipedream: rank 2 failed \(exit code: 3\)"):
        with other_ranks(3):
            pass
    assert sorted(reports(tmp_path)) == ["job_rank1", "job_rank2"]
    assert "LOCAL_RANK" not in os.environ


# ----- the report -------------------------------------------------------------------------------

CHILD_RAISES = (
    "from pl_pipedream.hydra_ranks import other_ranks\n"
    "with other_ranks(2):\n"
    "    raise ValueError('bad config on rank 1')\n"
)
CHILD_KILLED = "import os, time\ntime.sleep(0.5)\nos.kill(os.getpid(), 9)\n"


class PeerError(RuntimeError):
    """Stands in for the runtime's: a rank that only saw a peer stop."""


def test_a_childs_own_error_ends_rank_zeros_message(
    hydra_job: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A child whose block raises records its error; rank 0's failure message ends with it, so
    the user reads it last, not buried above among the other ranks' output."""
    command = [sys.executable, "-c", CHILD_RAISES]
    monkeypatch.setattr(hydra_ranks, "child_command", lambda *args: command)
    with pytest.raises(RankFailure) as caught:
        with other_ranks(2):
            pass
    lines = str(caught.value).splitlines()
    assert lines[0] == "pl-pipedream: rank 1 failed (exit code: 1); its error:"
    assert lines[-1] == "  ValueError: bad config on rank 1"


def test_when_rank_0_fails_on_a_killed_child_the_report_leads_with_the_child(
    hydra_job: list[tuple], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 0's block fails with a PeerError because rank 1 was SIGKILLed: the report, raised
    from rank 0's error, names rank 1 first and rank 0 after it."""
    command = [sys.executable, "-c", CHILD_KILLED]
    monkeypatch.setattr(hydra_ranks, "child_command", lambda *args: command)
    with pytest.raises(RankFailure) as caught:
        with other_ranks(2):
            time.sleep(1.5)
            raise PeerError("rank 0 could not receive from rank 1")
    assert isinstance(caught.value.__cause__, PeerError)
    assert str(caught.value).splitlines() == [
        "pl-pipedream: rank 1 failed (killed by SIGKILL); its error:",
        "  (no error recorded: it was killed, exited or hung; its output above says where)",
        "pl-pipedream: rank 0 failed as well (PeerError; exit code: 1)",
    ]
    assert "LOCAL_RANK" not in os.environ
