"""The app's ``metrics.csv``, continued across a resume: every step of the run, each once.

Lightning's ``CSVLogger`` deletes the ``metrics.csv`` of its version directory when it starts; the
app's directory is fixed (``output_dir``, so that a requeued job finds its checkpoints), and a run
resumed with ``ckpt_path`` would keep only its own steps. ``ResumableCSVLogger`` keeps the file.
When training starts, ``KeepMetricsHistory`` (a callback ``train`` adds) tells it the step the run
starts from (``trainer.global_step``, restored from the checkpoint): it drops the rows of that step
and later ones, which the run logs again, and appends the run's own rows after the rest. A run
from the beginning starts at step 0 and so starts the file afresh, as Lightning's logger does.
"""

from __future__ import annotations

import csv
from typing import Any

from lightning.fabric.loggers.csv_logs import _ExperimentWriter
from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.utilities.rank_zero import rank_zero_only
from typing_extensions import override

__all__ = ["KeepMetricsHistory", "ResumableCSVLogger"]


class ResumableCSVLogger(CSVLogger):
    """Lightning's ``CSVLogger`` that appends to the ``metrics.csv`` it finds; ``start_at(step)``
    drops the rows the run will log again."""

    @property
    @override
    @rank_zero_experiment
    def experiment(self) -> _ExperimentWriter:
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        self._experiment = _KeptWriter(log_dir=self.log_dir)
        return self._experiment

    @rank_zero_only
    def start_at(self, step: int) -> None:
        """Keep the rows of the steps before ``step`` (what the checkpoint resumed from trained);
        the run logs ``step`` and later ones itself."""
        writer = self.experiment
        if isinstance(writer, _KeptWriter):
            writer.keep_before(step)


class KeepMetricsHistory(Callback):
    """Tells every ``ResumableCSVLogger`` the step the fit starts from, once the checkpoint (if
    any) has been restored."""

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        for logger in trainer.loggers:
            if isinstance(logger, ResumableCSVLogger):
                logger.start_at(trainer.global_step)


class _KeptWriter(ExperimentWriter):
    """Lightning's writer that keeps an existing ``metrics.csv`` and writes after its rows."""

    def __init__(self, log_dir: str) -> None:
        super().__init__(log_dir=log_dir)
        self.metrics_keys = self._read()[0]  # new rows go under the file's header

    @override
    def _check_log_dir_exists(self) -> None:
        """Leave the directory's files alone (Lightning's writer deletes ``metrics.csv``)."""

    def keep_before(self, step: int) -> None:
        """Drop the file's rows of ``step`` and later steps (rows not yet written stay)."""
        header, rows = self._read()
        kept = [row for row in rows if int(float(row["step"])) < step]
        if len(kept) == len(rows):
            return
        if not kept:
            self._fs.rm_file(self.metrics_file_path)
            self.metrics_keys = []
            return
        with self._fs.open(self.metrics_file_path, "w", newline="") as file:
            writer = csv.DictWriter(file, fieldnames=header)
            writer.writeheader()
            writer.writerows(kept)

    def _read(self) -> tuple[list[str], list[dict[str, str]]]:
        """The header and rows of ``metrics.csv``; none when there is no such file."""
        if not self._fs.isfile(self.metrics_file_path):
            return [], []
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            return list(reader.fieldnames or []), list(reader)
