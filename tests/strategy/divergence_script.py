"""The divergence check's cases, each as a user's script with the strategy's defaults otherwise
(``divergence="error"`` unless ``--divergence`` says):

* ``newcomer`` (issue 13): the digits MLP of 6 pipeline layers on 3 stages, SGD lr 0.1 with
  ``--momentum``, batch 32: with momentum 0.9 ``async`` diverges (one device reaches 0.98);
* ``noise`` (issue 21): regression on random targets on 2 stages (nothing to learn, a loss that
  only fluctuates), SGD lr 0.01 momentum 0.9, batch 16;
* ``nan-data`` (issue 21): the newcomer's model and data with momentum 0, one training example's
  input made NaN (the 3rd batch of the first epoch holds it: no shuffling).

Run as ``python tests/strategy/divergence_script.py --case newcomer --sync async --epochs 2``;
Lightning's script launcher starts the other ranks by re-running it. Rank 0 writes the final
``val_acc`` (``val_loss`` for ``noise``) to ``finished`` in ``--out`` (the working directory
unless given) when the fit ends without an error.

``--scenarios NAME:CASE:SYNC:MOMENTUM:EPOCHS ...`` fits each scenario in turn in one launch
(cases of one stage count, under the ``divergence`` given), each in a folder ``NAME`` of ``--out``:
every rank writes what it printed to stderr during that fit to ``NAME/stderr-rank{r}``
(warnings shown afresh per scenario), and rank 0 writes ``NAME/finished``. The tests call
``main(argv)`` on ranks forked from their own process (``tests.runtime.launched``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from pl_pipedream import PipeDreamStrategy  # noqa: E402
from pl_pipedream.data import DigitsDataModule  # noqa: E402
from pl_pipedream.models import MLP  # noqa: E402


class NanData(DigitsDataModule):
    """The digits, in order, with the first example of training batch 2 made NaN."""

    def train_dataloader(self) -> DataLoader:
        x, y = (torch.stack(t) for t in zip(*self.splits["train"], strict=True))
        x[2 * self.batch_size, 0, 3, 3] = float("nan")
        return DataLoader(TensorDataset(x, y), self.batch_size, drop_last=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=("newcomer", "noise", "nan-data"), default="newcomer")
    parser.add_argument("--sync", default="async")
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--epochs", type=int, default=1)
    parser.add_argument("--divergence", default="error")
    parser.add_argument("--scenarios", nargs="*", default=[], help="NAME:CASE:SYNC:MOMENTUM:EPOCHS")
    parser.add_argument("--out", default=".", help="the folder of finished and the scenarios'")
    args = parser.parse_args(argv)
    out = Path(args.out)
    if not args.scenarios:
        fit(args.case, args.sync, args.momentum, args.epochs, args.divergence, out / "finished")
    for scenario in args.scenarios:
        name, case, sync, momentum, epochs = scenario.split(":")
        folder = out / name
        folder.mkdir(exist_ok=True)
        rank = int(os.environ.get("LOCAL_RANK", "0"))  # unset on rank 0 until its first fit
        with warnings.catch_warnings(), stderr_to(folder / f"stderr-rank{rank}"):
            fit(case, sync, float(momentum), int(epochs), args.divergence, folder / "finished")


@contextlib.contextmanager
def stderr_to(path: Path) -> Iterator[None]:
    """Points this process's file descriptor 2 (Python's and C's writes alike) at ``path``."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "w") as file:
        os.dup2(file.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def fit(
    case: str, sync: str, momentum: float, epochs: int, divergence: str, finished: Path
) -> None:
    torch.manual_seed(0)
    if case == "noise":
        sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
        from convergence import noise_regression

        model, data = noise_regression(16)
        balance, metric = [3, 2], "val_loss"
    else:
        momentum = 0.0 if case == "nan-data" else momentum
        model = MLP((1, 8, 8), 10, hidden=(128, 128), optimizer="sgd", lr=0.1, momentum=momentum)
        data = (NanData if case == "nan-data" else DigitsDataModule)(batch_size=32)
        balance, metric = [2, 2, 2], "val_acc"
    strategy = PipeDreamStrategy(sync=sync, balance=balance, timeout=60, divergence=divergence)
    trainer = Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=len(balance),
        max_epochs=epochs,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        logger=False,
    )
    trainer.fit(model, datamodule=data)
    if trainer.global_rank == 0:
        finished.write_text(str(float(trainer.callback_metrics[metric])))


if __name__ == "__main__":
    main()
