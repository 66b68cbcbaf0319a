"""Statistical efficiency of every sync mode: validation accuracy per epoch against one device.

Trains through the real strategy (Lightning's Trainer, gloo, 2 or 3 CPU processes started by the
strategy's script launcher, ``OMP_NUM_THREADS=1``) and on one device (a plain Trainer), on

* ``digits``: an MLP of 6 pipeline layers (Flatten, Linear 64-128, ReLU, Linear 128-128, ReLU,
  Linear 128-10) on scikit-learn's digits, batch 32, SGD at lr 0.1 and 0.03, momentum 0 and 0.9,
  on 2 and 3 stages (issue 13's newcomer: 3 stages, lr 0.1, momentum 0.9, async);
* ``digits6``: the same data with a deeper MLP of 6 Linear layers (hidden 128, 128, 128, 128,
  64; 12 pipeline layers, 4 per stage), SGD at lr 0.1 and 0.03 with momentum 0.9, 3 stages;
* ``text``: CharGPT (embedding, 2 blocks, tied head) on the characters of standard-library
  sources (``data.text``), Adam, 2 stages;
* ``digits`` at batch 16 with SGD lr 0.1, momentum 0.9 on 2 stages (issue 21: a healthy run
  that the first divergence rule stopped at step 20, in ``flush`` as well);
* ``synthetic``: the same MLP on generated classes (``data.synthetic``, noise 1) at batch 16,
  SGD lr 0.1, momentum 0.9: a run that diverges on one device too (0.95 after one epoch, chance
  after two);
* ``noise``: regression on random targets (8 inputs, Linear 8-32, ReLU, Linear 32-32, ReLU,
  Linear 32-1, mean squared error; SGD lr 0.01, momentum 0.9, batch 16): nothing to learn, a
  loss that only fluctuates (its validation loss);
* ``awdlm``: the paper's AWD-LM with its widths divided by 10 (embedding 40, hidden 115, tied
  head) on the same characters, plain SGD at lr 5 without clipping (the recipe's lr 30 needs its
  gradient clipping at 0.25 and oscillates at this size), 3 stages; validation loss, not accuracy.
  (VGG-16 at width 1/16 on small generated images stays at chance on one device: its
  activations vanish through 13 plain convolutions at this size, so it measures nothing here.)

Every configuration of ``CONFIGS`` (a named set of ``PipeDreamStrategy`` keywords; adding one is
one line) runs on every setting; a configuration whose keywords the strategy does not accept
(``weight_prediction`` before it exists) is skipped and named. Divergence detection is set to
``"warn"`` so the curves of diverging runs are recorded; the table marks where the default rule
(``divergence="error"``) would act on the logged losses: ``!N`` it stops at step N (a non-finite
loss), ``~N`` it warns at step N (a loss that gave back its progress) and trains on. Writes
``convergence.csv`` (one row per run and epoch: val_acc, val_loss, the last logged train_loss),
``convergence.png`` (the curves) and prints the time-to-accuracy table: the first epoch at which
a run reaches 0.9 of one device's final validation accuracy, or for a loss a validation loss
within 1/0.9 of one device's final (``-`` when it never does).

    python benchmarks/convergence.py --out outputs/convergence     # every setting (~15 min here)
    python benchmarks/convergence.py --quick --out /tmp/conv       # 2 settings, 2 epochs
    python benchmarks/convergence.py --only noise-2st-sgd --configs async flush --out /tmp/n
"""

from __future__ import annotations

import argparse
import csv
import inspect
import json
import math
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import harness

# Named strategy keyword sets; None is one device (a plain Trainer). One line per configuration.
CONFIGS: dict[str, dict[str, Any] | None] = {
    "one device": None,
    "async": dict(sync="async"),
    "async+predict": dict(sync="async", weight_prediction=True),
    "vertical_sync": dict(sync="vertical_sync"),
    "vertical_sync+predict": dict(sync="vertical_sync", weight_prediction=True),
    "async+warmup5": dict(sync="async", lr_warmup_per_delay=5),
    "2bw": dict(sync="2bw"),
    "flush": dict(sync="flush"),
    "gpipe": dict(sync="gpipe"),
}
BATCH = 32  # examples per Lightning batch unless a setting says otherwise
# Keywords the strategy refuses with tied parameters (CharGPT, AWD-LM): skipped on those models.
CORRECTIONS = {"weight_prediction", "lr_warmup_per_delay"}
TARGET = 0.9  # time to accuracy: epochs to reach this share of one device's final val_acc


