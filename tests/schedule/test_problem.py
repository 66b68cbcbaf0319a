"""A Problem: the broken rule's sentence and the cells the table marks."""

from __future__ import annotations

import dataclasses

import pytest

from pl_pipedream.schedule.problem import Problem


def test_a_problem_is_a_frozen_value() -> None:
    problem = Problem("a rule (name: 1); fix it", ((0, 2), (1, 0)))
    assert problem == Problem("a rule (name: 1); fix it", ((0, 2), (1, 0)))
    assert len({problem, Problem("a rule (name: 1); fix it", ((0, 2), (1, 0)))}) == 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        problem.cells = ()  # type: ignore[misc]


def test_a_problem_may_have_no_cell() -> None:
    assert Problem("a rule (name: 1); fix it").cells == ()
