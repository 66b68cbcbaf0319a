"""Plans shared by the schedule tests: straight pipelines and replicated 2-1, 2-2, 1-2."""

from __future__ import annotations

import pytest

from pl_pipedream.planner.plan import Plan

STRAIGHT = {f"straight{p}": Plan.from_balance([1] * p) for p in (2, 3, 4)}
REPLICATED = {
    shape: Plan.from_balance([1, 1], replicas=[int(r) for r in shape.split("-")])
    for shape in ("2-1", "2-2", "1-2")
}
PLANS = {**STRAIGHT, **REPLICATED}


@pytest.fixture(params=sorted(PLANS))
def plan(request: pytest.FixtureRequest) -> Plan:
    return PLANS[request.param]
