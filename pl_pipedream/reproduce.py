"""``pl-pipedream reproduce``: PipeDream's Table 1 next to what our planner predicts for it.

For each row of the paper's Table 1 (SOSP 2019) that a published profile covers, the planner
partitions PipeDream's own profile of the model over the row's cluster and the command prints the
paper's configuration and speedup over data parallelism beside ours. The rows come from the table
that ships with the package (``pl_pipedream.published``; ``--table PATH`` reads another), which
holds only the cells checked against the paper; the profiles likewise (``--profiles DIR``).

Each row is planned twice: from PipeDream's published profile, and (unless
``--no-own-profile``) from our own model profiled on this machine
(``reproduce_profiles``, cached under ``--cache``) and scaled to the paper's per-GPU minibatch
and GPU (``--speed-factor``). For each plan ``reproduce_epochs`` simulates an epoch of data
parallelism, PipeDream and GPipe from the planner's cost model; the predicted speedup is the
ratio of the epoch times. The paper measured epoch time (or time to accuracy where that is all
the table has) on real GPUs. ``--markdown``, ``--png`` and ``--json`` write the table.

Like the rest of the CLI this module imports neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import csv
import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.topology import Topology, fill_innermost
from pl_pipedream.profile.graph import Profile
from pl_pipedream.published import load_profile, table1_text
from pl_pipedream.reproduce_epochs import (
    DEFAULT_SPEED_FACTOR,
    DEVICE_TFLOPS,
    EPOCH_SAMPLES,
    PER_GPU_BATCH,
    Epochs,
    assumptions,
    bar_chart,
    epochs,
    scale_profile,
)

__all__ = [
    "ReproduceError",
    "Row",
    "Outcome",
    "add_arguments",
    "cluster_topology",
    "read_table",
    "render_config",
    "reproduce",
    "run",
]


CLUSTERS = Path(__file__).resolve().parent / "configs" / "cluster"

# PipeDream's published profiles (profiler output, graph.txt) by Table 1 model name.
PROFILE_OF = {
    "VGG-16": "vgg16",
    "AlexNet": "alexnet",
    "ResNet-50": "resnet50",
    "GNMT-8": "gnmt",
    "GNMT-16": "gnmt_large",
}
# Rows Table 1 has whose cells the checked table does not hold: planned, paper cells left out.
UNCHECKED_ROWS = (("GNMT-8", "A", 1, 4), ("GNMT-8", "A", 3, 4), ("GNMT-8", "B", 2, 8))
NOT_CHECKED = "not in the checked table"
NO_PROFILE = "no published profile"
HEADER = (
    "row",
    "paper config",
    "our config (published profile)",
    "our config (our profile)",
    "paper speedup",
    "predicted (published profile)",
    "predicted (our profile)",
    "predicted/paper (published / ours)",
    "GPipe over DP (published / ours)",
)


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


@dataclass(frozen=True)
class Outcome:
    """A row with our plans for it (published profile, our profile) and their simulated epochs.

    ``plan`` is None where PipeDream published no profile of the model, ``own_plan`` where our
    own profile was not asked for.
    """

    row: Row
    plan: Plan | None = None
    epochs: Epochs | None = None
    own_plan: Plan | None = None
    own_epochs: Epochs | None = None
    own_meta: dict[str, str] | None = None  # the measured profile's (device, GEMM rate, ...)

    @property
    def config(self) -> str | None:
        return render_config(self.plan) if self.plan is not None else None

    @property
    def own_config(self) -> str | None:
        return render_config(self.own_plan) if self.own_plan is not None else None

    @property
    def predicted(self) -> float | None:
        return self.epochs.pipedream_speedup if self.epochs is not None else None

    @property
    def own_predicted(self) -> float | None:
        return self.own_epochs.pipedream_speedup if self.own_epochs is not None else None

    def _ratio(self, predicted: float | None) -> float | None:
        paper = self.row.paper_speedup
        if predicted is None or paper is None:
            return None
        return predicted / paper[0]

    @property
    def ratio(self) -> float | None:
        return self._ratio(self.predicted)

    @property
    def own_ratio(self) -> float | None:
        return self._ratio(self.own_predicted)

    def cells(self) -> tuple[str, ...]:
        paper = self.row.paper_speedup
        paper_cell = NOT_CHECKED if paper is None else f"{paper[0]:.2f}x ({paper[1]})"
        gpipe = [e.gpipe_speedup for e in (self.epochs, self.own_epochs) if e is not None]
        return (
            self.row.id,
            self.row.config or NOT_CHECKED,
            self.config or NO_PROFILE,
            self.own_config or "-",
            paper_cell,
            _times(self.predicted),
            _times(self.own_predicted),
            _pair(self.ratio, self.own_ratio),
            " / ".join(f"{value:.2f}x" for value in gpipe) or "-",
        )

    def to_dict(self) -> dict[str, object]:
        paper = self.row.paper_speedup
        return {
            "row": self.row.id,
            "model": self.row.model,
            "cluster": self.row.cluster,
            "servers": self.row.servers,
            "gpus_per_server": self.row.gpus_per_server,
            "paper_config": self.row.config,
            "paper_speedup_epoch": self.row.speedup_epoch,
            "paper_speedup_tta": self.row.speedup_tta,
            "ratio_against": None if paper is None else paper[1],
            "profile": PROFILE_OF.get(self.row.model),
            "our_config": self.config,
            "predicted_speedup": self.predicted,
            "ratio": self.ratio,
            "plan": None if self.plan is None else self.plan.to_dict(),
            "epochs": None if self.epochs is None else self.epochs.to_dict(),
            "own_config": self.own_config,
            "own_predicted_speedup": self.own_predicted,
            "own_ratio": self.own_ratio,
            "own_plan": None if self.own_plan is None else self.own_plan.to_dict(),
            "own_epochs": None if self.own_epochs is None else self.own_epochs.to_dict(),
        }


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pair(published: float | None, own: float | None) -> str:
    if published is None and own is None:
        return "-"
    return " / ".join("-" if v is None else f"{v:.2f}" for v in (published, own))


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


def cluster_topology(cluster: str, servers: int, gpus_per_server: int) -> Topology:
    """The part of a cluster (``configs/cluster/cluster_<x>.yaml``) a row's GPUs occupy.

    The GPUs fill the levels innermost first (``planner.topology.fill_innermost``): 4 GPUs of
    cluster A are one server (its PCIe bandwidth only), 16 are 4 servers of 4 joined by 10 Gbps
    Ethernet.
    """
    path = CLUSTERS / f"cluster_{cluster.lower()}.yaml"
    if not path.is_file():
        raise ReproduceError(
            f"the cluster must be one of the project's (cluster: {cluster}); add {path.name}"
        )
    spec = yaml.safe_load(path.read_text())["topology"]
    full = Topology.from_lists(spec["workers"], spec["bandwidths"])
    devices = servers * gpus_per_server
    part = fill_innermost(full, devices)
    if devices < 2 or part.num_workers != devices:
        raise ReproduceError(
            f"the row's GPUs must fill whole servers of its cluster (cluster: {cluster}, "
            f"servers x GPUs: {servers}x{gpus_per_server}); fix the row in the table"
        )
    return part


def render_config(result: Plan) -> str:
    """The plan as the paper writes configurations: ``16 (DP)``, ``straight`` or ``15-1``."""
    if result.num_stages == 1:
        return f"{result.num_workers} (DP)"
    if all(stage.replicas == 1 for stage in result.stages):
        return "straight"
    return result.shape


def reproduce(
    rows: list[Row],
    profiles: Path | None,
    cache: Path | None = None,
    speed_factor: float = DEFAULT_SPEED_FACTOR,
    microbatches: int | None = None,
) -> list[Outcome]:
    """Plan and simulate every row on its cluster, with the default planner options.

    From PipeDream's published profile where one covers the model (in ``profiles``, else the
    copy that ships with the package); from our own model profiled here when ``cache`` (where
    those profiles are kept) is given.
    """
    loaded: dict[str, Profile] = {}
    outcomes = []
    for row in rows:
        topology = cluster_topology(row.cluster, row.servers, row.gpus_per_server)
        samples, batch = EPOCH_SAMPLES.get(row.model), PER_GPU_BATCH.get(row.model)
        published = own = measured = None
        name = PROFILE_OF.get(row.model)
        if name is not None:
            if name not in loaded:
                loaded[name] = _published(profiles, name)
            published = make_plan(loaded[name], topology)
        if cache is not None and samples is not None:
            from pl_pipedream.reproduce_profiles import own_profile  # torch: only when asked

            measured, _ = own_profile(row.model, cache)
            factor = speed_factor * DEVICE_TFLOPS[row.cluster.upper()] / DEVICE_TFLOPS["A"]
            own = make_plan(scale_profile(measured, batch, factor), topology)
        outcomes.append(
            Outcome(
                row,
                published,
                _epochs(published, samples, batch, microbatches),
                own,
                _epochs(own, samples, batch, microbatches),
                None if measured is None else dict(measured.meta),
            )
        )
    return outcomes


def _published(profiles: Path | None, name: str) -> Profile:
    if profiles is None:
        return load_profile(name)
    path = profiles / f"{name}.txt"
    if not path.is_file():
        raise ReproduceError(
            f"the row's published profile must exist (--profiles: {profiles}, profile: "
            f"{path.name}); pass --profiles DIR holding it, or leave --profiles out"
        )
    return Profile.load(path)


def _epochs(
    result: Plan | None, samples: int | None, batch: int | None, microbatches: int | None
) -> Epochs | None:
    if result is None or samples is None or batch is None:
        return None
    return epochs(result, samples, batch, microbatches)


def render_text(outcomes: list[Outcome]) -> str:
    table = [HEADER, *(outcome.cells() for outcome in outcomes)]
    widths = [max(len(line[column]) for line in table) for column in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    )


def render_markdown(outcomes: list[Outcome], notes: str = "") -> str:
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
        *("| " + " | ".join(outcome.cells()) + " |" for outcome in outcomes),
    ]
    return "\n".join(lines) + "\n" + "".join(f"\n{line}\n" for line in notes.splitlines())


def write_png(outcomes: list[Outcome], path: Path) -> None:
    """Grouped bars per row: the paper's speedup, ours from the published and from our profile."""
    paper = [o.row.paper_speedup[0] if o.row.paper_speedup else None for o in outcomes]
    series = {
        "paper (SOSP 2019 Table 1)": paper,
        "predicted, published profile": [o.predicted for o in outcomes],
        "predicted, our profile": [o.own_predicted for o in outcomes],
    }
    bar_chart([o.row.id for o in outcomes], series, path)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "rows", nargs="*", default=["all"], help="row ids (e.g. vgg16_A_4x4) or all (default)"
    )
    parser.add_argument(
        "--table",
        type=Path,
        metavar="PATH",
        help="Table 1 CSV (default: the checked table that ships with the package)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        metavar="DIR",
        help="PipeDream's profiles, <name>.txt (default: the published ones the package ships)",
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="PATH", help="also write the table as Markdown here"
    )
    parser.add_argument("--png", type=Path, metavar="PATH", help="also draw the speedups here")
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    parser.add_argument(
        "--speed-factor",
        type=float,
        default=DEFAULT_SPEED_FACTOR,
        help="how much faster a V100 is than one thread of this CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="our profiles' cache (default: reproduce_cache beside --markdown/--png, else in .)",
    )
    parser.add_argument(
        "--no-own-profile", action="store_true", help="plan from the published profiles only"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="GPipe's microbatches per flush (default: 4 per stage)",
    )


def run(args: argparse.Namespace) -> int:
    cache = None
    if not args.no_own_profile:
        outputs = [p for p in (args.markdown, args.png) if p is not None]
        cache = args.cache or (outputs[0].parent if outputs else Path.cwd()) / "reproduce_cache"
    outcomes = reproduce(
        select(read_table(args.table), args.rows),
        args.profiles,
        cache,
        args.speed_factor,
        args.microbatches,
    )
    rates = sorted({o.own_meta.get("gemm_gflops", "") for o in outcomes if o.own_meta} - {""})
    notes = assumptions(rates, args.speed_factor, args.microbatches, not args.no_own_profile)
    if args.markdown:
        args.markdown.write_text(render_markdown(outcomes, notes))
    if args.png:
        write_png(outcomes, args.png)
    if args.json:
        print(json.dumps([outcome.to_dict() for outcome in outcomes]))
    else:
        print(render_text(outcomes))
        print()
        print(notes)
    return 0
