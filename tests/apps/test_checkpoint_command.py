"""``pl-pipedream checkpoint inspect|to-torch|from-torch``: the actions through ``main``, exit
codes, and errors printed with the fix instead of a traceback."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pl_pipedream.apps.cli import main
from pl_pipedream.core.checkpoint import consolidate_checkpoint, read_shards
from tests.core.test_checkpoint import write
from tests.core.test_checkpoint_tools import every_dtype, same_bits


def test_inspect_prints_the_checkpoint(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    write(tmp_path / "run.ckpt", step=7)
    assert main(["checkpoint", "inspect", str(tmp_path / "run.ckpt")]) == 0
    out = capsys.readouterr().out
    assert "step          7" in out and "stage-01.pt" in out and "net.1.weight" in out


def test_to_torch_then_from_torch_then_to_torch_is_bit_for_bit(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    write(tmp_path / "run.ckpt")
    plain, again = tmp_path / "plain.pt", tmp_path / "again.pt"
    assert main(["checkpoint", "to-torch", str(tmp_path / "run.ckpt"), str(plain)]) == 0
    assert "wrote 3 names to" in capsys.readouterr().out
    assert same_bits(
        torch.load(plain, weights_only=True), consolidate_checkpoint(tmp_path / "run.ckpt")
    )
    made = tmp_path / "made.ckpt"
    assert main(["checkpoint", "from-torch", str(plain), str(made), "--layers", "2"]) == 0
    assert "one stage on one worker, step 0" in capsys.readouterr().out
    meta, _ = read_shards(made)
    assert meta["plan"]["stages"][0]["nodes"] == ["0", "1"]
    assert main(["checkpoint", "to-torch", str(made), str(again)]) == 0
    assert same_bits(torch.load(again, weights_only=True), torch.load(plain, weights_only=True))


def test_a_plain_file_given_to_inspect_names_from_torch(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    torch.save(every_dtype(), tmp_path / "plain.pt")
    assert main(["checkpoint", "inspect", str(tmp_path / "plain.pt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pl-pipedream checkpoint: error: a PipeDream checkpoint is a directory")
    assert "from-torch" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv",
    [
        ["inspect", "{tmp}/missing"],
        ["to-torch", "{tmp}/missing", "{tmp}/out.pt"],
        ["from-torch", "{tmp}/missing.pt", "{tmp}/out.ckpt"],
        ["from-torch", "{tmp}/plain.pt", "{tmp}/out.ckpt", "--layers", "0"],
    ],
)
def test_bad_paths_and_values_exit_2_with_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture, argv: list[str]
) -> None:
    torch.save(every_dtype(), tmp_path / "plain.pt")
    assert main(["checkpoint", *(a.format(tmp=tmp_path) for a in argv)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pl-pipedream checkpoint: error: ")
    assert "); " in err  # the rule (the values); the fix
    assert not (tmp_path / "out.ckpt").exists() and not (tmp_path / "out.pt").exists()


def test_the_command_runs_from_torch_and_inspect_in_a_process(tmp_path: Path) -> None:
    torch.save(every_dtype(), tmp_path / "plain.pt")
    module = [sys.executable, "-m", "pl_pipedream.apps.cli", "checkpoint"]
    made = subprocess.run(
        [*module, "from-torch", str(tmp_path / "plain.pt"), str(tmp_path / "run.ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert made.returncode == 0, made.stderr
    shown = subprocess.run(
        [*module, "inspect", str(tmp_path / "run.ckpt")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    assert "net.1.num_batches_tracked" in shown.stdout and "int64" in shown.stdout
