"""What one rank checks at setup: its own stage and the stages next to it.

A rank runs its own list and exchanges messages with the replicas of the neighbouring stages;
its replicas join its ``ALLREDUCE``. So the lists of its stage and of the stages on either side
hold everything its list depends on directly. Checking them (``build(..., ranks=...)`` then
``validate``) costs a rank a few times the length of its own list, which grows linearly with the
stages; checking every rank's list would cost every rank the whole pipeline's.

What the neighbourhood check covers: each of a rank's sends and receives has its partner, in the
same or an earlier Lightning step; its stage's minibatches each have one forward and one backward
with the same version; its versions follow the mode and fit the stash. A deadlock is a cycle of
ranks each waiting for the next; in a straight pipeline such a cycle is two neighbouring stages
waiting for each other, which both of their checks see. With replicated stages a cycle may pass
through more stages than one neighbourhood holds; the full ``validate`` of the whole schedule (the
tests and ``pl-pipedream simulate``) covers those.
"""

from __future__ import annotations

from collections.abc import Iterable

from pl_pipedream.planner.plan import Plan

__all__ = ["neighbourhood"]


def neighbourhood(plan: Plan, ranks: Iterable[int]) -> frozenset[int]:
    """The ranks of the stages of ``ranks`` and of the stages before and after each of them."""
    out: set[int] = set()
    for rank in ranks:
        for own in plan.stages_of_rank(rank):
            for stage in plan.stages[max(0, own.index - 1) : own.index + 2]:
                out.update(stage.ranks)
    return frozenset(out)
