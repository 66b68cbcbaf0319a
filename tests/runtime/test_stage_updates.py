"""The update side of a stage (``runtime.stage_updates``): sums, mean, step and release in one
process; the replica all-reduce over a one-rank group (the multi-process runs against the oracle
are test_executor.py's)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.runtime.frames import MinibatchLoss
from pl_pipedream.runtime.lookahead import ExecutorError
from pl_pipedream.runtime.losses import LossBook
from pl_pipedream.runtime.stage_updates import Needed, StageUpdates
from pl_pipedream.runtime.stash import WeightStash
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime.distributed import one_rank_group
from tests.runtime.test_executor import optimizer_update


def _updates(sync: str = "async", microbatches: int = 2, replicas: int = 1, **kw) -> StageUpdates:  # type: ignore[no-untyped-def]
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(3, 2))
    settings = update_settings(SyncMode(sync), microbatches, replicas)
    stash = WeightStash(module, "rank 1 (stage 0)")
    return StageUpdates(module, stash, 1, 0, settings, LossBook(), replicas=replicas, **kw)


def _sgd(module: nn.Module):  # type: ignore[no-untyped-def]
    """The executor's ``Update`` for plain SGD (lr 1), recording the gradients it was given."""
    step = optimizer_update(module, torch.optim.SGD(module.parameters(), lr=1.0))
    seen: list[dict[str, torch.Tensor]] = []

    def apply(gradients: dict[str, torch.Tensor], storage: dict[str, torch.Tensor]) -> int:
        seen.append({n: g.clone() for n, g in gradients.items()})
        return step(gradients, storage)

    apply.seen = seen  # type: ignore[attr-defined]
    return apply


def _action(kind: ActionKind, version: int | None = None, batch: int | None = None) -> Action:
    return Action(kind, 1, 0, 0, version=version, batch=batch)


def test_needed_says_which_versions_a_later_action_uses() -> None:
    needed = Needed({0: 3, 1: 5}, position=3, held=frozenset({2}))
    assert not needed.later(0)  # used by the action running now, at the latest
    assert needed.later(1)
    assert not needed.later(7)  # never used


def test_the_step_applies_the_mean_of_the_summed_gradients() -> None:
    """Two backward passes of one update (``async`` with two replicas: update size 2)."""
    updates = _updates("async", replicas=2)
    apply = _sgd(updates.module)
    names = ["0.weight", "0.bias"]
    updates.add(names, (torch.ones(2, 3), torch.ones(2)))
    updates.add(names, (torch.full((2, 3), 3.0), None))  # the bias unused in the second
    assert updates.pending
    before = updates.module[0].weight.detach().clone()
    updates.step(_action(ActionKind.STEP, version=1), apply, Needed({}, 0))
    assert torch.equal(apply.seen[0]["0.weight"], torch.full((2, 3), 2.0))
    assert torch.equal(apply.seen[0]["0.bias"], torch.full((2,), 0.5))
    assert torch.equal(updates.module[0].weight.detach(), before - 2.0)
    assert updates.stash.live_version == 1 and not updates.pending


def test_a_version_a_later_action_uses_is_kept_through_the_step_and_released_after() -> None:
    updates = _updates()
    before = updates.module[0].weight.detach().clone()
    updates.add(["0.weight"], (torch.ones(2, 3),))
    needed = Needed({0: 4}, position=2)  # version 0 is still used at position 4
    updates.step(_action(ActionKind.STEP, version=1), _sgd(updates.module), needed)
    assert updates.stash.kept() == [0]
    assert torch.equal(updates.stash.get(0)["0.weight"], before)  # untouched by the step
    updates.release(Needed({0: 4}, position=4, held=frozenset({0})))
    assert updates.stash.kept() == [0]  # a forward pass holds it for its backward
    updates.release(Needed({0: 4}, position=4))
    assert updates.stash.kept() == []


def test_a_step_without_an_update_or_making_another_version_is_refused() -> None:
    updates = _updates()
    updates.add(["0.weight"], (torch.ones(2, 3),))
    with pytest.raises(ExecutorError, match=r"rank 1 \(stage 0\) has no way to apply update 1"):
        updates.step(_action(ActionKind.STEP, version=1), None, Needed({}, 0))
    updates.add(["0.weight"], (torch.ones(2, 3),))
    with pytest.raises(ExecutorError, match="made the live weights version 1; the schedule"):
        updates.step(_action(ActionKind.STEP, version=2), _sgd(updates.module), Needed({}, 0))


def test_linear_layers_sum_inside_the_gemm_and_the_allreduce_takes_those_sums() -> None:
    """``flush`` with 4 microbatches on one replica: the Linear layer's weight gradients are
    summed while autograd computes them; the all-reduce (no collective on one replica) moves
    them into the update's sums, equal to summing autograd's gradients."""
    updates = _updates("flush", microbatches=4)
    assert updates.linear_sums is not None
    module, params = updates.module, dict(updates.module.named_parameters())
    inputs = [torch.randn(2, 3) for _ in range(2)]
    expected = {n: torch.zeros_like(p) for n, p in params.items()}
    for x in inputs:
        with updates.capture(params):
            loss = module(x).square().sum()
        leaves = list(params.values())
        found = torch.autograd.grad(loss, leaves, allow_unused=True)
        updates.add(list(params), found)
        again = torch.autograd.grad(module(x).square().sum(), leaves)
        for name, grad in zip(params, again, strict=True):
            expected[name] += grad
    assert updates.linear_sums.pending
    updates.allreduce(_action(ActionKind.ALLREDUCE, version=1, batch=0))
    assert not updates.linear_sums.pending
    for name, total in expected.items():
        torch.testing.assert_close(updates.sums.get(name), total)


def test_the_replica_allreduce_sums_over_the_group_and_shares_the_losses() -> None:
    """Over a one-rank group the sums come back as they were (zeros for a parameter without
    one) and the losses of the batch are merged."""
    with one_rank_group():
        updates = _updates("flush", replicas=2, replica_group=dist.group.WORLD, microbatches=2)
        updates.add(["0.weight"], (torch.ones(2, 3),))
        updates.losses.add(0, [MinibatchLoss(1, 1.5)])
        updates.allreduce(_action(ActionKind.ALLREDUCE, version=1, batch=0))
        assert torch.equal(updates.sums.get("0.weight"), torch.ones(2, 3))
        assert torch.equal(updates.sums.get("0.bias"), torch.zeros(2))
        assert [(x.minibatch, x.value) for x in updates.losses.of(0)] == [(1, 1.5)]
