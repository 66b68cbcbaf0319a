"""The reproduction's table as text or Markdown, and the assumptions printed under it.

One line per row: the paper's configuration and speedup (SOSP 2019 Table 1) beside our plan's
configuration and predicted speedup, from PipeDream's published profile and from ours.
"""

from __future__ import annotations

from collections.abc import Mapping

from pl_pipedream.reproduce.epochs import DEVICE_TFLOPS, EPOCH_SAMPLES, PER_GPU_BATCH
from pl_pipedream.reproduce.predict import Outcome

__all__ = ["HEADER", "assumptions", "cells", "render_markdown", "render_text"]

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


def cells(outcome: Outcome) -> tuple[str, ...]:
    """The row's line of the table, one cell per column of ``HEADER``."""
    paper = outcome.row.paper_speedup
    paper_cell = NOT_CHECKED if paper is None else f"{paper[0]:.2f}x ({paper[1]})"
    gpipe = [e.gpipe_speedup for e in (outcome.epochs, outcome.own_epochs) if e is not None]
    return (
        outcome.row.id,
        outcome.row.config or NOT_CHECKED,
        outcome.config or NO_PROFILE,
        outcome.own_config or "-",
        paper_cell,
        _times(outcome.predicted),
        _times(outcome.own_predicted),
        _pair(outcome.ratio, outcome.own_ratio),
        " / ".join(f"{value:.2f}x" for value in gpipe) or "-",
    )


def _times(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _pair(published: float | None, own: float | None) -> str:
    if published is None and own is None:
        return "-"
    return " / ".join("-" if v is None else f"{v:.2f}" for v in (published, own))


def render_text(outcomes: list[Outcome]) -> str:
    """The table in columns padded to their widest cell."""
    table = [HEADER, *(cells(outcome) for outcome in outcomes)]
    widths = [max(len(line[column]) for line in table) for column in range(len(HEADER))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip()
        for line in table
    )


def render_markdown(outcomes: list[Outcome], notes: str = "") -> str:
    """The table in Markdown, then ``notes`` one paragraph a line."""
    lines = [
        "| " + " | ".join(HEADER) + " |",
        "|" + "|".join("---" for _ in HEADER) + "|",
        *("| " + " | ".join(cells(outcome)) + " |" for outcome in outcomes),
    ]
    return "\n".join(lines) + "\n" + "".join(f"\n{line}\n" for line in notes.splitlines())


def assumptions(
    rates: list[str], speed_factor: float, microbatches: int | None, own_profile: bool = True
) -> str:
    """What the predictions assume, printed under the table (the line on our own profile only
    when the table has its columns)."""
    gpipe = "4 per stage" if microbatches is None else str(microbatches)
    lines = [
        "Paper config and paper speedup: PipeDream (SOSP 2019) Table 1, the paper's figures; "
        "every other cell is computed here.",
        "Predicted: one simulated epoch of data parallelism over one of PipeDream (1F1B steady "
        "state plus one fill), both from the planner's cost model (DP all-reduce "
        "4 (n-1)/n x bytes / bandwidth per level, not overlapped with compute).",
        f"GPipe: the same stages, {gpipe} microbatches per flush, fill and drain every flush.",
        f"Epoch: {_listing(EPOCH_SAMPLES)} samples.",
    ]
    if own_profile:
        lines.insert(
            3,
            "Our profile: our model profiled here on one sample, one CPU thread, scaled to the "
            f"per-GPU minibatch ({_listing(PER_GPU_BATCH)}) and divided by the speed factor "
            f"{speed_factor:g} (a V100 over one thread of this CPU; x{DEVICE_TFLOPS['C']:g}/"
            f"{DEVICE_TFLOPS['A']:g} for cluster C's Titan X).",
        )
    if rates:
        lines.append(
            f"This CPU's one-thread fp32 GEMM rate when profiled: {', '.join(rates)} GFLOP/s."
        )
    return "\n".join(lines)


def _listing(values: Mapping[str, int]) -> str:
    return ", ".join(f"{model} {value:,}" for model, value in values.items())
