"""Which replica counts a plan may use when each batch is split into ``microbatches``.

Replicas of a stage serve a batch's microbatches round robin (1F1B-RR) and average their
gradients once per round, so every stage's replica count must divide the microbatches per batch
(``schedule.rules.check_arguments`` refuses other plans). The planner searches among such plans
rather than planning freely and falling back to a straight pipeline.

On one level that is exact: the DP admits only the divisors of ``microbatches``. On several
levels a stage's replica count is the product of its counts per level, so the DP is first run
with the divisors at every level (a superset of the admissible plans: its best is the best
admissible plan whenever it is admissible itself); when it is not, every split of
``microbatches`` into one factor per level is tried with the divisors of each factor (only
admissible plans), and the fastest of those is taken.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence

from pl_pipedream.planner.plan import Plan

__all__ = ["admits", "divisors", "factor_choices", "fewest_microbatches"]


def divisors(number: int, at_most: int) -> tuple[int, ...]:
    """The divisors of ``number`` that are at most ``at_most``, ascending."""
    return tuple(d for d in range(1, min(number, at_most) + 1) if number % d == 0)


def admits(plan: Plan, microbatches: int) -> bool:
    """Whether every stage's replica count divides ``microbatches``."""
    return all(microbatches % stage.replicas == 0 for stage in plan.stages)


def factor_choices(
    microbatches: int, workers: Sequence[int]
) -> Iterator[tuple[tuple[int, ...], ...]]:
    """Per-level replica counts whose products always divide ``microbatches``: for each way of
    writing ``microbatches`` as a product of one factor per level, the divisors of each factor
    (capped at the level's workers); each choice given once, in a fixed order."""
    seen: set[tuple[tuple[int, ...], ...]] = set()
    for factors in _factorisations(microbatches, len(workers)):
        choice = tuple(divisors(f, w) for f, w in zip(factors, workers, strict=True))
        if choice not in seen:
            seen.add(choice)
            yield choice


def _factorisations(number: int, parts: int) -> Iterator[tuple[int, ...]]:
    if parts == 1:
        yield (number,)
        return
    for first in divisors(number, number):
        for rest in _factorisations(number // first, parts - 1):
            yield (first, *rest)


def fewest_microbatches(plan: Plan, at_least: int) -> int:
    """The smallest count from ``at_least`` up that every replica count of ``plan`` divides."""
    step = math.lcm(*(stage.replicas for stage in plan.stages))
    return step * math.ceil(at_least / step)