@dataclass(frozen=True)
class Setting:
    """One model, data set, optimizer and pipeline depth, trained under every configuration."""

    name: str
    model: str  # "digits", "digits6", "synthetic", "noise", "text" or "awdlm"
    stages: int
    epochs: int
    optimizer: dict[str, Any] = field(default_factory=dict)
    metric: str = "val_acc"  # or "val_loss" (lower is better)
    tied: bool = False  # tied parameters: no CORRECTIONS
    batch: int = BATCH  # examples per Lightning batch

    def takes(self, config: str) -> bool:
        keywords = CONFIGS[config]
        return not (self.tied and keywords is not None and set(keywords) & CORRECTIONS)


def settings(quick: bool) -> list[Setting]:
    if quick:
        sgd = dict(optimizer="sgd", lr=0.1, momentum=0.9)
        return [Setting("digits-3st-lr0.1-m0.9", "digits", 3, 2, sgd)]
    found = []
    for stages in (3, 2):
        for lr in (0.1, 0.03):
            for momentum in (0.9, 0.0):
                sgd = dict(optimizer="sgd", lr=lr, momentum=momentum)
                found.append(
                    Setting(f"digits-{stages}st-lr{lr}-m{momentum}", "digits", stages, 15, sgd)
                )
    found.append(Setting("digits-3st-adam", "digits", 3, 15, dict(optimizer="adam", lr=3e-3)))
    for lr in (0.1, 0.03):  # the deeper MLP: 6 Linear layers, where staleness costs most
        sgd = dict(optimizer="sgd", lr=lr, momentum=0.9)
        found.append(Setting(f"digits6-3st-lr{lr}-m0.9", "digits6", 3, 15, sgd))
    sgd = dict(optimizer="sgd", lr=0.1, momentum=0.9)
    found.append(Setting("digits-2st-lr0.1-m0.9-b16", "digits", 2, 3, sgd, batch=16))
    found.append(Setting("synthetic-2st-lr0.1-m0.9-b16", "synthetic", 2, 3, sgd, batch=16))
    found.append(Setting("noise-2st-sgd", "noise", 2, 8, {}, "val_loss", batch=16))
    adam = dict(optimizer="adam", lr=3e-3)
    found.append(Setting("text-2st-adam", "text", 2, 12, adam, tied=True))
    found.append(Setting("awdlm-3st-sgd", "awdlm", 3, 8, dict(lr=5.0), "val_loss", tied=True))
    return found


def quick_configs() -> list[str]:
    return ["one device", "async", "flush"]


# ----- one launch: every run of one device count ------------------------------------------------


def build(setting: Setting) -> tuple[Any, Any, list[int]]:
    """The LightningModule, the data module and the balance for ``setting`` (seeded)."""
    import torch

    from pl_pipedream.data import DigitsDataModule, SyntheticDataModule, TextDataModule
    from pl_pipedream.models import AWDLM, MLP, CharGPT

    torch.manual_seed(0)
    if setting.model == "digits":
        data = DigitsDataModule(batch_size=setting.batch)
        model = MLP((1, 8, 8), 10, hidden=(128, 128), **setting.optimizer)
        balance = {2: [3, 3], 3: [2, 2, 2]}[setting.stages]
    elif setting.model == "synthetic":
        data = SyntheticDataModule(batch_size=setting.batch, noise=1.0)
        model = MLP((1, 8, 8), 10, hidden=(64, 64), **setting.optimizer)
        balance = {2: [3, 3], 3: [2, 2, 2]}[setting.stages]
    elif setting.model == "noise":
        model, data = noise_regression(setting.batch)
        balance = {2: [3, 2], 3: [2, 2, 1]}[setting.stages]
    elif setting.model == "digits6":
        data = DigitsDataModule(batch_size=setting.batch)
        model = MLP((1, 8, 8), 10, hidden=(128, 128, 128, 128, 64), **setting.optimizer)
        balance = {2: [6, 6], 3: [4, 4, 4]}[setting.stages]
    elif setting.model == "text":
        data = TextDataModule(length=32, num_examples=1536, batch_size=setting.batch)
        model = CharGPT((32,), 128, width=64, heads=4, blocks=2, **setting.optimizer)
        balance = {2: [2, 2], 3: [1, 2, 1]}[setting.stages]
    else:
        data = TextDataModule(length=32, num_examples=1536, batch_size=setting.batch)
        model = AWDLM((32,), 128, scale=10, **setting.optimizer)
        balance = {2: [3, 2], 3: [2, 2, 1]}[setting.stages]
    return model, data, balance


