"""Fit two stages for one epoch, then ``trainer.predict``; every rank saves what ``predict``
returned and its own copy of the trained weights (``--out``). Used by test_evaluation.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from tests.strategy.test_lightning_features import Net, loader, trainer  # noqa: E402


class Predicting(Net):
    def predict_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, _ = batch
        return {"logits": self(x), "batch": batch_idx}


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    strategy = PipeDreamStrategy(sync="flush", balance=[3, 3], microbatches=2, timeout=60)
    model = Predicting(optimizer="sgd")
    fitter = trainer(devices=2, strategy=strategy)
    fitter.fit(model, loader(2))
    got = fitter.predict(model, loader(2))
    torch.save(got, Path(args.out) / f"predictions-{fitter.global_rank}.pt")
    if fitter.global_rank == 0:
        torch.save(fitter.strategy.lightning_module_state_dict(), Path(args.out) / "stage-0.pt")
    else:
        torch.save(fitter.strategy.lightning_module_state_dict(), Path(args.out) / "stage-1.pt")
