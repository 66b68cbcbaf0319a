"""Issue 13's newcomer, as a user's script: the digits MLP of 6 pipeline layers on 3 stages, SGD
lr 0.1, batch 32, the strategy's defaults otherwise (divergence="error").

Run as ``python tests/strategy/divergence_script.py --sync async --momentum 0.9 --epochs 1``;
Lightning's script launcher starts ranks 1 and 2 by re-running it. Rank 0 writes the final
``val_acc`` to ``finished`` in the working directory when the fit ends without an error.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.data import DigitsDataModule  # noqa: E402
from pl_pipedream.models import MLP  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", default="async")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=1)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = MLP((1, 8, 8), 10, hidden=(128, 128), optimizer="sgd", lr=0.1, momentum=args.momentum)
    trainer = Trainer(
        strategy=PipeDreamStrategy(sync=args.sync, balance=[2, 2, 2], timeout=60),
        accelerator="cpu",
        devices=3,
        max_epochs=args.epochs,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=32))
    if trainer.global_rank == 0:
        Path("finished").write_text(str(float(trainer.callback_metrics["val_acc"])))


if __name__ == "__main__":
    main()
