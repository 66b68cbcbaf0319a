"""What a ``Pipeline`` rebuilds on a new plan (``engine.running``), one process: the names of an
optimizer's groups, an empty optimizer of a factory's kind, the runner's counts carried over,
and ties refused under a plan whose mode cannot keep their rule."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.core.stage import find_ties
from pl_pipedream.engine.running import check_plan_ties, group_names_of, shell, to_move
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.modes import SyncMode
from tests.engine.test_replan import tied_model


def test_group_names_name_every_parameter_of_each_group_once() -> None:
    model = tied_model()
    optimizer = torch.optim.SGD(
        [{"params": list(model[0].parameters())}, {"params": list(model[2].parameters())}], lr=0.1
    )
    assert group_names_of(model, optimizer) == [["0.weight", "0.bias"], ["2.weight", "2.bias"]]


def test_a_shell_has_the_factorys_kind_and_settings_and_no_parameter() -> None:
    optimizer = shell(lambda params: torch.optim.Adam(params, lr=0.03), torch.device("cpu"))
    assert type(optimizer) is torch.optim.Adam
    assert [g["params"] for g in optimizer.param_groups] == [[]]
    assert optimizer.param_groups[0]["lr"] == 0.03 and not optimizer.state


def test_the_names_recorded_at_construction_are_kept() -> None:
    model = tied_model()
    recorded = [[["0.weight"]]]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    plan = Plan.from_balance([6])
    assert to_move(optimizer, None, recorded, model, plan, torch.device("cpu")) == (
        optimizer,
        recorded,
    )


def test_a_tie_across_a_replicated_stage_is_refused_in_a_per_minibatch_mode() -> None:
    model = tied_model()
    plan = Plan.from_balance([3, 3], replicas=[2, 1])
    check_plan_ties(find_ties(model, model, plan), plan, SyncMode.FLUSH)  # flush keeps the rule
    with pytest.raises(ValueError, match="tied"):
        check_plan_ties(find_ties(model, model, plan), plan, SyncMode.ASYNC)


def test_layers_without_a_tie_pass_under_any_plan() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    check_plan_ties(find_ties(model, model, plan), plan, SyncMode.ASYNC)
