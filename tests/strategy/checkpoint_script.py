"""Train with ``ModelCheckpoint(save_top_k=2, save_last=True)`` every epoch, as a user's script
would, optionally with rank 1 stopping in the middle of a save.

Run as ``python tests/strategy/checkpoint_script.py --out DIR [--resume CKPT] [--block]``:
Lightning's script launcher starts rank 1 by re-running this file. Checkpoints go to
``DIR/ckpts``; rank 0 consolidates ``last.ckpt`` into ``DIR/weights.pt`` at the end. With
``--block``, rank 1 writes half of its shard of the second ``last.ckpt`` save (the end of epoch
1), writes its process id to ``DIR/blocked`` and sleeps, so that the test can kill it mid-save.
``--straight-out DIR2`` fits once more in the same launch, from scratch, into ``DIR2`` (the
uninterrupted reference). The tests call ``main(argv)`` on ranks forked from their own process
(``tests.runtime.launched``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint  # noqa: E402
from pl_pipedream.core import checkpoint  # noqa: E402
from pl_pipedream.core.atomic import staging_dir  # noqa: E402
from tests.strategy.test_lightning_features import Net, loader  # noqa: E402


def block_second_save_of(last: Path, out: Path) -> None:
    """Make this rank's writes stop halfway through its shard of the second save of ``last``."""
    write, prefix, saves = checkpoint.write_file, staging_dir(last, "").name, []

    def blocking_write(path: Path, data: bytes) -> None:
        if path.parent.name.startswith(prefix) and path.suffix == ".pt":
            saves.append(path)
            if len(saves) == 2:
                with open(path, "wb") as file:
                    file.write(data[: len(data) // 2])
                (out / "blocked").write_text(str(os.getpid()))
                time.sleep(600)
        write(path, data)

    checkpoint.write_file = blocking_write


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--block", action="store_true")
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--straight-out", default=None, help="then fit from scratch into it")
    args = parser.parse_args(argv)
    fit(Path(args.out), args.epochs, args.resume, args.block, args.timeout)
    if args.straight_out is not None:
        fit(Path(args.straight_out), args.epochs, None, False, args.timeout)


def fit(out: Path, epochs: int, resume: str | None, block: bool, timeout: float) -> None:
    ckpts = out / "ckpts"
    if block and os.environ.get("LOCAL_RANK", "0") == "1":
        block_second_save_of(ckpts / "last.ckpt", out)
    saver = ModelCheckpoint(dirpath=ckpts, save_top_k=2, monitor="step", mode="max", save_last=True)
    strategy = PipeDreamStrategy(sync="flush", balance=[3, 3], microbatches=2, timeout=timeout)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=epochs,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[saver],
    )
    trainer.fit(Net(optimizer="adam"), loader(2), ckpt_path=resume)
    if trainer.is_global_zero:
        torch.save(consolidate_checkpoint(ckpts / "last.ckpt"), out / "weights.pt")


if __name__ == "__main__":
    main()
