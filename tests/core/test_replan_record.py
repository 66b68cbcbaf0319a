"""What a re-plan check leaves: its one-line report and a move's history line."""

from __future__ import annotations

from pl_pipedream.core.replan_record import check_report, history_line
from pl_pipedream.planner.measured import RankTimes, measured_model
from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.replan import Decision
from pl_pipedream.profile.graph import Node, Profile

PLAN = Plan.from_balance([2, 2])
PROFILE = Profile(tuple(Node(n, n, 1.0, 2.0, (0.0,), 0.0) for n in "0123"))
TIMES = [  # rank 1 takes twice as long for the same layers
    RankTimes(0, {"0": 1.0, "1": 1.0}, {"0": 2.0, "1": 2.0}),
    RankTimes(1, {"2": 2.0, "3": 2.0}, {"2": 4.0, "3": 4.0}),
]


def test_a_kept_plan_reports_what_was_measured_and_decided() -> None:
    model = measured_model(PROFILE, TIMES, 2)
    kept = Decision(False, PLAN, 12e-3, 12e-3, 0.0, ())
    text = check_report(7, TIMES, model, (1,), kept, None)
    assert text.startswith("re-plan check at step 7: measured 6 | 12 ms per microbatch")
    assert ", ? (rank 1: a slow rank or costly layers, not told apart yet); kept" in text
    assert text.endswith(f"; kept {PLAN.layout}: 12.000 ms per minibatch")
    held = check_report(7, TIMES, model, (), kept, Plan.from_balance([3, 1]))
    assert held.endswith("holding a move to 0-2|3 until the next check finds it again")


def test_a_moves_history_line_holds_both_plans_and_the_figures() -> None:
    model = measured_model(PROFILE, TIMES, 2)
    new = Plan.from_balance([3, 1])
    line = history_line(7, PLAN, TIMES, model, Decision(True, new, 12e-3, 9e-3, 0.5, ("w",)))
    assert line["step"] == 7 and line["seconds"] is None and line["warnings"] == ["w"]
    assert line["old_plan"] == PLAN.to_dict() and line["new_plan"] == new.to_dict()
    assert line["measured_ms"] == {
        "0": {"forward": 2.0, "backward": 4.0},
        "1": {"forward": 4.0, "backward": 8.0},
    }
    assert line["predicted_ms"]["current"] == 12.0 and line["predicted_ms"]["new"] == 9.0
    assert len(line["predicted_ms"]["new_stages"]) == 2
