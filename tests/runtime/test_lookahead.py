"""``runtime/lookahead.py``: what a rank's action list says before it runs."""

from __future__ import annotations

import pytest

from pl_pipedream.runtime.lookahead import (
    ExecutorError,
    last_uses,
    minibatch_of,
    receives_ahead,
)
from pl_pipedream.runtime.tags import Tag
from pl_pipedream.schedule.actions import Action, ActionKind


def _action(kind: ActionKind, minibatch: int | None = 0, **fields: int) -> Action:
    return Action(kind, rank=1, stage=1, replica=0, minibatch=minibatch, batch=0, **fields)


def test_a_version_lives_until_its_last_compute_and_a_prediction_reads_the_one_before() -> None:
    actions = [
        _action(ActionKind.FORWARD, 0, version=2),
        _action(ActionKind.BACKWARD, 0, version=2),
        _action(ActionKind.FORWARD, 1, version=3),
    ]
    assert last_uses(actions, weight_prediction=False) == {2: 1, 3: 2}
    assert last_uses(actions, weight_prediction=True) == {2: 2, 3: 2, 1: 0}


def test_each_link_is_posted_once_and_then_after_each_receive_that_has_a_successor() -> None:
    actions = [
        _action(ActionKind.RECV_ACTIVATION, 0, peer=0),
        _action(ActionKind.RECV_GRAD, 0, peer=2),
        _action(ActionKind.RECV_ACTIVATION, 1, peer=0),
    ]
    first, following = receives_ahead(actions)
    assert first == [(0, Tag.ACTIVATION), (2, Tag.GRAD)]
    assert following == {0: (0, Tag.ACTIVATION)}


def test_an_action_without_its_minibatch_is_refused_naming_the_fix() -> None:
    with pytest.raises(ExecutorError, match=r"must name its minibatch .*schedule\.build"):
        minibatch_of(_action(ActionKind.FORWARD, None, version=0))
