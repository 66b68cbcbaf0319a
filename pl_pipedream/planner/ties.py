"""Tied parameters: one parameter that layers on several stages use, and the traffic it costs.

``Tie`` is the one description of a tie that every layer uses: the stage cutting finds them
(``core.stage.find_ties``), the planner prices them here, and the runtime sums their gradients
(``runtime.ties``) or gives them versions of their own (``runtime.tied_versions``). It is the same
value on every rank: each holding stage's name for the parameter is in it, and a rank looks its
own up (``name_on``).

Every update, the ranks of the stages holding a tied parameter all-reduce its gradient. The DP
prices each stage on its own and cannot see a tie between stages that are not neighbours, so the
plan is priced afterwards: a ring all-reduce of ``W`` bytes among ``k`` ranks moves
``2 (k - 1) W / k`` bytes per rank, at the bandwidth of the topology's outermost level the plan
uses (the slowest link it may cross). The approximation: that time is added to the slowest
stage's time, as if a holding stage were the slowest, which is an upper bound; per minibatch, as
the DP's replication term is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from pl_pipedream.planner.plan import Plan

__all__ = ["Tie", "tie_seconds", "with_tied_traffic"]


@dataclass(frozen=True)
class Tie:
    """A parameter that layers of several stages use (one parameter, a copy on each holder).

    ``stages``, ``stage_names`` and ``stage_ranks`` run in step: holding stage ``stages[k]``
    calls the parameter ``stage_names[k]`` in its stage module and runs on ``stage_ranks[k]``
    (its replicas)."""

    names: tuple[str, ...]  # every state name the model gives it ("wte.weight", "head.weight")
    stages: tuple[int, ...]  # the stages whose layers use it, ascending
    stage_names: tuple[str, ...]  # its name in each holding stage's module
    stage_ranks: tuple[tuple[int, ...], ...]  # the ranks of each holding stage
    nbytes: int = 0  # its size when found, which the planner prices

    def __post_init__(self) -> None:
        lengths = (len(self.stages), len(self.stage_names), len(self.stage_ranks))
        if not self.names or len(set(lengths)) != 1:
            raise ValueError(
                f"a tie needs a name and one stage name and rank list per holding stage "
                f"(names: {list(self.names)}, stages: {list(self.stages)}, stage names: "
                f"{list(self.stage_names)}, stage ranks: {[list(r) for r in self.stage_ranks]})"
                "; give each holding stage its name and ranks"
            )

    @property
    def ranks(self) -> tuple[int, ...]:
        """Every rank holding a copy, stage by stage (replicas included)."""
        return tuple(rank for ranks in self.stage_ranks for rank in ranks)

    def name_in(self, stage: int) -> str | None:
        """Its name in ``stage``'s module; None where that stage does not hold it."""
        return self.stage_names[self.stages.index(stage)] if stage in self.stages else None

    def name_on(self, rank: int) -> str | None:
        """Its name in ``rank``'s stage module; None where that rank does not hold it."""
        for name, ranks in zip(self.stage_names, self.stage_ranks, strict=True):
            if rank in ranks:
                return name
        return None

    def describe(self) -> str:
        """For messages: ``wte.weight = head.weight on stages [0, 2]``."""
        return f"{' = '.join(self.names)} on stages {list(self.stages)}"


def tie_seconds(ranks: int, parameter_bytes: float, bandwidth: float) -> float:
    """Seconds of one ring all-reduce of ``parameter_bytes`` among ``ranks`` ranks."""
    if ranks < 2:
        return 0.0
    return 2.0 * (ranks - 1) * parameter_bytes / (ranks * bandwidth)


def with_tied_traffic(plan: Plan, ties: Sequence[Tie], bandwidth: float) -> Plan:
    """``plan`` with its ties' all-reduces counted (each tie's holding stages and bytes).
    ``meta["tied"]`` says what was added; ``slowest_stage_time`` includes it."""
    if not ties:
        return plan
    added = 0.0
    described = []
    for tie in ties:
        ranks = sum(plan.stages[s].replicas for s in tie.stages)
        seconds = tie_seconds(ranks, tie.nbytes, bandwidth)
        added += seconds
        described.append(f"stages {list(tie.stages)}: {tie.nbytes:.0f} B, {seconds * 1e3:.4f} ms")
    meta = {**plan.meta, "tied": "; ".join(described)}
    slowest = plan.slowest_stage_time + added if plan.slowest_stage_time > 0 else 0.0
    return replace(plan, slowest_stage_time=slowest, meta=meta)
