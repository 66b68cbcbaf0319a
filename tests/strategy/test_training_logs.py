"""What ``training_step`` logs reaches every logger and every rank as on one device.

The last stage is never rank 0 here (rank 0 owns the loggers). One launch of two gloo ranks fits
``flush`` (``microbatches=1``) with a CSV and a TensorBoard logger, ``ModelCheckpoint`` and
``EarlyStopping`` monitoring a metric logged in ``training_step``, then ``async`` with two
microbatches; a launch of three ranks fits three stages, then a last stage with two replicas
(``microbatches=2``). What the loggers wrote and what every rank's Trainer holds
(``callback_metrics``, ``logged_metrics``, ``progress_bar_metrics``, before every step and at the
end) are compared with one device's run.
"""

from __future__ import annotations

import csv
import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan
from tests.runtime.distributed import run
from tests.runtime.test_executor import loss_fn
from tests.strategy.test_lightning_features import Net

pytestmark = pytest.mark.slow  # two launches (2 and 3 ranks) and one device

BATCH, BATCHES, EPOCHS = 4, 6, 2
PIPELINE_ONLY = {"train_loss"}  # the strategy's own


class Logging(Net):
    """``Net`` whose ``training_step`` logs with every kind of option."""

    def __init__(self) -> None:
        super().__init__(optimizer="sgd")

    def training_step(self, batch, batch_idx):  # type: ignore[no-untyped-def]
        x, y = batch
        output = self(x)
        loss = loss_fn(output, y)
        hits = (output.argmax(1) == y.argmax(1)).float()
        self.log("my_train_loss", loss, prog_bar=True)
        self.log("my_train_acc", hits.mean(), on_step=True, on_epoch=True)
        self.log(
            "my_peak", output.detach().abs().max(), on_step=False, on_epoch=True, reduce_fx="max"
        )
        counts = {"my_rows": float(len(x)), "my_hits": hits.sum()}
        self.log_dict(counts, reduce_fx="sum", on_epoch=True)
        self.log("my_hidden", 3 * loss, logger=False, prog_bar=True, batch_size=len(x))
        return loss


def loader() -> DataLoader:
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(BATCH * BATCHES, 6, generator=generator)
    y = torch.randn(BATCH * BATCHES, 3, generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


class Metrics(Callback):
    """Every rank's metrics before each step (what the previous steps left) and at the end."""

    def __init__(self) -> None:
        self.steps: list[dict[str, dict[str, float]]] = []
        self.end: dict[str, dict[str, float]] = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.steps.append(held(trainer))

    def on_train_end(self, trainer, pl_module) -> None:  # type: ignore[no-untyped-def]
        self.end = held(trainer)


def held(trainer: Trainer) -> dict[str, dict[str, float]]:
    kinds = ("callback_metrics", "logged_metrics", "progress_bar_metrics")
    return {kind: {k: float(v) for k, v in getattr(trainer, kind).items()} for kind in kinds}


def fit(strategy: Any, devices: int, out: Path | None, monitor: bool = False) -> dict:
    metrics = Metrics()
    callbacks: list[Callback] = [metrics]
    if monitor:
        best = ModelCheckpoint(str(out / "checkpoints"), monitor="my_train_loss", save_top_k=1)
        stop = EarlyStopping(monitor="my_train_acc_epoch", mode="max", patience=10)
        callbacks += [best, stop]
    loggers = (
        [CSVLogger(str(out), name="csv"), TensorBoardLogger(str(out), name="tb")] if out else False
    )
    trainer = Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=EPOCHS,
        use_distributed_sampler=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=monitor,
        logger=loggers,
        log_every_n_steps=1,
        callbacks=callbacks,
    )
    trainer.fit(Logging(), loader())
    result: dict[str, Any] = {"steps": metrics.steps, "end": metrics.end}
    if monitor:
        result["best"] = float(best.best_model_score)
        result["best_path"] = Path(best.best_model_path).name
        result["stopped"] = stop.stopped_epoch
    return result


def _as_launched(rank: int, world: int) -> None:
    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(world))


def _two_ranks(rank: int, world: int, out: str) -> dict:
    _as_launched(rank, world)
    flush = PipeDreamStrategy(sync="flush", balance=[3, 3], microbatches=1, timeout=120)
    async_ = PipeDreamStrategy(sync="async", balance=[3, 3], microbatches=2, timeout=120)
    return {
        "flush": fit(flush, world, Path(out) / "flush", monitor=True),
        "async": fit(async_, world, None),
    }


def _three_ranks(rank: int, world: int, out: str) -> dict:
    _as_launched(rank, world)
    stages = PipeDreamStrategy(sync="flush", balance=[2, 2, 2], microbatches=1, timeout=120)
    plan = Plan.from_balance([3, 3], replicas=[1, 2])
    replicated = PipeDreamStrategy(sync="flush", plan=plan, microbatches=2, timeout=120)
    return {
        "stages": fit(stages, world, Path(out) / "stages"),
        "replicated": fit(replicated, world, Path(out) / "replicated"),
    }


