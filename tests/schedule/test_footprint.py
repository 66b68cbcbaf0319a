"""Memory a rank's list implies: weight versions held and activations in flight, by hand."""

from __future__ import annotations

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import Action, ActionKind, build
from pl_pipedream.schedule.footprint import in_flight_counts, live_version_counts

K = ActionKind
HERE = {"rank": 0, "stage": 0, "replica": 0}


def compute(kind: ActionKind, minibatch: int, version: int) -> Action:
    return Action(kind, minibatch=minibatch, batch=minibatch, version=version, **HERE)


def step(version: int) -> Action:
    return Action(K.STEP, batch=0, version=version, **HERE)


# F0v0 Sv1 F1v1 B0v0 Sv2 B1v1 Sv3: a backward keeps its forward's version alive past later steps
STASHED = [
    compute(K.FORWARD, 0, 0),
    step(1),
    compute(K.FORWARD, 1, 1),
    compute(K.BACKWARD, 0, 0),
    step(2),
    compute(K.BACKWARD, 1, 1),
    step(3),
]


def test_versions_held_after_each_action() -> None:
    assert live_version_counts(STASHED) == [1, 1, 2, 2, 1, 2, 1, 1]


def test_activations_in_flight_after_each_action() -> None:
    assert in_flight_counts(STASHED) == [0, 1, 1, 2, 1, 1, 0, 0]


def test_an_empty_list_holds_version_zero() -> None:
    assert live_version_counts([]) == [1]
    assert in_flight_counts([]) == [0]


def test_flushed_lists_hold_one_version() -> None:
    schedule = build(Plan.from_balance([1, 1, 1]), "flush", 3, 4)
    for actions in schedule.actions:
        assert max(live_version_counts(actions)) == 1
        assert max(in_flight_counts(actions)) <= 3
