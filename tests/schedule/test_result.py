"""What a simulation reports: busy kinds, bubble fractions, the steady window, JSON."""

from __future__ import annotations

import json

import pytest

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import BUSY_KINDS, ActionKind, bubble_fraction, build, simulate

K = ActionKind


def test_busy_kinds_are_compute_and_steps() -> None:
    assert BUSY_KINDS == {K.FORWARD, K.BACKWARD, K.BACKWARD_INPUT, K.BACKWARD_WEIGHT, K.STEP}
    assert {"FORWARD", "BACKWARD", "BACKWARD_WEIGHT", "STEP"} <= BUSY_KINDS  # kind names match too
    assert not {"SEND_ACTIVATION", "RECV_GRAD", "ALLREDUCE"} & BUSY_KINDS


@pytest.mark.parametrize(
    ("busy", "start", "end", "bubble"),
    [
        ([], 0.0, 10.0, 1.0),
        ([(0.0, 5.0)], 0.0, 10.0, 0.5),
        ([(0.0, 4.0), (6.0, 10.0)], 0.0, 10.0, 0.2),
        ([(-5.0, 5.0), (8.0, 20.0)], 0.0, 10.0, 0.3),  # parts outside the window do not count
        ([(20.0, 30.0)], 0.0, 10.0, 1.0),
        ([(0.0, 1.0)], 3.0, 3.0, 0.0),  # an empty window has no bubble
    ],
)
def test_bubble_fraction(
    busy: list[tuple[float, float]], start: float, end: float, bubble: float
) -> None:
    assert bubble_fraction(busy, start, end) == pytest.approx(bubble)


def test_bubbles_are_bubble_fractions_of_the_spans() -> None:
    schedule = build(Plan.from_balance([1, 1, 1]), "async", 8, 3)
    result = simulate(schedule, forward_ms=[1.0, 1.5, 1.0], backward_ms=[2.0, 3.0, 2.0])
    start, end = result.steady_window_ms
    for rank, actions in enumerate(schedule.actions):
        busy = [s for a, s in zip(actions, result.spans[rank], strict=True) if a.kind in BUSY_KINDS]
        assert result.bubble[rank] == bubble_fraction(busy, 0.0, result.total_ms)
        assert result.steady_bubble[rank] == bubble_fraction(busy, start, end)


def test_steady_window_skips_the_first_and_last_quarter() -> None:
    """8 batches: from the input stage's last backward of batch 2 to that of batch 5."""
    schedule = build(Plan.from_balance([1, 1]), "async", 8, 2)
    result = simulate(schedule, forward_ms=[1.0, 1.0], backward_ms=[2.0, 2.0])
    ends = {
        action.batch: end
        for action, (_, end) in zip(schedule.actions[0], result.spans[0], strict=True)
        if action.kind is K.BACKWARD
    }
    assert result.steady_window_ms == (ends[2], ends[5])
    assert result.time_per_minibatch_ms == pytest.approx((ends[5] - ends[2]) / (3 * 2))


def test_to_dict_is_json_with_the_mode_name() -> None:
    result = simulate(build(Plan.from_balance([1, 1]), "2bw", 3, 2))
    data = json.loads(json.dumps(result.to_dict()))
    assert data["sync"] == "2bw"
    assert data["num_minibatches"] == 6
    assert "spans" not in data
