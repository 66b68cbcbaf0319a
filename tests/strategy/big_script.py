"""Train a chain of wide Linear layers built empty, as a user's script would, under a memory cap.

Run as ``python tests/strategy/big_script.py --build configure --devices 2 --out DIR [--cap-mb
N] [--balance 4 4]``. ``--cap-mb`` sets ``RLIMIT_DATA`` first thing, so every rank (Lightning's
script launcher re-runs this file per rank) runs under it. ``--build``: ``configure`` builds the
layers in ``configure_model()``, ``init_module`` under ``trainer.init_module(empty_init=True)``,
``whole`` in ``__init__`` as usual, ``alone`` only builds the whole model in this process (no
Trainer) and reports whether that fits. Each rank writes ``rank{r}.json`` (peak RSS, its data
size, its stage, the balance) and with ``--save`` ``weights-rank{r}.pt`` (its stage's parameters
after training). ``--tie`` ties the last layer's weight to the first's (a tie across stages).
``--builds B ...`` fits each of those builds in turn in one launch, each writing to ``DIR/B``.

``--case "ARGS" ...`` runs each of those runs in turn (their arguments, ``--out`` among them) in
this process, after ``--cap-mb``, which its children inherit: ``alone`` in a child of its own,
any other on ``--devices`` ranks forked from this process as a launcher's ranks
(``tests.runtime.launched``), so that torch and Lightning are imported once for them all. Each
run writes ``ended.json`` (``status``: the child's exit status, or 1 when a rank failed, and
``errors``) into its ``--out``, and the ranks' output is relayed to this process's. The tests
call ``main(argv)`` on forked ranks as well.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def cap(megabytes: int) -> None:
    limit = megabytes * 2**20
    resource.setrlimit(resource.RLIMIT_DATA, (limit, limit))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser()
    builds = ("configure", "init_module", "whole", "alone")
    parser.add_argument("--build", choices=builds)
    parser.add_argument("--builds", choices=builds[:3], nargs="*", default=[], help="in turn")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--balance", type=int, nargs="*", default=None)
    parser.add_argument("--width", type=int, default=64)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--trainable", type=int, default=1, help="every k-th layer trains")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--sync", default="flush")
    parser.add_argument("--cap-mb", type=int, default=0)
    parser.add_argument("--save", action="store_true", help="write each rank's weights")
    parser.add_argument("--tie", action="store_true", help="tie the last weight to the first")
    parser.add_argument("--out", default=None, help="required but with --case")
    parser.add_argument("--case", action="append", default=[], help="one run's arguments")
    args = parser.parse_args(argv)
    if args.cap_mb:
        cap(args.cap_mb)
    for case in args.case:  # each under this process's cap, which its children inherit
        settings = vars(parser.parse_args(shlex.split(case)))
        forked(argparse.Namespace(**{**settings, "cap_mb": args.cap_mb}))
    if args.case:
        return
    if args.out is None:
        parser.error("--out is required")
    if not args.builds:
        run(args)
    for build in args.builds:
        run(argparse.Namespace(**{**vars(args), "build": build, "out": f"{args.out}/{build}"}))


def forked(args: argparse.Namespace) -> None:
    """The run ``args`` on processes forked from this one, its end in ``ended.json``."""
    from tests.runtime.launched import launch

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    errors = ""
    if args.build == "alone":
        pid = os.fork()
        if pid == 0:
            status = 0
            try:
                run(args)
            except SystemExit as exit:
                status = exit.code if isinstance(exit.code, int) else 1
            except BaseException:  # noqa: BLE001 - reported as this child's status
                traceback.print_exc()
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    else:
        ends = launch(args.devices, lambda _: run(args), folder=out / "ranks", timeout=600)
        for end in ends:  # as a launcher relays its ranks' output
            sys.stdout.write(end.stdout)
            sys.stderr.write(end.stderr)
        errors = "".join(
            f"rank {r}: {end.error or end.code}" for r, end in enumerate(ends) if end.code != 0
        )
        status = 1 if errors else 0
    (out / "ended.json").write_text(json.dumps({"status": status, "errors": errors}))


def run(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from pl_pipedream import PipeDreamStrategy

    class Chain(LightningModule):
        """``layers`` Linear(width) layers; only every ``trainable``-th one trains (the others
        are frozen, as in fine-tuning), so that a stage's gradients stay small."""

        def __init__(self, build_now: bool) -> None:
            super().__init__()
            self.layers: nn.Sequential | None = None
            if build_now:
                self.build()

        def build(self) -> None:
            linears = (nn.Linear(args.width, args.width) for _ in range(args.layers))
            self.layers = nn.Sequential(*linears)
            self.built_on_meta = self.layers[0].weight.is_meta
            for index, layer in enumerate(self.layers):
                layer.requires_grad_(index % args.trainable == 0)
            if args.tie:  # the last layer's weight is the first's (stages 0 and last)
                self.layers[-1].weight = self.layers[0].weight

        def configure_model(self) -> None:
            if self.layers is None:
                self.build()

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            loss = nn.functional.mse_loss(self(x), y)
            self.log("loss", loss)
            return loss

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            trained = [p for p in self.parameters() if p.requires_grad]
            return torch.optim.SGD(trained, lr=0.5)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    if args.build == "alone":
        try:
            Chain(build_now=True)
        except (MemoryError, RuntimeError) as error:
            print(f"OUT OF MEMORY: {type(error).__name__}: {error}")
            sys.exit(3)
        print("BUILT")
        return
    strategy = PipeDreamStrategy(
        sync=args.sync, balance=args.balance, microbatches=2, timeout=120, divergence="off"
    )
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices, max_steps=args.steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False,
    )  # fmt: skip
    if args.build == "init_module":
        with trainer.init_module(empty_init=True):
            model = Chain(build_now=True)
    else:
        model = Chain(build_now=args.build == "whole")
    data = torch.Generator().manual_seed(1)
    x = torch.randn(8 * args.steps, args.width, generator=data)
    y = torch.randn(8 * args.steps, args.width, generator=data)
    trainer.fit(model, DataLoader(TensorDataset(x, y), batch_size=8))
    rank = trainer.global_rank
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    status = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines())
    report = {"rank": rank, "peak_rss": usage, "stage": strategy.session.local.stage.index}
    report["vm_data"] = int(status["VmData"].split()[0]) * 1024
    report["built_on_meta"] = model.built_on_meta
    if args.save:
        local = {n: p.detach() for n, p in model.named_parameters() if not p.is_meta}
        torch.save(local, out / f"weights-rank{rank}.pt")
    report["balance"] = [len(s.nodes) for s in strategy.plan.stages]
    print(
        f"rank {rank}: peak RSS {usage / 2**20:.0f} MiB, data {report['vm_data'] / 2**20:.0f} MiB "
        f"(cap: {args.cap_mb or 'none'} MiB)"
    )
    (out / f"rank{rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
