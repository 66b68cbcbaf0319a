"""The line a plan predicted slower than data parallelism prints: what it would need."""

from __future__ import annotations

from dataclasses import replace

from pl_pipedream.planner.advice import advise, slower_than_data_parallel
from pl_pipedream.planner.plan import Plan


def _timed(plan: Plan, slowest: float, data_parallel: float = 1.0) -> Plan:
    return replace(plan, slowest_stage_time=slowest, data_parallel_time=data_parallel, meta={})


def test_no_advice_for_a_plan_at_least_as_fast_as_data_parallelism() -> None:
    plan = _timed(Plan.from_balance([2]), 1.0)
    assert not slower_than_data_parallel(plan)
    assert advise(plan, None, 4) is None
    assert advise(_timed(plan, 1.0 + 1e-12), None, 4) is None  # data parallelism, rounded


def test_a_faster_plan_for_more_microbatches_is_named_with_the_count() -> None:
    chosen = _timed(Plan.from_balance([1, 1, 1, 1]), 1 / 0.94)
    free = _timed(Plan.from_balance([1, 1], replicas=[2, 2]), 0.9)
    text = advise(chosen, free, 3, None)
    assert text is not None
    assert text.startswith("predicted slower than data parallelism (0.94x)")
    assert "microbatches=4 admits the 2-2 plan (1.11x" in text
    assert "Trainer(strategy='ddp')" in text


def test_without_a_faster_plan_it_names_replication_and_ddp() -> None:
    chosen = _timed(Plan.from_balance([1, 1]), 2.0)
    text = advise(chosen, chosen, 2, "the model was built empty")
    assert text is not None and "microbatches=" not in text
    assert "replicated stages (ruled out: the model was built empty)" in text
    assert "Trainer(strategy='ddp')" in text
