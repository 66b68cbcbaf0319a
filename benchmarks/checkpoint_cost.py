"""Checkpoint cost: save and load time and peak memory per rank, through the public entry points.

Trains a chain of ``Linear(width)`` layers, built empty in ``configure_model()`` (so no rank ever
builds the whole model), with ``PipeDreamStrategy(sync="flush", balance=even)`` on N CPU ranks
over gloo, through Lightning's Trainer, two launches per rank count:

* ``save``: fit one step from scratch, then ``trainer.save_checkpoint(DIR/nN/run.ckpt)`` from a
  callback; each rank times the call (every writer's shard, the publish, Lightning's barrier)
  and reads its peak resident memory during it (``VmHWM``, reset just before through
  ``/proc/self/clear_refs``);
* ``load``: a fresh launch fits with ``ckpt_path=DIR/nN/run.ckpt``; each rank times from the
  ``fit`` call to the end of its first step, and from the ``setup`` hook to ``on_train_start``
  (the pipeline's setup plus Lightning's restore: reading the checkpoint, the weights, the
  optimizer and loop state), and reads its peak resident memory (``VmHWM``) at the first step.
  The ``save`` launch's own time and peak at the end of its first step (a fit from scratch) are
  the baseline, so that the checkpoint's part is the difference.

Only ``trainer.save_checkpoint`` and ``fit(ckpt_path=...)`` touch the checkpoint, so the
benchmark measures whatever format the strategy writes. Prints one row per rank and the
checkpoint's size on disk; exits 1 if a figure is missing or not positive.

    OMP_NUM_THREADS=1 python benchmarks/checkpoint_cost.py --ranks 2 4 --out outputs/ckpt-cost
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_cost.py --optimizer adam --ranks 2 --out ...
    OMP_NUM_THREADS=1 python benchmarks/checkpoint_cost.py --quick --out /tmp/ckpt-cost
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

MIB = 2**20


def status(field: str) -> int:
    """A kB field of ``/proc/self/status``, in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def reset_peak() -> None:
    """Start ``VmHWM`` again from the current resident memory (Linux ``clear_refs`` 5)."""
    Path("/proc/self/clear_refs").write_text("5")


def layer_count(size_gib: float, width: int) -> int:
    """Layers of ``Linear(width)`` whose fp32 weights and biases make about ``size_gib``."""
    return max(1, round(size_gib * 2**30 / (4 * (width * width + width))))


# ----- one rank (Lightning's script launcher re-runs this file per rank) -------------------------


