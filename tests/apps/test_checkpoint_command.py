"""``pl-pipedream checkpoint inspect|to-torch|to-lightning|from-torch``: the actions through
``main``, exit codes, and errors printed with the fix instead of a traceback; a 2-stage
checkpoint converted with ``to-lightning`` resumes on one device as the uninterrupted run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pl_pipedream.apps.cli import main
from pl_pipedream.core.checkpoint import consolidate_checkpoint, read_shards, to_lightning
from tests.core.test_checkpoint import write
from tests.core.test_checkpoint_tools import every_dtype, same_bits
from tests.core.test_resume import save

FIRST_FORMAT = (
    Path(__file__).resolve().parents[1] / "strategy" / "checkpoints" / "first-format.ckpt"
)


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
        ["to-lightning", "{tmp}/missing", "{tmp}/out.pt"],
        ["to-lightning", "{tmp}/plain.pt", "{tmp}/out.pt"],
        ["to-lightning", str(FIRST_FORMAT), "{tmp}/out.pt"],
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


def test_to_lightning_writes_one_lightning_checkpoint_with_positional_optimizer_state(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Two shards of a model trained 3 steps with Adam (``tests/core/test_resume.save``)."""
    save(tmp_path / "run.ckpt", [[0], [1, 2]])
    out = tmp_path / "one.ckpt"
    assert main(["checkpoint", "to-lightning", str(tmp_path / "run.ckpt"), str(out)]) == 0
    assert capsys.readouterr().out == (
        f"wrote a Lightning checkpoint of step 3 to {out}: resume on one device with "
        f"Trainer(...).fit(model, ckpt_path={str(out)!r})\n"
    )
    written, expected = torch.load(out, weights_only=False), to_lightning(tmp_path / "run.ckpt")
    assert same_bits(written["state_dict"], expected["state_dict"])
    adam = written["optimizer_states"][0]
    assert sorted(adam["state"]) == list(range(6))  # by position, as one device saves it
    assert adam["param_groups"] == expected["optimizer_states"][0]["param_groups"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one.ckpt", "run.ckpt"]  # no partial


def test_a_checkpoint_keyed_by_position_is_refused_with_the_fix(
    capsys: pytest.CaptureFixture, tmp_path: Path
) -> None:
    assert main(["checkpoint", "to-lightning", str(FIRST_FORMAT), str(tmp_path / "o.ckpt")]) == 2
    err = capsys.readouterr().err
    assert "keyed by position" in err and "resume it once under the plan that saved it" in err


@pytest.mark.slow
def test_a_two_stage_checkpoint_converted_resumes_on_one_device_as_the_uninterrupted_run(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Saved by a 2-stage ``flush`` fit after epoch 1 (5 steps), converted by the command,
    continued by a plain one-device ``Trainer(...).fit(model, ckpt_path=OUT)`` to epoch 2: the
    weights, Adam's state, the LR scheduler and the step equal one device's uninterrupted run."""
    from tests.strategy.test_resume import (
        FLUSH,
        assert_equal_weights,
        assert_same_training_state,
        fit,
        strategy,
    )

    straight = fit(tmp_path / "straight", 2, 1)  # one device, uninterrupted
    fit(tmp_path / "piped", 1, 2, strategy=strategy("flush"))
    saved, out = tmp_path / "piped" / "last.ckpt", tmp_path / "one-device.ckpt"
    assert (saved / "pipeline.json").is_file()
    assert main(["checkpoint", "to-lightning", str(saved), str(out)]) == 0
    assert "step 5" in capsys.readouterr().out
    alone = fit(tmp_path / "alone", 2, 1, out)  # Trainer(devices=1).fit(..., ckpt_path=out)
    assert_equal_weights(alone.state_dict(), straight.state_dict(), FLUSH)
    reference = tmp_path / "straight" / "last.ckpt"
    assert_same_training_state(tmp_path / "alone" / "last.ckpt", reference, FLUSH)
