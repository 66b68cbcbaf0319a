"""The rows of PipeDream's Table 1 (SOSP 2019) that ``pl-pipedream reproduce`` plans.

The rows come from the table that ships with the package (``pl_pipedream.published``; ``--table
PATH`` reads another), which holds only the cells checked against the paper; the rows Table 1 has
whose cells were not checked are planned with their paper cells left out.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

from pl_pipedream.published import table1_text

__all__ = ["PROFILE_OF", "ReproduceError", "Row", "read_table", "select"]

# PipeDream's published profiles (profiler output, graph.txt) by Table 1 model name.
PROFILE_OF: Mapping[str, str] = MappingProxyType(
    {
        "VGG-16": "vgg16",
        "AlexNet": "alexnet",
        "ResNet-50": "resnet50",
        "GNMT-8": "gnmt",
        "GNMT-16": "gnmt_large",
    }
)
# Rows Table 1 has whose cells the checked table does not hold: planned, paper cells left out.
UNCHECKED_ROWS = (("GNMT-8", "A", 1, 4), ("GNMT-8", "A", 3, 4), ("GNMT-8", "B", 2, 8))


class ReproduceError(ValueError):
    """A table, profile or row the reproduction cannot use."""


@dataclass(frozen=True)
class Row:
    """One Table 1 row: model, cluster, servers x GPUs and the paper's checked cells (or None)."""

    model: str
    cluster: str
    servers: int
    gpus_per_server: int
    config: str | None = None
    speedup_epoch: float | None = None
    speedup_tta: float | None = None

    @property
    def id(self) -> str:
        model = self.model.lower().replace("-", "")
        return f"{model}_{self.cluster}_{self.servers}x{self.gpus_per_server}"

    @property
    def paper_speedup(self) -> tuple[float, str] | None:
        """The paper's speedup over data parallelism and what it measures (epoch time first)."""
        if self.speedup_epoch is not None:
            return self.speedup_epoch, "epoch"
        if self.speedup_tta is not None:
            return self.speedup_tta, "TTA"
        return None


def _number(text: str) -> float | None:
    return float(text) if text.strip() else None


def read_table(path: Path | None = None) -> list[Row]:
    """Table 1's checked rows (comment lines start with #), then the unchecked.

    From ``path``, or from the table that ships with the package when ``path`` is None.
    """
    if path is None:
        text = table1_text()
    elif path.is_file():
        text = path.read_text()
    else:
        raise ReproduceError(
            f"the reproduction reads PipeDream's Table 1 from a CSV file (--table: {path}); "
            "pass --table PATH to a CSV with table1.csv's columns, or leave --table out"
        )
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith("#")]
    rows = [
        Row(
            record["model"],
            record["cluster"],
            int(record["servers"]),
            int(record["gpus_per_server"]),
            record["pipedream_config"] or None,
            _number(record["speedup_epoch_time"]),
            _number(record["speedup_time_to_accuracy"]),
        )
        for record in csv.DictReader(lines)
    ]
    known = {row.id for row in rows}
    extra = [Row(*cells) for cells in UNCHECKED_ROWS]
    return rows + [row for row in extra if row.id not in known]


def select(rows: list[Row], names: list[str]) -> list[Row]:
    """The rows named (case-insensitive ids), in the order given; ``all`` (or none) is every row."""
    if not names or [name.lower() for name in names] == ["all"]:
        return rows
    by_id = {row.id.lower(): row for row in rows}
    unknown = [name for name in names if name.lower() not in by_id]
    if unknown:
        raise ReproduceError(
            f"a row must be one of Table 1's (row: {', '.join(unknown)}); use all or one of "
            f"{', '.join(row.id for row in rows)}"
        )
    return [by_id[name.lower()] for name in names]
