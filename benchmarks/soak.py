"""Soak: a long async run on 2 ranks, sampling every rank's memory, stash, files and threads.

Trains the digits MLP (Flatten, Linear 64-128, ReLU, Linear 128-128, ReLU, Linear 128-10; batch
16, 2 microbatches, SGD with momentum, one stage of 3 layers per rank) through the real strategy,
Lightning's Trainer and gloo, ``async`` (weight stashing), for ``--steps`` steps (2,000) with
validation and ``ModelCheckpoint(every_n_train_steps=200, save_top_k=2, save_last=True)`` every
``--every`` steps (200). Every ``--sample`` steps (20) each rank records its resident memory
(``VmRSS`` of ``/proc/self/status``), the bytes its weight stash holds apart from the live
weights (``WeightStash.held_bytes``: snapshots and spares), its open file descriptors
(``/proc/self/fd``) and its threads (``Threads``).

Writes ``soak.csv`` (rank, step, seconds, rss, stash, fds, threads) and ``soak.png`` (one panel
per series, one line per rank), and prints per rank and series, over the second half of the run
(the first half is the warm-up): the slope of a least-squares line in units per 100 steps, the
max - min, and whether the series is flat. Flat: resident memory grows by less than 1 MiB over
the second half (slope x its length) and the stash, file descriptors and threads never exceed
their maximum of the first half. Exits 1 when any series is not flat.

    python benchmarks/soak.py --out outputs/soak                  # 2,000 steps
    python benchmarks/soak.py --quick --out /tmp/soak             # 400 steps, every 40
"""

from __future__ import annotations

import argparse
import csv
import os
import subprocess
import sys
import time
from pathlib import Path

import harness

SERIES = ("rss", "stash", "fds", "threads")
RSS_TOLERANCE = 2**20  # bytes of growth over the second half still counted as flat


# ----- the trained script (one per rank, started by the strategy's launcher) --------------------


def status(field: str) -> int:
    """A numeric field of ``/proc/self/status`` (kB fields in bytes)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            value = line.split()[1:]
            return int(value[0]) * (1024 if value[1:] == ["kB"] else 1)
    raise KeyError(field)


def run_worker(args: argparse.Namespace) -> None:
    """Train and sample; each rank writes ``rank<r>.csv``."""
    from lightning.pytorch import Callback, Trainer
    from lightning.pytorch.callbacks import ModelCheckpoint

    from pl_pipedream import PipeDreamStrategy
    from pl_pipedream.data import DigitsDataModule
    from pl_pipedream.models import MLP

    out = Path(args.out)
    leaked: list[bytearray] = []

    class Sample(Callback):
        def __init__(self) -> None:
            self.rows: list[list[float]] = []
            self.start = time.perf_counter()

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            step = trainer.global_step
            if step % args.sample:
                return
            if args.leak:  # a deliberate leak, to see the verdict fail
                leaked.append(bytearray(args.leak * args.sample))
            stash = trainer.strategy.session.runner.executor.stash.held_bytes
            fds = len(os.listdir("/proc/self/fd"))
            seconds = time.perf_counter() - self.start
            rss, threads = status("VmRSS"), status("Threads")
            self.rows.append([step, round(seconds, 3), rss, stash, fds, threads])

        def on_train_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            path = out / f"rank{trainer.global_rank}.csv"
            with path.open("w", newline="") as file:
                csv.writer(file).writerows(self.rows)

    saver = ModelCheckpoint(
        dirpath=out / "ckpts",
        every_n_train_steps=args.every,
        save_top_k=2,
        monitor="step",
        mode="max",
        save_last=True,
    )
    trainer = Trainer(
        strategy=PipeDreamStrategy(sync="async", balance=[3, 3], microbatches=2, timeout=60),
        accelerator="cpu",
        devices=2,
        max_steps=args.steps,
        max_epochs=-1,
        val_check_interval=args.every,
        check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        callbacks=[Sample(), saver],
    )
    model = MLP((1, 8, 8), 10, hidden=(128, 128), optimizer="sgd", lr=0.02, momentum=0.9)
    trainer.fit(model, datamodule=DigitsDataModule(batch_size=16))


# ----- the parent: verdicts and the plot ----------------------------------------------------------


def slope(xs: list[float], ys: list[float]) -> float:
    """The least-squares slope of ``ys`` over ``xs``."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx else 0.0


