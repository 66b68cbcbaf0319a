"""``apps.metrics_log``: the app's ``metrics.csv`` keeps the rows of the steps before a resume.

The logger alone (rows written, a second logger on the same directory), then one-process
Lightning fits resumed from an earlier checkpoint in the same directory. The app's own resume
after a preemption is tested in test_train.py.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.apps.metrics_log import KeepMetricsHistory, ResumableCSVLogger


def rows(folder: Path) -> list[dict[str, str]]:
    with (folder / "metrics.csv").open(newline="") as file:
        return list(csv.DictReader(file))


def logged(folder: Path, steps: range, start_at: int | None = None, name: str = "loss") -> None:
    logger = ResumableCSVLogger(folder, name="", version="")
    if start_at is not None:
        logger.start_at(start_at)
    for step in steps:
        logger.log_metrics({name: float(step) / 10}, step=step)
    logger.finalize("success")


def test_a_second_run_keeps_the_rows_before_its_first_step_and_writes_after_them(
    tmp_path: Path,
) -> None:
    logged(tmp_path, range(10))
    first = rows(tmp_path)
    logged(tmp_path, range(6, 12), start_at=6)
    after = rows(tmp_path)
    assert [int(row["step"]) for row in after] == list(range(12))
    assert after[:6] == first[:6]


def test_a_run_from_step_0_starts_the_file_afresh(tmp_path: Path) -> None:
    logged(tmp_path, range(10), name="old")
    logged(tmp_path, range(4), start_at=0)
    after = rows(tmp_path)
    assert [int(row["step"]) for row in after] == list(range(4))
    assert set(after[0]) == {"loss", "step"}  # the old run's columns went with its rows


def test_a_resumed_run_with_new_metrics_widens_the_header(tmp_path: Path) -> None:
    logged(tmp_path, range(5))
    logged(tmp_path, range(5, 8), start_at=5, name="acc")
    after = rows(tmp_path)
    assert [int(row["step"]) for row in after] == list(range(8))
    assert (after[0]["loss"], after[0]["acc"]) == ("0.0", "")
    assert (after[5]["loss"], after[5]["acc"]) == ("", "0.5")


def test_without_a_start_the_rows_go_after_the_files(tmp_path: Path) -> None:
    logged(tmp_path, range(3))
    logged(tmp_path, range(3))
    assert [int(row["step"]) for row in rows(tmp_path)] == [0, 1, 2, 0, 1, 2]


class Regression(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = torch.nn.functional.mse_loss(self.layer(batch[0]), batch[1])
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(folder: Path, epochs: int, ckpt_path: str | None = None) -> None:
    data = TensorDataset(torch.randn(16, 2), torch.randn(16, 1))
    trainer = pl.Trainer(
        max_epochs=epochs,
        logger=ResumableCSVLogger(folder, name="", version=""),
        callbacks=[KeepMetricsHistory(), ModelCheckpoint(folder / "checkpoints", save_top_k=-1)],
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_model_summary=False,
        accelerator="cpu",
        devices=1,
    )
    trainer.fit(Regression(), DataLoader(data, batch_size=4), ckpt_path=ckpt_path)


def test_a_fit_resumed_from_an_earlier_checkpoint_logs_each_step_once(tmp_path: Path) -> None:
    fit(tmp_path, epochs=3)
    first = rows(tmp_path)
    assert [int(row["step"]) for row in first] == list(range(12))
    fit(tmp_path, epochs=3, ckpt_path=str(tmp_path / "checkpoints" / "epoch=0-step=4.ckpt"))
    after = rows(tmp_path)
    assert [int(row["step"]) for row in after] == list(range(12))  # 4..11 trained again
    assert after[:4] == first[:4]
    assert [row["epoch"] for row in after] == [str(step // 4) for step in range(12)]


def test_a_fresh_fit_in_a_used_directory_writes_only_its_own_rows(tmp_path: Path) -> None:
    fit(tmp_path, epochs=3)
    fit(tmp_path, epochs=1)
    assert [int(row["step"]) for row in rows(tmp_path)] == list(range(4))
