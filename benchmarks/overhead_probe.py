"""Fixed cost per microbatch: the trivial model (Linear(16)-ReLU-Linear(16), batch 8) on 2 stages.

``python benchmarks/overhead_probe.py`` runs, each in its own processes: one-process Lightning,
then ``PipeDreamStrategy`` in async-1, flush-1 and flush-8, and prints rank 0's wall time per
step (and per microbatch) over the steady part: from the end of batch ``--warmup`` to the end of
the second-to-last batch. ``--profile DIR`` writes a cProfile of ``trainer.fit`` per rank.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import subprocess
import sys
import time

import torch
import torch.nn.functional as F
from lightning.pytorch import Callback, LightningModule, Trainer
from torch import nn
from torch.utils.data import DataLoader

from pl_pipedream.strategy import PipeDreamStrategy

WIDTH, BATCH = 16, 8


class Trivial(LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.ReLU()), nn.Linear(WIDTH, WIDTH)
        )

    def configure_pipeline(self) -> nn.Sequential:
        return self.net

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        return F.mse_loss(self(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Clock(Callback):
    def __init__(self) -> None:
        self.times: list[float] = []

        self.cpu: list[float] = []

    def on_train_batch_end(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        self.times.append(time.perf_counter())
        self.cpu.append(time.process_time())


def batches(steps: int, m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    shape = (steps, BATCH * m, WIDTH)
    x = torch.randn(shape, generator=g)
    # A learnable target: the loss falls steadily, so the divergence watch stays on throughout.
    y = x @ torch.randn(WIDTH, WIDTH, generator=g) / WIDTH**0.5
    return list(zip(x.unbind(), y.unbind(), strict=True))


def run(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    devices: dict = {"devices": 1}
    if args.sync:
        strategy = PipeDreamStrategy(
            sync=args.sync, balance=[1, 1], microbatches=args.m, divergence_rise=1e9
        )  # the watch runs every step (its cost counted) but random-batch noise never trips it
        devices = {"devices": 2, "strategy": strategy}
    clock = Clock()
    trainer = Trainer(
        accelerator="cpu",
        **devices,
        max_epochs=1,
        callbacks=[clock],
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    loader = DataLoader(batches(args.steps, args.m), batch_size=None, shuffle=False)
    model = Trivial()
    if args.profile:
        profile = cProfile.Profile()
        profile.enable()
    trainer.fit(model, loader)
    rank = trainer.global_rank
    if args.profile:
        profile.disable()
        os.makedirs(args.profile, exist_ok=True)
        profile.dump_stats(
            os.path.join(args.profile, f"{args.sync or 'one'}-{args.m}-r{rank}.prof")
        )
    t, c, w = clock.times, clock.cpu, args.warmup
    steps = len(t) - 2 - w
    per_step = (t[-2] - t[w]) / steps * 1e3
    cpu = (c[-2] - c[w]) / steps * 1e3
    name = f"{args.sync}-{args.m}" if args.sync else "lightning-1"
    if rank == 0:
        print(
            f"RESULT {name}: {per_step:.3f} ms/step, {per_step / args.m:.3f} ms/microbatch; "
            f"CPU rank 0 {cpu:.3f} ms/step",
            flush=True,
        )
    else:
        print(f"RESULT {name}: CPU rank 1 {cpu:.3f} ms/step", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sync", default="")
    parser.add_argument("--m", type=int, default=1)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--profile", default="")
    parser.add_argument("--all", action="store_true", help="run every configuration")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument(
        "--code", nargs="*", default=[], help="checkouts to compare, alternately (PYTHONPATH)"
    )
    args = parser.parse_args()
    if not args.all:
        run(args)
        return
    env = dict(os.environ, OMP_NUM_THREADS="1")
    configs = [[], ["--sync", "async"], ["--sync", "flush"], ["--sync", "flush", "--m", "8"]]
    runs = [(code, config) for config in configs for code in (args.code or [None])]
    for _ in range(args.repeats):
        for code, config in runs:
            if code is not None:
                env["PYTHONPATH"] = code
                print(f"[{code}]", end=" ")
            extra = ["--steps", str(args.steps), "--warmup", str(args.warmup)]
            if args.profile:
                extra += ["--profile", args.profile]
            out = subprocess.run(
                [sys.executable, __file__, *config, *extra], env=env, capture_output=True, text=True
            )
            lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT")]
            print(*(lines or [out.stderr[-2000:]]), sep="\n", flush=True)


if __name__ == "__main__":
    main()
