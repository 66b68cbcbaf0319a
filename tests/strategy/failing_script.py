"""A pipelined run that goes wrong on purpose: ``--fail nan`` (the loss becomes NaN on step 2),
``--fail die`` (the last stage's process exits in step 2) or ``--fail after-fit`` (rank 1 raises
in the user's code after ``trainer.fit`` returned, when rank 0 has finished); ``--divergence`` is
the strategy's option of that name. Used by test_errors.py and test_exits.py."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from tests.strategy.test_lightning_features import Net, loader, trainer  # noqa: E402


class Failing(Net):
    def __init__(self, fail: str) -> None:
        super().__init__(optimizer="sgd")
        self.fail = fail

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2 and self.fail == "nan":
            return loss * torch.tensor(float("nan"))
        if batch_idx == 2 and self.fail == "die":
            os._exit(3)
        return loss


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--fail", choices=["nan", "die", "after-fit"], required=True)
    parser.add_argument("--divergence", default="error")
    args = parser.parse_args()
    strategy = PipeDreamStrategy(
        sync="async", balance=[3, 3], microbatches=2, timeout=20, divergence=args.divergence
    )
    fitter = trainer(devices=2, strategy=strategy)
    fitter.fit(Failing(args.fail), loader(2))
    if args.fail == "after-fit" and fitter.global_rank == 1:
        import time

        time.sleep(2.0)  # rank 0 has finished by now
        raise RuntimeError("the user's code failed on rank 1 after fit")