def verdict(series: str, steps: list[float], values: list[float]) -> tuple[float, float, bool]:
    """Slope over the second half (per 100 steps), max - min there, and whether it is flat."""
    half = len(steps) // 2
    warm, late, late_steps = values[:half], values[half:], steps[half:]
    per_100 = slope(late_steps, late) * 100
    spread = max(late) - min(late)
    if series == "rss":
        flat = per_100 * (late_steps[-1] - late_steps[0]) / 100 < RSS_TOLERANCE
    else:
        flat = max(late) <= max(warm)
    return per_100, spread, flat


def read(out: Path) -> dict[int, list[list[float]]]:
    rows = {}
    for rank in (0, 1):
        with (out / f"rank{rank}.csv").open() as file:
            rows[rank] = [[float(v) for v in row] for row in csv.reader(file)]
    return rows


def write_csv(rows: dict[int, list[list[float]]], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["rank", "step", "seconds", *SERIES])
        for rank, samples in rows.items():
            writer.writerows(
                [[rank, *(int(v) if i != 1 else v for i, v in enumerate(s))] for s in samples]
            )


def plot(rows: dict[int, list[list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = {
        "rss": "resident memory (MiB)",
        "stash": "stash (KiB)",
        "fds": "open file descriptors",
        "threads": "threads",
    }
    scale = {"rss": 2**20, "stash": 2**10, "fds": 1, "threads": 1}
    figure, axes = plt.subplots(1, 4, figsize=(13, 3))
    for i, (series, axis) in enumerate(zip(SERIES, axes, strict=True)):
        for rank, samples in rows.items():
            steps = [s[0] for s in samples]
            axis.plot(steps, [s[2 + i] / scale[series] for s in samples], label=f"rank {rank}")
        axis.set_title(labels[series], fontsize=10)
        axis.set_xlabel("step")
    axes[0].legend(fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=70)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--every", type=int, default=200, help="validation and checkpoint")
    parser.add_argument("--sample", type=int, default=20, help="steps between samples")
    parser.add_argument("--quick", action="store_true", help="400 steps, every 40, sample 10")
    parser.add_argument("--leak", type=int, default=0, help="bytes to leak per step (a check)")
    parser.add_argument("--out", default="outputs/soak")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick:
        args.steps, args.every, args.sample = 400, 40, 10
    if args.worker:
        run_worker(args)
        return
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", "--out", str(out)]
    command += ["--steps", str(args.steps), "--every", str(args.every)]
    command += ["--sample", str(args.sample), "--leak", str(args.leak)]
    env = harness.child_env(OMP_NUM_THREADS="1")
    start = time.perf_counter()
    subprocess.run(command, check=True, env=env, cwd=out)
    seconds = time.perf_counter() - start
    rows = read(out)
    write_csv(rows, out / "soak.csv")
    plot(rows, out / "soak.png")
    print(
        f"{args.steps} async steps on 2 ranks, validation and a checkpoint every {args.every}, "
        f"sampled every {args.sample}: {seconds:.0f} s"
    )
    print("rank | series  | first      | last       | slope /100 steps (2nd half) | max-min | flat")
    flat_all = True
    for rank, samples in rows.items():
        steps = [s[0] for s in samples]
        for i, series in enumerate(SERIES):
            values = [s[2 + i] for s in samples]
            per_100, spread, flat = verdict(series, steps, values)
            flat_all &= flat
            print(
                f"{rank:4d} | {series:7s} | {values[0]:10.0f} | {values[-1]:10.0f} | "
                f"{per_100:27.1f} | {spread:7.0f} | {'yes' if flat else 'NO'}"
            )
    print(f"every series flat after warm-up: {'yes' if flat_all else 'NO'}")
    sys.exit(0 if flat_all else 1)


if __name__ == "__main__":
    main()
