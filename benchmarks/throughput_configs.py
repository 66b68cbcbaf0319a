"""pipeline_throughput's configurations: their names parsed and checked, the defaults per
workload, and what each compares with (the sync mode the simulator builds for torch's schedules).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from pl_pipedream.schedule import SYNC_MODES, SyncMode

NUM_STAGES = 2
MINIBATCH = "minibatch"  # the suffix of the equal-minibatch view's configurations
CONFIGS = (
    "single",
    "single-x2",
    "lightning-1",
    "ours-async-1",
    "ours-async-1-unbound",
    "ours-async-4",
    "ours-flush-1",
    "ours-flush-8",
    "ours-gpipe-8",
    "torch-1F1B-2",
    "torch-1F1B-8",
    "torch-GPipe-8",
    "ours-async-4-minibatch",
    "ours-flush-8-minibatch",
    "ours-gpipe-8-minibatch",
    "torch-1F1B-8-minibatch",
    "torch-GPipe-8-minibatch",
)
DEFAULT_CONFIGS = {
    "mlp": [
        "single",
        "single-x2",
        "lightning-1",
        "ours-async-1",
        "ours-async-1-unbound",
        "ours-async-4",
        "ours-flush-8",
        "ours-gpipe-8",
        "torch-1F1B-8",
        "torch-GPipe-8",
        "ours-flush-8-minibatch",
        "torch-1F1B-8-minibatch",
        "torch-GPipe-8-minibatch",
    ],
    "gpt": [
        "single",
        "single-x2",
        "lightning-1",
        "ours-async-1",
        "ours-flush-8",
        "torch-1F1B-8",
        "ours-flush-8-minibatch",
        "torch-1F1B-8-minibatch",
    ],
    "overhead": [
        "single",
        "lightning-1",
        "ours-async-1",
        "ours-flush-1",
        "ours-flush-8",
        "torch-1F1B-2",
        "torch-1F1B-8",
    ],
}
QUICK_CONFIGS = {  # a few seconds each on an idle machine; both views where they apply
    "mlp": ["single", "ours-flush-2", "torch-1F1B-2-minibatch"],
    "gpt": ["ours-async-1", "torch-1F1B-2"],
    "overhead": ["ours-flush-1", "torch-1F1B-2"],
}
OVERHEAD_TARGET_MS = 1.5  # per step with one microbatch, per microbatch with 8
TORCH_AS_OURS = {"1F1B": "flush", "GPipe": "gpipe"}  # the schedule the simulator builds for it
KINDS = (
    "FORWARD",
    "BACKWARD",
    "BACKWARD_INPUT",
    "BACKWARD_WEIGHT",
    "STEP",
    "RECV_ACTIVATION",
    "RECV_GRAD",
    "SEND_ACTIVATION",
    "SEND_GRAD",
)

Result = dict[str, Any]


@dataclass(frozen=True)
class Config:
    """One configuration's name parsed: who runs it, how, and on how many rows."""

    name: str
    owner: str  # single, single-x2, lightning-1, ours or torch
    schedule: str = ""  # our sync mode, or torch's schedule
    microbatches: int = 1
    unbound: bool = False
    equal_minibatch: bool = False

    @staticmethod
    def parse(name: str) -> Config:
        if not name.startswith(("ours-", "torch-")):
            return Config(name, name)
        owner, schedule, m, *rest = name.split("-")
        if not set(rest) <= {"unbound", MINIBATCH} or len(set(rest)) < len(rest):
            raise ValueError(f"unknown suffix (config: {name})")
        return Config(name, owner, schedule, int(m), "unbound" in rest, MINIBATCH in rest)

    @property
    def piped(self) -> bool:
        return self.owner in ("ours", "torch")

    def rows(self, args: argparse.Namespace) -> int:
        """Rows per batch: m microbatches of ``--microbatch`` rows at equal microbatch,
        ``--microbatch`` rows (split m ways) at equal minibatch."""
        return args.microbatch if self.equal_minibatch else self.microbatches * args.microbatch

    def microbatch_rows(self, args: argparse.Namespace) -> int:
        return self.rows(args) // self.microbatches


def stage_count(sync: str) -> int:
    """Stages our pipeline cuts for ``sync``: one per rank, or two per rank for the modes of
    several stages per rank (placed by the strategy: interleaved, or in a V), the 4 stages
    torch's loop and V schedules cut."""
    return 2 * NUM_STAGES if SyncMode.parse(sync).chunked else NUM_STAGES


def sync_of(config: Config) -> str:
    return config.schedule if config.owner == "ours" else TORCH_AS_OURS[config.schedule]


def config_name(name: str) -> str:
    """``name`` if it names a configuration (see ``--configs``), else argparse's error."""
    try:
        config = Config.parse(name)
    except ValueError:
        config = None
    owners = ("single", "single-x2", "lightning-1", "ours", "torch")
    known = config is not None and config.owner in owners and config.microbatches >= 1
    if known and config.owner == "ours":
        known = config.schedule in SYNC_MODES
    if known and config.owner == "torch":
        known = config.schedule in TORCH_AS_OURS and not config.unbound
    if not known:
        raise argparse.ArgumentTypeError(
            f"a configuration is single, single-x2, lightning-1, "
            f"ours-<sync>-<m>[-unbound][-minibatch] or torch-<1F1B|GPipe>-<m>[-minibatch] "
            f"(config: {name}); e.g. ours-flush-8 or torch-1F1B-8-minibatch"
        )
    return name
