"""Which replica counts a plan may use for a number of microbatches per batch."""

from __future__ import annotations

import math

from pl_pipedream.planner.admission import admits, divisors, factor_choices, fewest_microbatches
from pl_pipedream.planner.plan import Plan


def test_divisors_are_capped_at_the_workers() -> None:
    assert divisors(12, 4) == (1, 2, 3, 4)
    assert divisors(12, 12) == (1, 2, 3, 4, 6, 12)
    assert divisors(3, 8) == (1, 3)
    assert divisors(1, 4) == (1,)


def test_a_plan_is_admitted_when_every_replica_count_divides() -> None:
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    assert admits(plan, 2) and admits(plan, 4)
    assert not admits(plan, 3)


def test_every_factor_choice_multiplies_to_a_divisor() -> None:
    for microbatches in range(1, 13):
        for workers in ([4, 2], [2, 4], [3, 2, 2]):
            choices = list(factor_choices(microbatches, workers))
            assert choices and len(set(choices)) == len(choices)
            for choice in choices:
                assert all(max(counts) <= w for counts, w in zip(choice, workers, strict=True))
                assert microbatches % math.prod(max(counts) for counts in choice) == 0


def test_the_fewest_microbatches_are_a_multiple_of_every_replica_count() -> None:
    plan = Plan.from_balance([1, 1, 1], replicas=[2, 3, 1])
    assert fewest_microbatches(plan, 1) == 6
    assert fewest_microbatches(plan, 7) == 12
    assert fewest_microbatches(Plan.from_balance([2]), 5) == 5
