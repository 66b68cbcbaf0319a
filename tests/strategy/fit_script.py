"""Train a small pipelined MLP with PipeDreamStrategy, as a user's script would.

Run as ``python tests/strategy/fit_script.py --sync async --balance 3 3 --microbatches 2 --out
DIR``: Lightning's script launcher starts the other ranks by re-running this file. Every rank
saves the sharded checkpoint; rank 0 consolidates it into ``DIR/weights.pt``. ``--model
seq2seq`` trains the Seq2Seq example instead (SGD as ``tests.runtime.test_boundary.sgd``),
with the model summary on, and validates through the pipeline afterwards (``val_loss`` in
``done.json``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pl_pipedream  # noqa: E402
from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint  # noqa: E402
from pl_pipedream.models.seq2seq import Seq2Seq  # noqa: E402
from tests.runtime.test_boundary import seq2seq_batches  # noqa: E402
from tests.runtime.test_executor import make_batches  # noqa: E402
from tests.strategy.test_lightning_features import Net  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--configs", nargs="+", default=["async:sgd"], help="sync:optimizer pairs, run in turn"
    )
    parser.add_argument("--balance", type=int, nargs="+", default=[3, 3])
    parser.add_argument("--replicas", type=int, nargs="+", default=None)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--strategy-name", action="store_true", help='use strategy="pipedream"')
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2, help="with --balance 0")
    parser.add_argument(
        "--share-device",
        action="store_true",
        help="every rank on one device: cuda:0 with --accelerator gpu (gloo: NCCL refuses that)",
    )
    parser.add_argument("--model", choices=("mlp", "seq2seq"), default="mlp")
    parser.add_argument("--weight-prediction", action="store_true")
    parser.add_argument("--lr-warmup-per-delay", type=int, default=0)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    for config in args.configs:
        sync, optimizer = config.split(":")
        fit(args, sync, optimizer, Path(args.out) / f"{sync}-{optimizer}")


class RecordCpus(Callback):
    """Writes the cores each thread of this rank may use while training to ``cpus-rank{r}.json``."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_start(self, trainer: Trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        record = {
            "binding": sorted(trainer.strategy.cpu_binding or ()),
            "threads": thread_cpus(),
        }
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / f"cpus-rank{trainer.global_rank}.json").write_text(json.dumps(record))


def seq2seq_net() -> Seq2Seq:
    """The Seq2Seq example as ``tests.runtime.test_boundary.seq2seq_model`` builds its layers."""
    torch.manual_seed(0)
    return Seq2Seq((6,), 12, hidden=8, optimizer="sgd", lr=0.05, momentum=0.5)


def seq2seq_loader(m: int, batch_size: int) -> DataLoader:
    """``seq2seq_batches(m)`` as (source, decoder input, target) rows, in order."""
    batches = seq2seq_batches(m)
    columns = [torch.cat([b[0][0] for b in batches]), torch.cat([b[0][1] for b in batches])]
    data = TensorDataset(*columns, torch.cat([b[1] for b in batches]))
    return DataLoader(data, batch_size=batch_size, shuffle=False)


def thread_cpus() -> list[list[int]]:
    """The cores of every thread of this process."""
    return [sorted(os.sched_getaffinity(int(tid))) for tid in os.listdir("/proc/self/task")]


def fit(args: argparse.Namespace, sync: str, optimizer: str, out: Path) -> None:
    m = args.microbatches
    corrections = {}  # only when asked: the other modes refuse them
    if args.weight_prediction:
        corrections["weight_prediction"] = True
    if args.lr_warmup_per_delay:
        corrections["lr_warmup_per_delay"] = args.lr_warmup_per_delay
    if args.model == "seq2seq":
        module, loader = seq2seq_net(), seq2seq_loader(m, 2 * m)
    else:
        batches = make_batches(m)
        data = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
        module, loader = Net(optimizer), DataLoader(data, batch_size=2 * m, shuffle=False)
    if args.balance == [0]:  # plan automatically at setup
        strategy = (
            "pipedream"
            if args.strategy_name
            else PipeDreamStrategy(sync=sync, microbatches=m, timeout=60)
        )
        devices = args.devices
    elif args.replicas:
        plan = pl_pipedream.Plan.from_balance(args.balance, replicas=args.replicas)
        strategy = PipeDreamStrategy(
            sync=sync, plan=plan, microbatches=m, timeout=60, **corrections
        )
        devices = plan.num_workers
    elif args.share_device:
        one = torch.device("cuda", 0) if args.accelerator == "gpu" else torch.device("cpu")
        strategy = PipeDreamStrategy(
            sync=sync,
            balance=args.balance,
            microbatches=m,
            timeout=60,
            parallel_devices=[one] * len(args.balance),
            process_group_backend="gloo",
            **corrections,
        )
        devices = 1
    else:
        strategy = PipeDreamStrategy(
            sync=sync, balance=args.balance, microbatches=m, timeout=60, **corrections
        )
        devices = len(args.balance)
    trainer = Trainer(
        strategy=strategy,
        accelerator=args.accelerator,
        devices=devices,
        max_epochs=1,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=args.model == "seq2seq",  # its shape forward on every rank
        logger=False,
        enable_checkpointing=False,
        callbacks=[RecordCpus(out)] if hasattr(os, "sched_getaffinity") else [],
    )
    trainer.fit(module, loader)
    trainer.save_checkpoint(out / "run.ckpt")
    validated = trainer.validate(module, loader, verbose=False) if args.model == "seq2seq" else []
    if trainer.is_global_zero:
        torch.save(consolidate_checkpoint(out / "run.ckpt"), out / "weights.pt")
        loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
        (out / "done.json").write_text(
            json.dumps(
                {
                    "global_step": trainer.global_step,
                    "loss": loss,
                    "val_loss": validated[0]["val_loss"] if validated else None,
                    "threads_after": thread_cpus() if hasattr(os, "sched_getaffinity") else [],
                }
            )
        )


if __name__ == "__main__":
    main()