def run_worker(args: argparse.Namespace) -> None:
    import torch
    from lightning.pytorch import Callback, LightningModule, Trainer
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from pl_pipedream import PipeDreamStrategy

    out, started = Path(args.out), time.perf_counter()
    path = out / "run.ckpt"
    figures: dict[str, Any] = {}

    class Chain(LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layers: nn.Sequential | None = None

        def configure_model(self) -> None:
            if self.layers is None:
                linears = (nn.Linear(args.width, args.width) for _ in range(args.layers))
                self.layers = nn.Sequential(*linears)

        def configure_pipeline(self) -> nn.Sequential:
            return self.layers

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

        def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
            x, y = batch
            return nn.functional.mse_loss(self(x), y)

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            if args.optimizer == "adam":
                return torch.optim.Adam(self.parameters(), lr=1e-4)
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class Measure(Callback):
        def setup(self, trainer, module, stage) -> None:  # type: ignore[no-untyped-def]
            figures["setup_at"] = time.perf_counter()

        def on_train_start(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            figures["setup_s"] = time.perf_counter() - figures.pop("setup_at")

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            if "first_step_s" not in figures:
                figures["first_step_s"] = time.perf_counter() - started
                figures["first_step_peak"] = status("VmHWM")
            if args.phase == "save" and trainer.global_step == 1:
                figures["rss_before_save"] = status("VmRSS")
                trainer.strategy.barrier()
                reset_peak()
                start = time.perf_counter()
                trainer.save_checkpoint(path)
                figures["save_s"] = time.perf_counter() - start
                figures["save_peak"] = status("VmHWM")

    strategy = PipeDreamStrategy(
        sync="flush", balance=[args.layers // args.devices] * args.devices, microbatches=2,
        timeout=600, divergence="off",
    )  # fmt: skip
    trainer = Trainer(
        strategy=strategy, accelerator="cpu", devices=args.devices,
        max_steps=1 if args.phase == "save" else 2, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, callbacks=[Measure()],
    )  # fmt: skip
    data = torch.Generator().manual_seed(1)
    x = torch.randn(8, args.width, generator=data)
    y = torch.randn(8, args.width, generator=data)
    torch.manual_seed(0)
    started = time.perf_counter()
    trainer.fit(Chain(), DataLoader(TensorDataset(x, y), batch_size=4), ckpt_path=args.resume)
    figures["rank"] = trainer.global_rank
    figures["stage"] = strategy.session.local.stage.index
    name = f"{args.phase}-rank{trainer.global_rank}.json"
    (out / name).write_text(json.dumps(figures))


# ----- the parent: one save and one load launch per rank count ---------------------------------


def launch(args: argparse.Namespace, devices: int, phase: str, out: Path) -> float:
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--phase", phase]
    command += ["--devices", str(devices), "--width", str(args.width), "--out", str(out)]
    command += ["--layers", str(args.layers), "--optimizer", args.optimizer]
    if phase == "load":
        command += ["--resume", str(out / "run.ckpt")]
    env = harness.child_env(OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=out)
    return time.perf_counter() - start


def measure(args: argparse.Namespace, devices: int) -> list[dict[str, Any]]:
    """Save, then load, on ``devices`` ranks; every rank's figures, with the checkpoint's size."""
    out = Path(args.out).resolve() / f"n{devices}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    launch(args, devices, "save", out)
    size = sum(f.stat().st_size for f in (out / "run.ckpt").rglob("*") if f.is_file())
    launch(args, devices, "load", out)
    rows = []
    for rank in range(devices):
        saved = json.loads((out / f"save-rank{rank}.json").read_text())
        loaded = json.loads((out / f"load-rank{rank}.json").read_text())
        rows.append(
            {
                "ranks": devices,
                "rank": rank,
                "stage": saved["stage"],
                "checkpoint_bytes": size,
                "save_s": saved["save_s"],
                "save_peak": saved["save_peak"],
                "rss_before_save": saved["rss_before_save"],
                "fresh_setup_s": saved["setup_s"],
                "resume_setup_s": loaded["setup_s"],
                "fresh_first_step_s": saved["first_step_s"],
                "fresh_peak": saved["first_step_peak"],
                "resume_first_step_s": loaded["first_step_s"],
                "resume_peak": loaded["first_step_peak"],
            }
        )
    if not args.keep:
        shutil.rmtree(out / "run.ckpt", ignore_errors=True)
    return rows


def render(rows: list[dict[str, Any]], model_bytes: int) -> str:
    lines = [
        "ranks | rank | stage | checkpoint MiB | save s | peak in save MiB (RSS before) | "
        "setup to train start s: fresh / resumed | fit to 1st step s: fresh / resumed | "
        "peak at 1st step MiB: fresh / resumed",
        "---|---|---|---|---|---|---|---|---",
    ]
    for r in rows:
        lines.append(
            f"{r['ranks']} | {r['rank']} | {r['stage']} | {r['checkpoint_bytes'] / MIB:,.0f} | "
            f"{r['save_s']:.2f} | {r['save_peak'] / MIB:,.0f} ({r['rss_before_save'] / MIB:,.0f})"
            f" | {r['fresh_setup_s']:.1f} / {r['resume_setup_s']:.1f}"
            f" | {r['fresh_first_step_s']:.1f} / {r['resume_first_step_s']:.1f} | "
            f"{r['fresh_peak'] / MIB:,.0f} / {r['resume_peak'] / MIB:,.0f}"
        )
    lines.append(f"whole model: {model_bytes / MIB:,.0f} MiB of fp32 weights and biases")
    return "\n".join(lines)


def sane(rows: list[dict[str, Any]]) -> bool:
    keys = ("save_s", "save_peak", "resume_setup_s", "resume_first_step_s", "resume_peak")
    keys += ("checkpoint_bytes",)
    return bool(rows) and all(r[k] > 0 for r in rows for k in keys)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--size-gib", type=float, default=1.0, help="fp32 weights in GiB")
    parser.add_argument("--width", type=int, default=4096)
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--quick", action="store_true", help="width 256, 8 layers, 2 ranks")
    parser.add_argument("--keep", action="store_true", help="keep the checkpoints")
    parser.add_argument("--out", default="outputs/checkpoint-cost")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--phase", choices=("save", "load"), help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--resume", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        run_worker(args)
        return
    if args.quick:
        args.width, args.layers, args.ranks = 256, 8, [2]
    else:
        args.layers = layer_count(args.size_gib, args.width)
        args.layers += -args.layers % math.lcm(*args.ranks)  # an even balance on every count
    model_bytes = args.layers * 4 * (args.width * args.width + args.width)
    print(
        f"{args.layers} x Linear({args.width}), {model_bytes / MIB:,.0f} MiB of weights, "
        f"{args.optimizer}, flush, {args.ranks} ranks"
    )
    rows = [row for devices in args.ranks for row in measure(args, devices)]
    print(render(rows, model_bytes))
    harness.write_json(Path(args.out) / "checkpoint_cost.json", rows)
    sys.exit(0 if sane(rows) else 1)


if __name__ == "__main__":
    main()
