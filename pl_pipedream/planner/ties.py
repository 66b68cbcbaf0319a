"""The extra traffic of tied parameters: one parameter that layers on several stages use.

Every update, the ranks of the stages holding a tied parameter all-reduce its gradient
(``runtime.ties``). The DP prices each stage on its own and cannot see a tie between stages that
are not neighbours, so the plan is priced afterwards: a ring all-reduce of ``W`` bytes among
``k`` ranks moves ``2 (k - 1) W / k`` bytes per rank, at the bandwidth of the topology's outermost
level the plan uses (the slowest link it may cross). The approximation: that time is added to the
slowest stage's time, as if a holding stage were the slowest, which is an upper bound; per
minibatch, as the DP's replication term is.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from pl_pipedream.planner.plan import Plan

__all__ = ["tie_seconds", "with_tied_traffic"]


def tie_seconds(ranks: int, parameter_bytes: float, bandwidth: float) -> float:
    """Seconds of one ring all-reduce of ``parameter_bytes`` among ``ranks`` ranks."""
    if ranks < 2:
        return 0.0
    return 2.0 * (ranks - 1) * parameter_bytes / (ranks * bandwidth)


def with_tied_traffic(
    plan: Plan, ties: Sequence[tuple[Sequence[int], float]], bandwidth: float
) -> Plan:
    """``plan`` with its ties' all-reduces counted: ``ties`` gives each tie's holding stages and
    its bytes. ``meta["tied"]`` says what was added; ``slowest_stage_time`` includes it."""
    if not ties:
        return plan
    added = 0.0
    described = []
    for stages, nbytes in ties:
        ranks = sum(plan.stages[s].replicas for s in stages)
        seconds = tie_seconds(ranks, nbytes, bandwidth)
        added += seconds
        described.append(f"stages {list(stages)}: {nbytes:.0f} B, {seconds * 1e3:.4f} ms")
    meta = {**plan.meta, "tied": "; ".join(described)}
    slowest = plan.slowest_stage_time + added if plan.slowest_stage_time > 0 else 0.0
    return replace(plan, slowest_stage_time=slowest, meta=meta)
