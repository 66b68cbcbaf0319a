"""Preemption under Lightning: SIGTERM mid-training to one rank or to every rank stops them at
one step with ``last.ckpt``, which resumes to the weights of an uninterrupted run
(``preempt_script.py`` on two ranks forked from this process, real signals to real processes);
where the checkpoint goes."""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
import torch
from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import ModelCheckpoint

from pl_pipedream.strategy.preemption import checkpoint_path
from tests.runtime.launched import Rank, launch
from tests.strategy import preempt_script


def test_a_preempted_fit_saves_the_checkpoint_callbacks_last_ckpt(tmp_path: Path) -> None:
    callback = ModelCheckpoint(dirpath=str(tmp_path / "ckpts"))
    trainer = Trainer(accelerator="cpu", devices=1, logger=False, callbacks=[callback])
    assert checkpoint_path(trainer) == tmp_path / "ckpts" / "last.ckpt"
    assert callback.last_model_path == str(tmp_path / "ckpts" / "last.ckpt")
    bare = Trainer(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        default_root_dir=str(tmp_path),
    )
    assert checkpoint_path(bare) == tmp_path / "last.ckpt"


def script_rank(rank: int, argv: list[str]) -> None:
    preempt_script.main(argv)


def run(out: Path, *args: str) -> list[Rank]:
    """``preempt_script.py``'s two ranks, forked from this process as a launcher starts them, in
    a process group of their own: "--target group" signals the whole group, as scancel does."""
    argv = ["--out", str(out), *args]
    return launch(2, script_rank, argv, folder=out.parent / f"{out.name}-ranks", timeout=90)


# a step inside the first epoch (24 batches), away from its ends, drawn once
MID_EPOCH = random.Random(35).randrange(4, 18)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "target", "at", "every_step", "loader"),
    [
        # one rank signalled (flush: bitwise), the ranks agreeing at every step so that they
        # stop at step 24, the first of the second epoch: the checkpoint must not say that
        # epoch has ended, nor the loader that it has given its batches
        ("flush", "rank1", 21, True, "resumable"),
        # every rank at once, as scancel does (async), the agreement's own period
        ("async", "group", 17, False, "resumable"),
        # a shuffling torchdata StatefulDataLoader stopped mid-epoch (flush: bitwise)
        ("flush", "rank1", MID_EPOCH, True, "stateful"),
    ],
    ids=str,
)
def test_sigterm_stops_every_rank_with_a_checkpoint_that_resumes_exactly(
    tmp_path: Path, sync: str, target: str, at: int, every_step: bool, loader: str
) -> None:
    signal = ["--signal-at", str(at), "--target", target, "--loader", loader]
    stopped = run(
        tmp_path / "stopped", "--sync", sync, *signal, *["--agree-every-step"] * every_step
    )
    ended = time.time()
    assert [rank.code for rank in stopped] == [143, 143], [r.stderr[-2000:] for r in stopped]
    signalled = float((tmp_path / "stopped" / "signalled").read_text())
    exits = [json.loads((tmp_path / "stopped" / f"exit-rank{r}.json").read_text()) for r in (0, 1)]
    assert [e["code"] for e in exits] == [143, 143]
    assert exits[0]["step"] == exits[1]["step"] > at  # one agreed step, after the signal
    if every_step:  # the agreement 3 steps after the signal (24 batches per epoch)
        assert exits[0]["step"] == (24 if at == 21 else at + 3)
    assert ended - signalled < 30, ended - signalled
    last = tmp_path / "stopped" / "ckpts" / "last.ckpt"
    assert json.loads((last / "pipeline.json").read_text())["step"] == exits[0]["step"]

    # the resumed fit, then (same launch) the uninterrupted one into "straight"
    straight_out = str(tmp_path / "straight")
    resumed = run(
        tmp_path / "stopped",
        *("--sync", sync, "--loader", loader, "--resume", "--straight-out", straight_out),
    )
    assert [rank.code for rank in resumed] == [0, 0], [r.stderr[-2000:] for r in resumed]
    got = torch.load(tmp_path / "stopped" / "weights.pt")
    want = torch.load(tmp_path / "straight" / "weights.pt")
    assert got.keys() == want.keys()
    for key in want:
        if sync == "flush":
            assert torch.equal(got[key], want[key]), key
        else:  # the drain at the agreed step changes the staleness of the minibatches in flight
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=2e-3)
