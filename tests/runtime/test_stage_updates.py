"""The update side of a stage (``runtime.stage_updates``): sums, mean, step and release in one
process; the replica all-reduce over a one-rank group (the multi-process runs against the oracle
are test_executor.py's); a replica that stops, named by its peers, over gloo."""

from __future__ import annotations

import os
import signal
import time
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.frames import MinibatchLoss, PeerError
from pl_pipedream.runtime.linear_sums import FUSED_FROM_CPU
from pl_pipedream.runtime.lookahead import ExecutorError
from pl_pipedream.runtime.losses import LossBook
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.runtime.stage_updates import Needed, StageUpdates, replica_stopped
from pl_pipedream.runtime.stash import WeightStash
from pl_pipedream.schedule.actions import Action, ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime.distributed import one_rank_group, run
from tests.runtime.test_executor import loss_fn, make_batches, make_model, optimizer_update


def _updates(  # type: ignore[no-untyped-def]
    sync: str = "async",
    microbatches: int = 2,
    replicas: int = 1,
    fused_from: int | None = 0,
    module: nn.Module | None = None,
    **kw,
) -> StageUpdates:
    """A stage of ``module`` (a Linear(3, 2) by default) whose Linear layers fuse their sums
    from ``fused_from`` elements (0: whatever their size, as the fused path's tests need; None:
    the default)."""
    torch.manual_seed(0)
    module = module if module is not None else nn.Sequential(nn.Linear(3, 2))
    settings = update_settings(SyncMode(sync), microbatches, replicas, fused_from)
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


def _layers(width: int) -> nn.Sequential:
    """Linear(16, width), ReLU, Linear(width, width)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, width), nn.ReLU(), nn.Linear(width, width))


def _microbatches(updates: StageUpdates, inputs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Backward passes of ``inputs`` through ``updates`` (captured as the executor captures),
    then the all-reduce: the update's summed gradients."""
    module, params = updates.module, dict(updates.module.named_parameters())
    for x in inputs:
        with updates.capture(params):
            loss = module(x).square().sum()
        updates.add(
            list(params), torch.autograd.grad(loss, list(params.values()), allow_unused=True)
        )
    updates.allreduce(_action(ActionKind.ALLREDUCE, version=1, batch=0))
    return {name: updates.sums.get(name) for name in params}


@pytest.mark.parametrize("sync", ["flush", "zero_bubble"])
def test_a_stage_of_small_linear_layers_does_not_fuse_and_a_large_one_does(sync: str) -> None:
    """Fusing costs a fixed amount per layer and microbatch: a stage whose weights are all below
    the default (``FUSED_FROM_CPU`` on CPU) leaves its gradients to autograd (and holds no
    products for a split backward's weight half); a stage with one weight that large fuses."""
    width = 512
    assert width * width >= FUSED_FROM_CPU > 16 * 16
    small = _updates(sync, 8, fused_from=None, module=_layers(16))
    assert small.linear_sums is None and small.hold() is None
    large = _updates(sync, 8, fused_from=None, module=_layers(width))
    assert large.linear_sums is not None
    assert (large.hold() is not None) == (sync == "zero_bubble")
    per_minibatch = _updates("async", 8, fused_from=0, module=_layers(width))
    assert per_minibatch.linear_sums is None  # one backward per update: nothing to sum


def test_the_sums_are_the_same_fused_or_not() -> None:
    """The same stage and microbatches, fused (threshold 0) and not (the default): the update's
    summed gradients agree to float32 rounding (the sum's order of additions differs)."""
    generator = torch.Generator().manual_seed(2)
    inputs = [torch.randn(8, 16, generator=generator) for _ in range(4)]
    fused = _updates("flush", 4, fused_from=0, module=_layers(16))
    plain = _updates("flush", 4, fused_from=None, module=_layers(16))
    assert fused.linear_sums is not None and plain.linear_sums is None
    found, expected = _microbatches(fused, inputs), _microbatches(plain, inputs)
    for name, total in expected.items():
        torch.testing.assert_close(found[name], total, rtol=1e-6, atol=1e-6)


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


# ----- a replica that stops ---------------------------------------------------------------------

GLOO_TEXT = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41563"


