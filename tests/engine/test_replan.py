"""``Pipeline.replan`` over gloo: a flushed run that switches plans in the middle equals one
device (Adam, a tied weight, a replicated stage); an asynchronous run that switches equals the
run that saves at the same step and resumes under the new plan; a checkpoint saved after a
switch resumes under the new plan and under a third one; a rank lost at the switch is named."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.frames import PeerError
from tests.engine.test_pipeline import M, one_device
from tests.runtime import oracle
from tests.runtime.distributed import run

pytestmark = pytest.mark.slow
STEPS, SWITCH = 6, 3


def tied_model() -> nn.Sequential:
    """Six layers; the first and the last share a weight."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), last)


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * M, 4, generator=generator), torch.randn(2 * M, 4, generator=generator))
        for _ in range(STEPS)
    ]


def adam(params: Any) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=0.01)


def sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def pipeline(plan: Plan, sync: str, built: bool, make: Any = adam) -> Pipeline:
    model = tied_model()
    optimizer = make(model.parameters()) if built else make
    return Pipeline(model, nn.functional.mse_loss, optimizer, sync=sync, microbatches=M, plan=plan)


def _switch(rank: int, world: int, old: Plan, new: Plan, sync: str, built: bool) -> dict:
    with pipeline(old, sync, built) as p:
        losses = [p.train_step(batch).item() for batch in batches()[:SWITCH]]
        moved = p.replan(new)
        assert p.plan == new and p.steps == SWITCH
        losses += [p.train_step(batch).item() for batch in batches()[SWITCH:]]
        return {"losses": losses, "model": p.state_dict()["model"], "moved": moved.seconds}


@pytest.mark.parametrize(
    ("sync", "old", "new", "built"),
    [
        ("flush", Plan.from_balance([3, 3]), Plan.from_balance([1, 5]), True),
        ("zero_bubble", Plan.from_balance([3, 3]), Plan.from_balance([5, 1]), False),
        ("gpipe", Plan.from_balance([2, 2, 2]), Plan.from_balance([4, 2], replicas=[2, 1]), True),
        ("flush", Plan.from_balance([3, 3], replicas=[2, 1]), Plan.from_balance([1, 2, 3]), False),
    ],
    ids=["flush 2 ranks", "zero_bubble 2 ranks", "gpipe to a replica", "flush from a replica"],
)
def test_a_flushed_run_that_switches_plans_equals_one_device(
    sync: str, old: Plan, new: Plan, built: bool
) -> None:
    results = run(new.num_workers, _switch, old, new, sync, built, timeout=120.0)
    losses, weights = one_device(batches(), tied_model(), adam)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["losses"] == pytest.approx(losses, abs=1e-6), rank
        merged.update(value["model"])
    assert merged.keys() == weights.keys()
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name


def _switch_or_resume(rank: int, world: int, sync: str, path: str) -> dict:
    old, new = Plan.from_balance([2, 2, 2]), Plan.from_balance([1, 1, 4])
    with pipeline(old, sync, True, sgd) as p:
        switched = [p.train_step(batch).item() for batch in batches()[:SWITCH]]
        p.replan(new)
        switched += [p.train_step(batch).item() for batch in batches()[SWITCH:]]
        switched_model = p.state_dict()["model"]
    with pipeline(old, sync, True, sgd) as p:
        for batch in batches()[:SWITCH]:
            p.train_step(batch)
        p.save(path)
    with pipeline(new, sync, True, sgd) as p:
        p.load(path)
        resumed = [math_nan()] * SWITCH + [p.train_step(b).item() for b in batches()[SWITCH:]]
        resumed_model = p.state_dict()["model"]
    return {"switched": (switched, switched_model), "resumed": (resumed, resumed_model)}


def math_nan() -> float:
    return float("nan")


