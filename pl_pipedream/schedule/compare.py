"""Several sync modes simulated on one plan with the same counts and times, side by side.

``pl-pipedream simulate --compare`` prints it: per mode the time per minibatch, the run's total,
the largest and mean bubble over the ranks, and the peak activations and weight versions of any
stage, so that a mode's fewer bubbles can be weighed against the memory it keeps. A mode that
cannot serve the counts (``rules.check_arguments``) is left out with the reason.

A mode of several stages per rank (``interleaved``, ``zbv``) runs on the plan recut into chunks
(``planner.recut``: same ranks, same work per rank), so its activations are counted in stages'
worth: a rank's chunk activations over its chunks per rank.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pl_pipedream.planner.chunks import CONTIGUOUS
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.recut import recut
from pl_pipedream.schedule.build import build
from pl_pipedream.schedule.modes import SyncMode
from pl_pipedream.schedule.result import SimulationResult
from pl_pipedream.schedule.simulate import simulate
from pl_pipedream.schedule.validate import validate

__all__ = ["Comparison", "compare", "plan_for", "render_comparison"]


@dataclass(frozen=True)
class Comparison:
    """One mode's figures (``result``), or why it was left out (``skipped``)."""

    sync: SyncMode
    result: SimulationResult | None = None
    skipped: str | None = None

    def to_dict(self) -> dict[str, Any]:
        figures = None if self.result is None else self.result.to_dict()
        return {
            "sync": self.sync.value,
            "result": figures,
            "skipped": self.skipped,
        }


def compare(
    plan: Plan,
    modes: Iterable[SyncMode | str],
    num_batches: int,
    microbatches: int,
    **times: Any,
) -> list[Comparison]:
    """Build, validate and simulate ``plan`` under each of ``modes``; ``times`` are
    ``simulate``'s keyword arguments (stage times, bandwidth, ``weight_share``)."""
    out = []
    for sync in modes:
        mode = SyncMode.parse(sync)
        try:
            schedule = build(plan_for(plan, mode), mode, num_batches, microbatches)
        except ValueError as error:  # counts or a plan the mode cannot serve
            out.append(Comparison(mode, skipped=str(error)))
            continue
        validate(schedule)
        out.append(Comparison(mode, result=simulate(schedule, **times)))
    return out


def plan_for(plan: Plan, mode: SyncMode) -> Plan:
    """``plan``, or a plan of one stage per rank recut into the chunks ``mode`` runs."""
    if mode.placement != CONTIGUOUS and plan.placement == CONTIGUOUS:
        return recut(plan, mode.placement)
    return plan


def render_comparison(rows: Iterable[Comparison]) -> str:
    """One line per mode."""
    lines = [
        "mode            ms/minibatch    total ms  max bubble  mean bubble  activations  versions"
    ]
    for row in rows:
        name = row.sync.value
        if row.result is None:
            lines.append(f"{name:<14}  left out: {row.skipped}")
            continue
        r = row.result
        mean = sum(r.bubble) / len(r.bubble)
        chunks = max(len(stages) for stages in r.stages_of_rank)
        activations = f"{max(r.rank_in_flight) / chunks:g}"
        lines.append(
            f"{name:<14}  {r.time_per_minibatch_ms:>12.4f}  {r.total_ms:>10.3f}  "
            f"{max(r.bubble):>10.3f}  {mean:>11.3f}  {activations:>11}  "
            f"{max(r.peak_versions):>8}"
        )
    return "\n".join(lines)