def test_a_stopped_replica_is_named_by_rank_and_stage_not_by_its_address() -> None:
    error = replica_stopped(
        "rank 1 (stage 1)", "the gradients of update 3", 1, [2], RuntimeError(GLOO_TEXT), 0.2, 30
    )
    assert isinstance(error, PeerError)
    assert str(error) == (
        "rank 1 (stage 1) could not sum the gradients of update 3 with its replica rank 2 "
        "(stage 1): the connection was closed by rank 2 (stage 1) after 0.2 s of waiting "
        "(Connection closed by peer); rank 2 (stage 1) has stopped: look for its error above (or "
        "in its log)"
    )
    late = replica_stopped("rank 1 (stage 1)", "x", 1, [2], RuntimeError("Timed out"), 29.9, 30)
    assert "within 30 s (Timed out); rank 2 (stage 1) has probably failed" in str(late)


def test_with_more_replicas_every_other_one_is_named_as_a_candidate() -> None:
    """gloo does not say which of several replicas stopped."""
    error = replica_stopped("rank 0 (stage 0)", "x", 0, [1, 2], RuntimeError(GLOO_TEXT), 0.1, 30)
    assert (
        "with its replicas (rank 1 (stage 0), rank 2 (stage 0)): the connection was closed by "
        in (str(error))
    )
    assert "; one of rank 1 (stage 0), rank 2 (stage 0) has stopped" in str(error)


def test_a_failed_replica_allreduce_raises_a_peer_error_naming_the_replica(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The collective's own error (gloo's text) becomes a ``PeerError`` naming the replica."""

    def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError(GLOO_TEXT)

    with one_rank_group():
        updates = _updates("flush", replicas=2, replica_group=dist.group.WORLD, timeout=30.0)
        updates.rank = 1  # (the group's one rank, 0, plays its replica)
        monkeypatch.setattr(dist, "all_reduce", closed)
        with pytest.raises(PeerError, match=r"with its replica rank 0 \(stage 0\): the conn"):
            updates.allreduce(_action(ActionKind.ALLREDUCE, version=1, batch=0))


def _replica_killed(rank: int, world: int, sync: str, hang: bool = False) -> str:
    """Stage 1 has two replicas, ranks 1 and 2; rank 2 is SIGKILLed before its second batch
    (with ``hang``: it sleeps past the 10 s deadline first)."""
    plan = Plan.from_balance([3, 3], replicas=[1, 2])
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    update = optimizer_update(module, torch.optim.SGD(module.parameters(), lr=0.1))
    runner = PipelineRunner.create(
        plan, SyncMode(sync), 4, module, rank, update, torch.device("cpu"), 10.0 if hang else 60.0
    )
    for t, (x, y) in enumerate(make_batches(4)[:3]):
        if t == 1 and rank == 2:
            time.sleep(30.0 if hang else 0.0)
            os.kill(os.getpid(), signal.SIGKILL)
        xs, ys = x.chunk(4), y.chunk(4)
        runner.train_batch(lambda j, xs=xs: xs[j], lambda out, j, ys=ys: loss_fn(out, ys[j]))
    return "trained"


@pytest.mark.slow
@pytest.mark.parametrize("sync", ["flush", "async"])
def test_a_killed_replica_is_named_by_its_peers(sync: str) -> None:
    """Rank 2 (stage 1) is SIGKILLed: its replica, rank 1, fails inside the all-reduce and its
    neighbour, rank 0, on a message; each names rank 2 (its replica names its stage too),
    where gloo named only an address and port."""
    results = run(3, _replica_killed, sync, timeout=120.0, killed=[2])
    assert sorted(results) == [0, 1]
    status, text = results[1]
    assert status == "error", text
    first = text.splitlines()[0]
    assert first.startswith("PeerError: rank 1 (stage 1) could not sum the "), first
    assert "with its replica rank 2 (stage 1): the connection was closed by rank 2 (stage 1)" in (
        first
    )
    status, text = results[0]
    assert status == "error" and text.startswith("PeerError: rank 0 (stage 0) could not "), text
    assert "rank 2 has stopped" in text.splitlines()[0]


@pytest.mark.slow
def test_a_replica_that_hangs_is_named_at_the_pipelines_deadline() -> None:
    """Rank 2 (stage 1) stops answering: its replica waits the pipeline's timeout (10 s) in the
    all-reduce, not gloo's default of 30 minutes, and names it."""
    results = run(3, _replica_killed, "flush", True, timeout=120.0, killed=[2])
    status, text = results[1]
    assert status == "error", text
    first = text.splitlines()[0]
    assert first.startswith("PeerError: rank 1 (stage 1) could not sum the gradients "), first
    assert "with its replica rank 2 (stage 1) within 10 s (" in first, first
    assert "rank 2 (stage 1) has probably failed or stopped" in first, first