@pytest.mark.parametrize("sync", ["async", "vertical_sync"])
def test_an_async_switch_equals_saving_and_resuming_under_the_new_plan(
    sync: str, tmp_path: Path
) -> None:
    results = run(3, _switch_or_resume, sync, str(tmp_path / "ckpt"), timeout=120.0)
    switched: dict[str, torch.Tensor] = {}
    resumed: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        switched.update(value["switched"][1])
        resumed.update(value["resumed"][1])
        for a, b in zip(value["switched"][0][SWITCH:], value["resumed"][0][SWITCH:], strict=True):
            assert a == b or b != b, rank  # bitwise, once the resumed run has a loss
    assert switched.keys() == resumed.keys()
    for name, tensor in resumed.items():
        assert torch.equal(switched[name], tensor), name  # bitwise


def plain_sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.05)  # no state: the oracle's runs can be chained


def _switch_plain(rank: int, world: int, sync: str) -> dict:
    old, new = Plan.from_balance([2, 2, 2]), Plan.from_balance([1, 1, 4])
    with pipeline(old, sync, True, plain_sgd) as p:
        for batch in batches()[:SWITCH]:
            p.train_step(batch)
        p.replan(new)
        for batch in batches()[SWITCH:]:
            p.train_step(batch)
        return p.state_dict()["model"]


@pytest.mark.parametrize("sync", ["async", "vertical_sync"])
def test_an_async_switch_equals_the_oracle_draining_and_switching_at_the_same_step(
    sync: str,
) -> None:
    results = run(3, _switch_plain, sync, timeout=120.0)
    model, loss = tied_model(), nn.functional.mse_loss
    old, new = Plan.from_balance([2, 2, 2]), Plan.from_balance([1, 1, 4])
    drained = oracle.train(model, old, sync, batches()[:SWITCH], M, loss, plain_sgd)
    model.load_state_dict(drained)
    expected = oracle.train(model, new, sync, batches()[SWITCH:], M, loss, plain_sgd)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        merged.update(value)
    for name, tensor in expected.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=1e-6), name


def _save_after_switch(rank: int, world: int, path: str) -> list[float]:
    with pipeline(Plan.from_balance([3, 3]), "flush", True) as p:
        losses = [p.train_step(batch).item() for batch in batches()[:2]]
        with pytest.raises(PipelineSetupError, match="over the same ranks"):
            p.replan(Plan.from_balance([2, 2, 2]))  # refused before anything stops
        p.replan(Plan.from_balance([1, 5]))
        losses.append(p.train_step(batches()[2]).item())
        p.save(path)
    return losses


def _resume(rank: int, world: int, plan: Plan, path: str) -> dict:
    with pipeline(plan, "flush", False) as p:
        p.load(path)
        losses = [p.train_step(batch).item() for batch in batches()[SWITCH:]]
        return {"losses": losses, "model": p.state_dict()["model"]}


@pytest.mark.parametrize(
    "plan",
    [Plan.from_balance([1, 5]), Plan.from_balance([2, 2, 2])],
    ids=["the new plan", "a third one"],
)
def test_a_checkpoint_saved_after_a_switch_resumes_as_one_device(
    plan: Plan, tmp_path: Path
) -> None:
    path = str(tmp_path / "ckpt")
    saved = run(2, _save_after_switch, path, timeout=120.0)
    assert all(status == "ok" for status, _ in saved.values()), saved
    resumed = run(plan.num_workers, _resume, plan, path, timeout=120.0)
    losses, weights = one_device(batches(), tied_model(), adam)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in resumed.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["losses"] == pytest.approx(losses[SWITCH:], abs=1e-6), rank
        merged.update(value["model"])
    for name, expected in weights.items():
        assert torch.allclose(merged[name], expected, rtol=0, atol=1e-6), name


def _lose_rank_two(rank: int, world: int) -> str:
    p = pipeline(Plan.from_balance([2, 2, 2]), "flush", True)
    p.train_step(batches()[0])
    if rank == 2:
        os._exit(0)  # lost as the others switch plans
    with pytest.raises(PeerError) as raised:
        p.replan(Plan.from_balance([1, 1, 4]))
    with pytest.raises(RuntimeError, match="the pipeline is closed"):
        p.train_step(batches()[1])
    return str(raised.value)


def test_a_rank_lost_at_a_switch_is_named_by_every_other_rank() -> None:
    results = run(3, _lose_rank_two, timeout=60.0, killed=(2,))
    assert sorted(results) == [0, 1]
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert "rank 2 was lost during the move" in value, rank
