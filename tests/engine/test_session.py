"""The staged session every front end drives (``engine.session``), one process: the checks of a
plan's ties against the mode and the corrections, in the front end's spelling, and the stages'
order (a stage used before its plan is cut says which call comes first)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.core.stage import find_ties
from pl_pipedream.engine.session import Session, Settings
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.schedule.modes import SyncMode
from tests.engine.test_replan import tied_model


def session(model: nn.Sequential, sync: SyncMode, **settings: object) -> Session:
    base = Settings(sync, 2, 0, torch.device("cpu"), 5.0, StagePrecision(), **settings)  # type: ignore[arg-type]
    return Session(model, model, base, lambda local, plan: None, list)  # type: ignore[arg-type,return-value]


def test_a_tie_across_a_replicated_stage_is_refused_in_a_per_minibatch_mode() -> None:
    model = tied_model()
    plan = Plan.from_balance([3, 3], replicas=[2, 1])
    ties = find_ties(model, model, plan)
    session(model, SyncMode.FLUSH).check_plan(ties, plan)  # flush keeps the rule
    with pytest.raises(ValueError, match=r"tied.*use PipeDreamStrategy\(sync='flush'\)"):
        session(model, SyncMode.ASYNC, caller="PipeDreamStrategy").check_plan(ties, plan)


def test_layers_without_a_tie_pass_under_any_plan() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    plan = Plan.from_balance([1, 1], replicas=[2, 1])
    session(model, SyncMode.ASYNC).check_plan(find_ties(model, model, plan), plan)


def test_a_correction_is_refused_with_tied_parameters_on_every_front_end() -> None:
    model = tied_model()
    plan = Plan.from_balance([3, 3])
    ties = find_ties(model, model, plan)
    with pytest.raises(ValueError, match="corrections do not cover tied parameters"):
        session(model, SyncMode.ASYNC, lr_warmup_per_delay=2).check_plan(ties, plan)


def test_a_stage_used_before_the_plan_is_cut_names_the_call_that_comes_first() -> None:
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(RuntimeError, match=r"call cut\(plan\) first"):
        session(model, SyncMode.FLUSH).create(None, None)
    with pytest.raises(RuntimeError, match="the pipeline is closed .*build a new Pipeline"):
        session(model, SyncMode.FLUSH).running()
