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


def test_a_message_is_keyed_by_the_boundary_it_crosses() -> None:
    """Rank 0 of an interleaved plan sends minibatch 0 to rank 1 twice: stages 0 -> 1, 2 -> 3."""
    from pl_pipedream.schedule.actions import message_key

    schedule = build(Plan.from_balance([1] * 4, placement="interleaved"), "interleaved", 1, 2)
    sends = [a for a in schedule.actions[0] if a.kind is ActionKind.SEND_ACTIVATION]
    receives = [a for a in schedule.actions[1] if a.kind is ActionKind.RECV_ACTIVATION]
    mine = [a for a in sends if a.minibatch == 0]
    assert [(a.stage, a.peer) for a in mine] == [(0, 1), (2, 1)]
    assert message_key(mine[0]) != message_key(mine[1])
    assert {message_key(a) for a in sends} == {message_key(a) for a in receives}
