"""Validation accuracy of the staleness corrections, simulated on one process with the oracle.

The digits MLP of issue 13 (flatten, Linear+ReLU per hidden width (default 128, 128, 64: the
default model config), Linear to 10 classes; its pipeline layers cut evenly into 3 stages), SGD
lr 0.03 momentum 0.9, batch 32 (one microbatch), 15 epochs of scikit-learn's digits (the
project's seeded 70/15/15 split and per-epoch shuffling), trained by ``tests/runtime/oracle.py``
(the update rules of docs/guide.md on one process, minibatch after minibatch, no drain between
epochs) under: one device (``flush``), ``async``, ``async`` with weight prediction, ``async``
with the learning-rate warm-up per delay, and both. Prints the final validation accuracy of
each, per seed (the split, the shuffling and the initial weights) and their mean.

    PYTHONPATH=. python benchmarks/staleness_oracle.py [--epochs 15] [--lr 0.03] [--seeds 3]
        [--warmup 20] [--hidden 128 128 64]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

from pl_pipedream.data.digits import DigitsDataModule
from pl_pipedream.models.mlp import MLP
from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--epochs", type=int, default=15)
    parser.add_argument("--lr", type=float, default=0.03)
    parser.add_argument("--momentum", type=float, default=0.9)
    parser.add_argument("--warmup", type=int, default=20, help="lr_warmup_per_delay")
    parser.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 (data and model)")
    parser.add_argument("--hidden", type=int, nargs="+", default=[128, 128, 64])
    args = parser.parse_args()

    runs = {
        "one device (flush)": ("flush", False, 0),
        "async": ("async", False, 0),
        "async + weight_prediction": ("async", True, 0),
        f"async + lr_warmup_per_delay={args.warmup}": ("async", False, args.warmup),
        "async + both": ("async", True, args.warmup),
    }
    results: dict[str, list[float]] = {label: [] for label in runs}
    for seed in range(args.seeds):
        for label, accuracy in _seed(args, seed, runs).items():
            results[label].append(accuracy)
    for label, accuracies in results.items():
        shown = " ".join(f"{a:.3f}" for a in accuracies)
        print(f"{label:<36} mean val_acc {sum(accuracies) / len(accuracies):.3f}  ({shown})")


def _seed(args: argparse.Namespace, seed: int, runs: dict) -> dict[str, float]:  # type: ignore[type-arg]
    """The final validation accuracy of every run on one seed of the split, order and weights."""
    data = DigitsDataModule(batch_size=32, seed=seed)
    data.setup("fit")
    batches = [batch for _ in range(args.epochs) for batch in data.train_dataloader()]
    val = list(data.val_dataloader())
    torch.manual_seed(seed)
    model = MLP((1, 8, 8), 10, hidden=args.hidden).pipeline
    layers = len(model)
    balance = [layers // 3 + (1 if k < layers % 3 else 0) for k in range(3)]
    plan = Plan.from_balance(balance)

    def sgd(params: list[nn.Parameter]) -> torch.optim.Optimizer:
        return torch.optim.SGD(params, lr=args.lr, momentum=args.momentum)

    if seed == 0:
        print(
            f"digits MLP {len(args.hidden) + 1} Linear layers (hidden {args.hidden}), 3 stages "
            f"{balance}, SGD lr {args.lr} momentum {args.momentum}, batch 32, {args.epochs} "
            f"epochs ({len(batches)} minibatches), seeds 0..{args.seeds - 1}"
        )
    out = {}
    for label, (sync, prediction, warmup) in runs.items():
        state = oracle.train(
            model, plan, sync, batches, 1, nn.functional.cross_entropy, sgd, prediction, warmup
        )
        trained = MLP((1, 8, 8), 10, hidden=args.hidden).pipeline
        trained.load_state_dict(state)
        out[label] = _accuracy(trained, val)
    return out


@torch.no_grad()
def _accuracy(model: nn.Module, batches: list) -> float:  # type: ignore[type-arg]
    right = total = 0
    for x, y in batches:
        right += int((model(x).argmax(dim=1) == y).sum())
        total += len(y)
    return right / total


if __name__ == "__main__":
    main()