def noise_regression(batch: int, seed: int = 1) -> tuple[Any, Any]:
    """A regression model and random targets (nothing to learn): the model and a data module
    (``seed``: the data's and the order's; the first divergence rule stopped 7 of seeds 0-7,
    seed 1 among them, at step 19 to 31)."""
    import lightning.pytorch as pl
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Noise(pl.LightningDataModule):
        def __init__(self) -> None:
            super().__init__()
            generator = torch.Generator().manual_seed(seed)
            x, y = (
                torch.randn(640, 8, generator=generator),
                torch.randn(640, 1, generator=generator),
            )
            self.train, self.val = TensorDataset(x[:512], y[:512]), TensorDataset(x[512:], y[512:])

        def train_dataloader(self) -> DataLoader:
            generator = torch.Generator().manual_seed(seed)
            return DataLoader(self.train, batch, shuffle=True, generator=generator, drop_last=True)

        def val_dataloader(self) -> DataLoader:
            return DataLoader(self.val, batch)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            widths = [(8, 32), (32, 32)]
            layers = [m for a, b in widths for m in (nn.Linear(a, b), nn.ReLU())]
            self.pipeline = nn.Sequential(*layers, nn.Linear(32, 1))

        def configure_pipeline(self) -> nn.Sequential:
            return self.pipeline

        def forward(self, x: Any) -> Any:
            return self.pipeline(x)

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return nn.functional.mse_loss(self(batch[0]), batch[1])

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", nn.functional.mse_loss(self(batch[0]), batch[1]))

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    return Regression(), Noise()


def accepted(config: dict[str, Any]) -> bool:
    """Whether ``PipeDreamStrategy`` takes every keyword of ``config``."""
    from pl_pipedream import PipeDreamStrategy

    return set(config) <= set(inspect.signature(PipeDreamStrategy.__init__).parameters)


def run_worker(names: list[str], devices: int, quick: bool, out: Path) -> None:
    """Train every run ``setting/config`` of ``names`` in turn (rank 0 writes its JSON)."""
    from lightning.pytorch import Callback, Trainer

    from pl_pipedream import PipeDreamStrategy
    from pl_pipedream.schedule.modes import SyncMode

    class Record(Callback):
        def __init__(self) -> None:
            self.epochs: list[dict[str, float]] = []
            self.losses: list[float] = []

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
            # the strategy's logged train_loss (NaN while the pipeline fills); one device's loss
            loss = outputs["loss"] if isinstance(outputs, dict) else outputs
            self.losses.append(float(loss) if loss is not None else math.nan)

        def on_validation_end(self, trainer, module) -> None:  # type: ignore[no-untyped-def]
            if trainer.sanity_checking:
                return
            metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
            metrics["train_loss"] = self.losses[-1] if self.losses else math.nan  # the epoch's last
            self.epochs.append(metrics)

    by_name = {s.name: s for s in settings(quick)}
    for name in names:
        setting_name, config_name = name.split("/")
        setting, config = by_name[setting_name], CONFIGS[config_name]
        model, data, balance = build(setting)
        record = Record()
        if config is None:
            strategy: Any = "auto"
        else:
            keywords = dict(config)
            mode = SyncMode.parse(keywords["sync"])
            m = mode.min_microbatches(setting.stages)
            while setting.batch % m:  # 2bw needs at least as many microbatches as stages
                m += 1
            keywords.setdefault("microbatches", m)
            if accepted({"divergence": 0}):
                keywords["divergence"] = "warn"
            strategy = PipeDreamStrategy(balance=balance, timeout=120, **keywords)
        trainer = Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=devices,
            max_epochs=setting.epochs,
            num_sanity_val_steps=0,
            use_distributed_sampler=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            enable_checkpointing=False,
            logger=False,
            callbacks=[record],
        )
        start = time.perf_counter()
        trainer.fit(model, datamodule=data)
        if trainer.global_rank == 0:
            result = dict(
                setting=setting_name,
                config=config_name,
                seconds=time.perf_counter() - start,
                epochs=record.epochs,
                losses=record.losses,
            )
            path = out / f"{setting_name}__{config_name.replace(' ', '_')}.json"
            path.write_text(json.dumps(result))


