"""Train with ``ModelCheckpoint(save_last=True)``, as a user's script would, and optionally
send SIGTERM at a given step, to rank 1 alone or to every rank (the process group).

Run as ``python tests/strategy/preempt_script.py --out DIR --sync flush [--signal-at K
--target rank1|group] [--agree-every-step] [--resume]``, in a session of its own for
``--target group``. Rank 0
consolidates ``DIR/ckpts/last.ckpt`` into ``DIR/weights.pt`` at the end of a fit that ends; each
rank whose fit raises ``SystemExit`` writes its code and the time to ``DIR/exit-rank{r}.json``.
The loader is the package's ``ResumableLoader``, or with ``--loader stateful`` torchdata's
shuffling ``StatefulDataLoader``, so a fit resumed mid-epoch goes on with the next batch, as
Lightning resumes on one device. ``--straight-out DIR2`` fits once more
in the same launch, from scratch without a signal, into ``DIR2`` (the uninterrupted reference).
The tests call ``main(argv)`` on ranks forked from their own process
(``tests.runtime.launched``), which form a process group of their own.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import TensorDataset  # noqa: E402

from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint  # noqa: E402
from pl_pipedream.core import preemption  # noqa: E402
from pl_pipedream.data.resumable import ResumableLoader  # noqa: E402
from tests.strategy.test_lightning_features import Net  # noqa: E402

BATCHES = 24  # per epoch


def data(loader: str = "resumable") -> Any:
    """The training loader; a ``stateful`` one shuffles with a generator seeded from the global
    RNG when it is made (seed it first)."""
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(4 * BATCHES, 6, generator=generator)
    y = x[:, :3] - 0.5 * x[:, 3:]
    if loader == "stateful":
        from torchdata.stateful_dataloader import StatefulDataLoader

        return StatefulDataLoader(TensorDataset(x, y), batch_size=4, shuffle=True)
    return ResumableLoader(TensorDataset(x, y), batch_size=4, shuffle=False)


class Signal(Callback):
    """At global step ``at``: SIGTERM to rank 1 alone, or to the whole process group."""

    def __init__(self, at: int, target: str, out: Path) -> None:
        self.at, self.target, self.out = at, target, out

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_step != self.at:
            return
        if self.target == "rank1" and trainer.global_rank == 1:
            (self.out / "signalled").write_text(str(time.time()))
            os.kill(os.getpid(), signal.SIGTERM)
        if self.target == "group" and trainer.global_rank == 0:
            (self.out / "signalled").write_text(str(time.time()))
            os.killpg(os.getpgid(0), signal.SIGTERM)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--sync", default="flush")
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--signal-at", type=int, default=-1)
    parser.add_argument("--target", choices=("rank1", "group"), default="rank1")
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--straight-out", default=None, help="then fit uninterrupted into it")
    parser.add_argument("--agree-every-step", action="store_true", help="a known stop step")
    parser.add_argument("--loader", choices=("resumable", "stateful"), default="resumable")
    args = parser.parse_args(argv)
    if args.agree_every_step:  # the ranks agree at every step: they stop 3 steps after the signal
        preemption.MAX_PERIOD = 1
    run = (args.sync, args.epochs, args.target, args.loader)
    fit(Path(args.out), *run, signal_at=args.signal_at, resume=args.resume)
    if args.straight_out is not None:
        fit(Path(args.straight_out), *run, signal_at=-1, resume=False)


def fit(
    out: Path, sync: str, epochs: int, target: str, loader: str, signal_at: int, resume: bool
) -> None:
    ckpts = out / "ckpts"
    out.mkdir(parents=True, exist_ok=True)
    saver = ModelCheckpoint(dirpath=ckpts, save_last=True, save_top_k=0)
    torch.manual_seed(0)
    model = Net(optimizer="adam")
    strategy = PipeDreamStrategy(
        sync=sync, balance=[3, 3], microbatches=2, timeout=60, divergence="off"
    )
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[saver, Signal(signal_at, target, out)],
    )
    try:
        trainer.fit(model, data(loader), ckpt_path="last" if resume else None)
    except SystemExit as stopped:
        record = {"code": stopped.code, "time": time.time(), "step": trainer.global_step}
        (out / f"exit-rank{trainer.global_rank}.json").write_text(json.dumps(record))
        raise
    if trainer.is_global_zero:
        torch.save(consolidate_checkpoint(ckpts / "last.ckpt"), out / "weights.pt")


if __name__ == "__main__":
    main()
