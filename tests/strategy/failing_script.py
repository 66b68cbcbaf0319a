"""A pipelined run that goes wrong on purpose: ``--fail nan`` (the loss becomes NaN on step 2),
``--fail die`` (the last stage's process exits in step 2), ``--fail after-fit`` (rank 1 raises
in the user's code after ``trainer.fit`` returned, when rank 0 has finished), ``--fail
hang-after-fit`` (rank 1 never ends after ``fit``) or ``--fail kill`` (rank ``--rank`` SIGKILLs
itself in step ``--at``); ``--devices`` ranks (2 or 4 in a straight pipeline, 3 with the last
stage's two replicas on ranks 1 and 2); ``--divergence`` and ``--timeout`` are the strategy's
options of those names. Used by test_errors.py and test_launcher.py, as a user's script or as
``main(argv)`` on ranks forked from the test's process (``launched``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.planner.plan import Plan  # noqa: E402
from tests.strategy.test_lightning_features import Net, loader, trainer  # noqa: E402


class Failing(Net):
    def __init__(self, fail: str, rank: int = -1, at: int = 2) -> None:
        super().__init__(optimizer="sgd")
        self.fail = fail
        self.kill_rank = rank
        self.kill_at = at

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        loss = super().training_step(batch, batch_idx)
        if batch_idx == 2 and self.fail == "nan":
            return loss * torch.tensor(float("nan"))
        if batch_idx == 2 and self.fail == "die":
            os._exit(3)
        return loss

    def on_train_batch_start(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        if self.fail == "kill" and batch_idx == self.kill_at:
            if self.trainer.global_rank == self.kill_rank:
                os.kill(os.getpid(), signal.SIGKILL)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    fails = ["nan", "die", "after-fit", "hang-after-fit", "kill"]
    parser.add_argument("--fail", choices=fails, required=True)
    parser.add_argument("--divergence", default="error")
    parser.add_argument("--devices", type=int, choices=[2, 3, 4], default=2)
    parser.add_argument("--timeout", type=float, default=20)
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--at", type=int, default=2)
    args = parser.parse_args(argv)
    layout: dict = {"balance": [3, 3] if args.devices == 2 else [2, 2, 1, 1]}
    if args.devices == 3:
        layout = {"plan": Plan.from_balance([3, 3], replicas=[1, 2])}
    strategy = PipeDreamStrategy(
        sync="async",
        **layout,
        microbatches=2,
        timeout=args.timeout,
        divergence=args.divergence,
    )
    fitter = trainer(devices=args.devices, strategy=strategy)
    fitter.fit(Failing(args.fail, args.rank, args.at), loader(2))
    if args.fail == "after-fit" and fitter.global_rank == 1:
        time.sleep(2.0)  # rank 0 has finished by now
        raise RuntimeError("the user's code failed on rank 1 after fit")
    if args.fail == "hang-after-fit" and fitter.global_rank == 1:
        time.sleep(3600)


if __name__ == "__main__":
    main()
