"""What a ``Pipeline``'s re-plan needs of its optimizer (``engine.moving``), one process: the
names of an optimizer's groups and an empty optimizer of a factory's kind."""

from __future__ import annotations

import torch

from pl_pipedream.engine.moving import group_names_of, shell, to_move
from pl_pipedream.planner.plan import Plan
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