# ----- the orchestrator -------------------------------------------------------------------------


def launch(names: list[str], devices: int, quick: bool, out: Path) -> None:
    """Run ``names`` in one worker process (the strategy's launcher starts the other ranks)."""
    if not names:
        return
    command = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--worker",
        "--devices",
        str(devices),
        "--out",
        str(out),
    ]
    command += ["--quick"] if quick else []
    env = harness.child_env(OMP_NUM_THREADS="1")
    subprocess.run([*command, "--runs", *names], check=True, env=env, cwd=out)


def collect(out: Path) -> list[dict[str, Any]]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("*__*.json"))]


def epochs_to(curve: list[float], target: float) -> int | None:
    """The first epoch (1-based) whose accuracy reaches ``target``, None if none does."""
    return next((e + 1 for e, acc in enumerate(curve) if acc >= target), None)


def flagged_at(losses: list[float]) -> tuple[int, bool] | None:
    """The step at which the strategy's default divergence rule reports on these logged losses
    (NaN entries before the first finite one are steps with nothing logged yet), and whether
    the default stops there (True) or warns (False); None if it never reports."""
    from pl_pipedream.core.divergence import DivergenceWatch, stops

    watch = DivergenceWatch()
    logged = False
    for step, loss in enumerate(losses):
        if math.isnan(loss) and not logged:
            continue
        logged = True
        verdict = watch.observe(loss)
        if verdict is not None:
            return step, stops("error", verdict)
    return None