def launch(world: int, fn: Any, out: Path) -> dict[int, dict]:
    results = run(world, fn, str(out), timeout=600.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {rank: value for rank, (_, value) in results.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("logs")
    return {
        "single": fit("auto", 1, out / "single", monitor=True),
        "two": launch(2, _two_ranks, out),
        "three": launch(3, _three_ranks, out),
        "out": out,
    }


# ----- reading what the loggers wrote -----------------------------------------------------------


def csv_values(directory: Path) -> dict[tuple[int, str], float]:
    """{(step, key): value} of every non-empty cell of the CSV logger's file."""
    (path,) = directory.glob("csv/version_*/metrics.csv")
    values = {}
    with path.open() as file:
        for row in csv.DictReader(file):
            step = int(row.pop("step"))
            values.update({(step, k): float(v) for k, v in row.items() if v != ""})
    return values


def tensorboard_values(directory: Path) -> dict[tuple[int, str], float]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (events,) = directory.glob("tb/version_*")
    accumulator = EventAccumulator(str(events))
    accumulator.Reload()
    return {
        (event.step, tag): event.value
        for tag in accumulator.Tags()["scalars"]
        for event in accumulator.Scalars(tag)
    }


def same(got: dict, expected: dict, tolerance: float, what: str) -> None:
    """Equal keys; values within ``tolerance`` (absolute, and relative to the value)."""
    got = {
        k: v for k, v in got.items() if (k[1] if isinstance(k, tuple) else k) not in PIPELINE_ONLY
    }
    assert sorted(got) == sorted(expected), f"{what}: keys differ"
    for k, value in expected.items():
        close = math.isclose(got[k], value, rel_tol=tolerance, abs_tol=tolerance)
        assert close, f"{what}, {k}: {got[k]} against one device's {value}"


def held_same(got: dict, expected: dict, tolerance: float, what: str) -> None:
    for kind, values in expected.items():
        same(got[kind], values, tolerance, f"{what}, {kind}")


# ----- the tests --------------------------------------------------------------------------------

LOGGED = ("flush", "stages", "replicated")
TOLERANCE = {"flush": 1e-6, "stages": 1e-6, "replicated": 1e-6}  # replicated: 2 microbatches


def where(runs: dict, name: str) -> tuple[dict[int, dict], Path]:
    ranks = runs["two"] if name in ("flush", "async") else runs["three"]
    return {rank: value[name] for rank, value in ranks.items()}, runs["out"] / name


@pytest.mark.parametrize("name", LOGGED)
def test_the_loggers_get_what_one_device_logs(runs, name: str) -> None:  # type: ignore[no-untyped-def]
    _, directory = where(runs, name)
    single = runs["out"] / "single"
    expected = csv_values(single)
    assert {"my_train_loss", "my_train_acc_epoch", "my_peak", "my_rows_epoch"} <= {
        key for _, key in expected
    }
    same(csv_values(directory), expected, TOLERANCE[name], f"{name}, CSV")
    same(tensorboard_values(directory), tensorboard_values(single), TOLERANCE[name], f"{name}, TB")


@pytest.mark.parametrize("name", LOGGED)
def test_every_rank_holds_one_devices_metrics_at_every_step(runs, name: str) -> None:  # type: ignore[no-untyped-def]
    ranks, _ = where(runs, name)
    single = runs["single"]
    assert single["end"]["progress_bar_metrics"]["my_hidden"] > 0
    for rank, got in ranks.items():
        assert len(got["steps"]) == len(single["steps"]) == BATCHES * EPOCHS
        for step, (mine, expected) in enumerate(zip(got["steps"], single["steps"], strict=True)):
            held_same(mine, expected, TOLERANCE[name], f"{name}, rank {rank}, step {step}")
        held_same(got["end"], single["end"], TOLERANCE[name], f"{name}, rank {rank}, end")


def test_model_checkpoint_and_early_stopping_monitor_a_training_step_metric(runs) -> None:  # type: ignore[no-untyped-def]
    single = runs["single"]
    for rank, result in runs["two"].items():
        got = result["flush"]
        assert math.isclose(got["best"], single["best"], rel_tol=1e-6), f"rank {rank}"
        assert (got["best_path"], got["stopped"]) == (single["best_path"], single["stopped"])
    assert list((runs["out"] / "flush" / "checkpoints").glob("*.ckpt"))


def test_async_ranks_agree_on_every_metric_and_log_every_key(runs) -> None:  # type: ignore[no-untyped-def]
    ranks = {rank: value["async"] for rank, value in runs["two"].items()}
    assert ranks[0]["steps"] == ranks[1]["steps"] and ranks[0]["end"] == ranks[1]["end"]
    for kind, values in runs["single"]["end"].items():
        assert set(ranks[0]["end"][kind]) - PIPELINE_ONLY == set(values), kind
    # every batch counted once per epoch: the rows summed over the epoch, as on one device
    assert ranks[0]["end"]["callback_metrics"]["my_rows_epoch"] == BATCH * BATCHES
