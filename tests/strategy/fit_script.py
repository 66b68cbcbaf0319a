"""Train a small pipelined MLP with PipeDreamStrategy, as a user's script would.

Run as ``python tests/strategy/fit_script.py --sync async --balance 3 3 --microbatches 2 --out
DIR``: Lightning's script launcher starts the other ranks by re-running this file. Every rank
saves the sharded checkpoint; rank 0 consolidates it into ``DIR/weights.pt``. ``--model
seq2seq`` trains the Seq2Seq example instead (SGD as ``tests.runtime.test_boundary.sgd``),
with the model summary on, and validates through the pipeline afterwards (``val_loss`` in
``done.json``). ``--model deep`` trains ``deep_model(sum(balance))``, one Linear block per
layer, so a straight pipeline may have as many stages as it has layers (8 processes and more).
``--kill-rank R --kill-at K`` runs one more fit (``async``) after the configs, in which rank R
SIGKILLs itself at the start of step K: the command then ends with the launcher's report.
``--start-method fork`` (or ``main(argv, )`` from a test's own process) forks the ranks instead
of re-running the script; each rank saves at the end of training either way (``SaveAtEnd``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from lightning.pytorch import Callback, Trainer  # noqa: E402
from torch import nn  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import pl_pipedream  # noqa: E402
from pl_pipedream import PipeDreamStrategy, consolidate_checkpoint  # noqa: E402
from pl_pipedream.models.seq2seq import Seq2Seq  # noqa: E402
from tests.runtime.test_boundary import seq2seq_batches  # noqa: E402
from tests.runtime.test_executor import make_batches  # noqa: E402
from tests.strategy.test_lightning_features import Net  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--configs", nargs="*", default=["async:sgd"], help="sync:optimizer pairs, run in turn"
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
    parser.add_argument("--model", choices=("mlp", "seq2seq", "deep"), default="mlp")
    parser.add_argument("--weight-prediction", action="store_true")
    parser.add_argument("--lr-warmup-per-delay", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=60, help="the strategy's, in seconds")
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-at", type=int, default=2)
    parser.add_argument("--start-method", default="popen", choices=("popen", "fork", "spawn"))
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    for config in args.configs:
        sync, optimizer = config.split(":")
        fit(args, sync, optimizer, Path(args.out) / f"{sync}-{optimizer}")
    if args.kill_rank is not None:
        killer = KillAt(args.kill_rank, args.kill_at)
        fit(args, "async", "sgd", Path(args.out) / "killed", [killer])


class SaveAtEnd(Callback):
    """At the end of training, on every rank: the sharded checkpoint; rank 0 consolidates it
    and writes ``done.json`` (the step and the loss)."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer: Trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        trainer.save_checkpoint(self.out / "run.ckpt")
        if trainer.is_global_zero:
            torch.save(consolidate_checkpoint(self.out / "run.ckpt"), self.out / "weights.pt")
            loss = float(trainer.callback_metrics.get("train_loss", float("nan")))
            done = {"global_step": trainer.global_step, "loss": loss}
            (self.out / "done.json").write_text(json.dumps(done))


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


class KillAt(Callback):
    """Rank ``rank`` sends itself SIGKILL at the start of training step ``step``."""

    def __init__(self, rank: int, step: int) -> None:
        self.rank, self.step = rank, step

    def on_train_batch_start(self, trainer: Trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if trainer.global_rank == self.rank and batch_idx == self.step:
            os.kill(os.getpid(), signal.SIGKILL)


def deep_model(layers: int) -> nn.Sequential:
    """``layers`` pipeline layers of ``make_model``'s widths (6 in, 8 wide, 3 out), each a
    Linear (with a Tanh but the last), so that every stage of a one-layer-per-stage pipeline has
    weights to update and stash."""
    torch.manual_seed(0)
    widths = [6, *[8] * (layers - 1), 3]
    blocks: list[nn.Module] = [
        nn.Sequential(nn.Linear(a, b), nn.Tanh())
        for a, b in zip(widths[:-2], widths[1:-1], strict=True)
    ]
    return nn.Sequential(*blocks, nn.Linear(widths[-2], widths[-1]))


class DeepNet(Net):
    """``Net`` over ``deep_model(layers)``."""

    def __init__(self, layers: int, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.net = deep_model(layers)


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


def fit(
    args: argparse.Namespace,
    sync: str,
    optimizer: str,
    out: Path,
    callbacks: list[Callback] | None = None,
) -> None:
    m = args.microbatches
    launch = {"start_method": args.start_method}
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
        module = DeepNet(sum(args.balance), optimizer) if args.model == "deep" else Net(optimizer)
        loader = DataLoader(data, batch_size=2 * m, shuffle=False)
    if args.balance == [0]:  # plan automatically at setup
        strategy = (
            "pipedream"
            if args.strategy_name
            else PipeDreamStrategy(sync=sync, microbatches=m, timeout=args.timeout, **launch)
        )
        devices = args.devices
    elif args.replicas:
        plan = pl_pipedream.Plan.from_balance(args.balance, replicas=args.replicas)
        strategy = PipeDreamStrategy(
            sync=sync, plan=plan, microbatches=m, timeout=args.timeout, **corrections, **launch
        )
        devices = plan.num_workers
    elif args.share_device:
        one = torch.device("cuda", 0) if args.accelerator == "gpu" else torch.device("cpu")
        strategy = PipeDreamStrategy(
            sync=sync,
            balance=args.balance,
            microbatches=m,
            timeout=args.timeout,
            parallel_devices=[one] * len(args.balance),
            process_group_backend="gloo",
            **corrections,
            **launch,
        )
        devices = 1
    else:
        strategy = PipeDreamStrategy(
            sync=sync,
            balance=args.balance,
            microbatches=m,
            timeout=args.timeout,
            **corrections,
            **launch,
        )
        chunks = 2 if sync in ("interleaved", "zbv") else 1  # stages per rank
        devices = len(args.balance) // chunks
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
        callbacks=[
            SaveAtEnd(out),
            *(callbacks or []),
            *([RecordCpus(out)] if hasattr(os, "sched_getaffinity") else []),
        ],
    )
    trainer.fit(module, loader)
    validated = trainer.validate(module, loader, verbose=False) if args.model == "seq2seq" else []
    if trainer.is_global_zero:  # rank 0's process (popen), or the one that forked the ranks
        done = json.loads((out / "done.json").read_text())
        done["val_loss"] = validated[0]["val_loss"] if validated else None
        done["threads_after"] = thread_cpus() if hasattr(os, "sched_getaffinity") else []
        (out / "done.json").write_text(json.dumps(done))


if __name__ == "__main__":
    main()