def write_csv(results: list[dict[str, Any]], path: Path) -> None:
    with path.open("w", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(["setting", "config", "epoch", "val_acc", "val_loss", "train_loss"])
        for r in results:
            for e, metrics in enumerate(r["epochs"]):
                row = [metrics.get(k, math.nan) for k in ("val_acc", "val_loss", "train_loss")]
                writer.writerow([r["setting"], r["config"], e + 1, *(f"{v:.4f}" for v in row)])


def table(results: list[dict[str, Any]]) -> str:
    """Time to accuracy in epochs (and the final val_acc) per setting and configuration."""
    configs = [c for c in CONFIGS if any(r["config"] == c for r in results)]
    lines = ["setting | target | " + " | ".join(configs)]
    lines.append("|".join(["---"] * (len(configs) + 2)))
    for setting in dict.fromkeys(r["setting"] for r in results):
        runs = {r["config"]: r for r in results if r["setting"] == setting}
        base = runs.get("one device")
        if base is None or not base["epochs"]:
            continue
        metric = "val_acc" if "val_acc" in base["epochs"][-1] else "val_loss"
        sign = 1 if metric == "val_acc" else -1  # losses: compare negated
        final = base["epochs"][-1][metric]
        target = TARGET * final if sign > 0 else final / TARGET
        cells = []
        for config in configs:
            run = runs.get(config)
            if run is None:
                cells.append("")
                continue
            curve = [m.get(metric, math.nan) for m in run["epochs"]]
            reached = epochs_to([sign * v for v in curve], sign * target)
            flag = flagged_at(run["losses"])
            flagged = "" if flag is None else f" {'!' if flag[1] else '~'}{flag[0]}"
            cells.append(f"{reached if reached else '-'} ({curve[-1]:.2f}){flagged}")
        name = setting if sign > 0 else f"{setting} (val_loss)"
        lines.append(f"{name} | {target:.2f} | " + " | ".join(cells))
    lines.append(
        f"cells: epochs to reach the target ({TARGET} x one device's final val_acc; - never), "
        "(final val_acc or val_loss), !N: the default divergence rule would stop the run at step "
        "N (a non-finite loss), ~N: it would warn at step N (a loss that gave back its progress)"
    )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(dict.fromkeys(r["setting"] for r in results))
    palette = plt.get_cmap("tab10").colors
    color = {config: palette[i % len(palette)] for i, config in enumerate(CONFIGS)}
    columns = min(4, len(names))
    rows = math.ceil(len(names) / columns)
    figure, axes = plt.subplots(rows, columns, figsize=(3.2 * columns, 2.6 * rows), squeeze=False)
    for ax, setting in zip(axes.flat, names, strict=False):
        metric = "val_acc"
        for r in results:
            if r["setting"] == setting:
                metric = "val_acc" if "val_acc" in r["epochs"][-1] else "val_loss"
                curve = [m.get(metric, math.nan) for m in r["epochs"]]
                ax.plot(range(1, len(curve) + 1), curve, color=color[r["config"]], lw=1.2)
        ax.set_title(f"{setting} ({metric})", fontsize=8)
        if metric == "val_acc":
            ax.set_ylim(0, 1)
        else:
            ax.set_yscale("log")  # a diverged run's loss is orders of magnitude up
        ax.tick_params(labelsize=7)
    for ax in list(axes.flat)[len(names) :]:
        ax.axis("off")
    shown = [config for config in CONFIGS if any(r["config"] == config for r in results)]
    handles = [plt.Line2D([], [], color=color[config], lw=1.2) for config in shown]
    figure.legend(handles, shown, loc="lower right", fontsize=7, ncols=2)  # one color per config
    figure.supxlabel("epoch", fontsize=8)
    figure.supylabel("validation accuracy (or loss)", fontsize=8)
    figure.tight_layout()
    figure.savefig(path, dpi=64)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="outputs/convergence")
    parser.add_argument("--quick", action="store_true", help="2 epochs, a few configurations")
    parser.add_argument("--only", nargs="*", help="run only these settings (names)")
    parser.add_argument("--configs", nargs="*", help="run only these configurations (names)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--devices", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--runs", nargs="*", help=argparse.SUPPRESS)
    args = parser.parse_args()
    out = Path(args.out).resolve()
    if args.worker:
        run_worker(args.runs, args.devices, args.quick, out)
        return
    out.mkdir(parents=True, exist_ok=True)
    names = quick_configs() if args.quick else list(CONFIGS)
    if args.configs:
        names = ["one device", *(c for c in names if c in args.configs and c != "one device")]
    skipped = [c for c in names if CONFIGS[c] is not None and not accepted(CONFIGS[c])]
    if skipped:
        print(f"skipped (PipeDreamStrategy does not accept their keywords): {', '.join(skipped)}")
    names = [c for c in names if c not in skipped]
    chosen = [s for s in settings(args.quick) if not args.only or s.name in args.only]
    for s in chosen:
        refused = [c for c in names if not s.takes(c)]
        if refused:
            print(f"not run on {s.name} (tied parameters): {', '.join(refused)}")
    start = time.perf_counter()
    launch([f"{s.name}/one device" for s in chosen], 1, args.quick, out)
    for stages in sorted({s.stages for s in chosen}):
        runs = [
            f"{s.name}/{c}"
            for s in chosen
            if s.stages == stages
            for c in names
            if c != "one device" and s.takes(c)
        ]
        launch(runs, stages, args.quick, out)
    results = collect(out)
    write_csv(results, out / "convergence.csv")
    plot(results, out / "convergence.png")
    print(table(results))
    print(f"wall time: {time.perf_counter() - start:.0f} s; results in {out}")


if __name__ == "__main__":
    main()
