"""Actions print compactly and schedules round-trip through JSON."""

from __future__ import annotations

import json

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import Action, ActionKind, Schedule, build

K = ActionKind


def test_compact_strings() -> None:
    here = {"rank": 1, "stage": 1, "replica": 0}
    cases = {
        Action(K.FORWARD, minibatch=5, batch=2, version=3, **here): "1F5v3",
        Action(K.BACKWARD, minibatch=5, batch=2, version=3, **here): "1B5v3",
        Action(K.SEND_ACTIVATION, minibatch=5, batch=2, peer=2, **here): "1>a5@2",
        Action(K.RECV_ACTIVATION, minibatch=5, batch=2, peer=0, **here): "1<a5@0",
        Action(K.SEND_GRAD, minibatch=5, batch=2, peer=0, **here): "1>g5@0",
        Action(K.RECV_GRAD, minibatch=5, batch=2, peer=2, **here): "1<g5@2",
        Action(K.ALLREDUCE, batch=2, version=4, **here): "1Av4",
        Action(K.STEP, batch=2, version=4, **here): "1Sv4",
    }
    assert {str(action): text for action, text in cases.items()} == {
        text: text for text in cases.values()
    }


def test_action_round_trip() -> None:
    action = Action(K.SEND_GRAD, rank=3, stage=2, replica=1, minibatch=7, batch=1, peer=1)
    assert Action.from_dict(json.loads(json.dumps(action.to_dict()))) == action


def test_schedule_round_trips_through_json() -> None:
    schedule = build(Plan.from_balance([1, 1], replicas=[2, 1]), "async", 2, 2)
    again = Schedule.from_dict(json.loads(json.dumps(schedule.to_dict())))
    assert again == schedule
    assert again.num_minibatches == 4
    assert again.num_ranks == 3
