"""Re-planning inside a fit: its options, checked when the strategy is built."""

from __future__ import annotations

import pytest

from pl_pipedream import PipeDreamStrategy
from pl_pipedream.planner.plan import Plan
from pl_pipedream.strategy.replanning import Replanning


def test_replan_is_off_by_default_and_stores_its_options() -> None:
    assert PipeDreamStrategy().replanning.mode == "off"
    replanning = PipeDreamStrategy(replan="auto", replan_every=5, replan_threshold=0).replanning
    assert (replanning.mode, replanning.every, replanning.threshold, replanning.on) == (
        "auto",
        5,
        0.0,
        True,
    )


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"replan": "sometimes"},
            'replan must be "off" or "auto" (replan: \'sometimes\'); for example '
            'PipeDreamStrategy(replan="auto")',
        ),
        (
            {"replan": False},
            'replan must be "off" or "auto" (replan: False); for example '
            'PipeDreamStrategy(replan="auto") (YAML reads an unquoted off as false: write '
            "replan: 'off')",
        ),
        (
            {"replan_every": 0},
            "replan_every must be a positive number of optimizer steps (replan_every: 0); for "
            "example PipeDreamStrategy(replan_every=50)",
        ),
        (
            {"replan_every": 2.5},
            "replan_every must be a positive number of optimizer steps (replan_every: 2.5)",
        ),
        (
            {"replan_threshold": -0.1},
            "replan_threshold must be a fraction of at least 0 (replan_threshold: -0.1); for "
            "example PipeDreamStrategy(replan_threshold=0.05)",
        ),
        (
            {"replan_threshold": float("nan")},
            "replan_threshold must be a fraction of at least 0 (replan_threshold: nan)",
        ),
    ],
)
def test_a_bad_replan_option_is_refused_naming_it_and_the_fix(options: dict, message: str) -> None:
    with pytest.raises(ValueError) as error:
        PipeDreamStrategy(**options)
    assert message in str(error.value)


def test_a_requested_plan_waits_for_the_next_boundary() -> None:
    replanning = Replanning()
    assert replanning.requested is None
    replanning.request(Plan.from_balance([1, 2]))
    assert replanning.requested == Plan.from_balance([1, 2])
