"""The pipeline runner over gloo: a run of Lightning-sized steps, a drain, the groups given back."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime import update
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model

pytestmark = pytest.mark.slow  # one spawn of two ranks for the module: about 3 s

M = 2  # microbatches per batch
STEPS = 3


def _stage_module(plan: Plan, rank: int) -> nn.Sequential:
    model = make_model()
    stage = plan.stage_of_rank(rank)
    return nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))


def _sgd_update(module: nn.Module):  # type: ignore[no-untyped-def]
    optimizer = OPTIMIZERS["sgd"](module.parameters())

    def apply(gradients: dict[str, torch.Tensor], storage: dict[str, torch.Tensor]) -> int:
        params = dict(module.named_parameters())
        for name, param in params.items():
            param.grad = gradients.get(name)
        copied = update.step(optimizer, {params[n]: t for n, t in storage.items()})
        optimizer.zero_grad(set_to_none=True)
        return copied

    return apply


def _async_run_then_close(rank: int, world: int) -> dict:
    plan = Plan.from_balance([3, 3])
    module = _stage_module(plan, rank)
    runner = PipelineRunner.create(
        plan, SyncMode.ASYNC, M, module, rank, _sgd_update(module), torch.device("cpu"), 30.0
    )
    batches = make_batches(M)[:STEPS]
    drained, newest = [], []
    for t, (x, y) in enumerate(batches):
        xs, ys = x.chunk(M), y.chunk(M)
        runner.train_batch(
            lambda j, xs=xs: xs[j], lambda out, j, ys=ys: loss_fn(out, ys[j]), t == STEPS - 1
        )
        drained.append(runner.drained)
        loss = runner.executor.newest_loss
        newest.append(None if loss is None else loss.minibatch)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    channel = runner.executor.channel
    runner.close()
    return {
        "weights": weights,
        "drained": drained,
        "newest": newest,
        "channel_group": channel.group,
        "groups": runner.groups,
    }


def _replicated_close(rank: int, world: int) -> dict:
    plan = Plan.from_balance([6], replicas=[2])
    module = _stage_module(plan, rank)
    runner = PipelineRunner.create(
        plan, SyncMode.FLUSH, M, module, rank, _sgd_update(module), torch.device("cpu"), 30.0
    )
    replica_groups = list(runner.groups)
    x, y = make_batches(M)[0]
    mine = x.chunk(M), y.chunk(M)
    runner.train_batch(lambda j: mine[0][j], lambda out, j: loss_fn(out, mine[1][j]), drain=True)
    ranks = dist.get_process_group_ranks(replica_groups[0])
    runner.close()
    runner.close()  # a second close has nothing left to give back
    try:
        dist.get_process_group_ranks(replica_groups[0])
        after_close = "known"
    except (KeyError, ValueError, RuntimeError):
        after_close = "destroyed"
    return {"ranks": ranks, "left": runner.groups, "after_close": after_close}


def _both(rank: int, world: int) -> dict:
    return {
        "async": _async_run_then_close(rank, world),
        "replicated": _replicated_close(rank, world),
    }


@pytest.fixture(scope="module")
def runs() -> dict[int, dict]:
    """One spawn for the module: an async run of two stages, then a replicated flushed one."""
    results = run(2, _both, timeout=60.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {rank: value for rank, (_, value) in results.items()}


def test_an_async_run_drains_to_the_oracles_weights_and_closes(runs) -> None:  # type: ignore[no-untyped-def]
    plan = Plan.from_balance([3, 3])
    expected = oracle.train(
        make_model(), plan, "async", make_batches(M)[:STEPS], M, loss_fn, OPTIMIZERS["sgd"]
    )
    for rank in (0, 1):
        got = runs[rank]["async"]
        assert got["drained"] == [False, False, True]
        assert got["channel_group"] is None and got["groups"] == []
        for key, tensor in got["weights"].items():
            diff = (tensor - expected[key]).abs().max().item()
            assert diff <= 1e-5, f"rank {rank} {key}: {diff}"


def test_the_losses_reach_the_first_stage_with_the_gradients(runs) -> None:  # type: ignore[no-untyped-def]
    # in step 0 of a 2-stage async run, minibatch 0's backward has reached stage 0
    assert runs[0]["async"]["newest"][:2] == [0, 2]
    assert runs[1]["async"]["newest"][:2] == [1, 3]


def test_a_drained_step_leaves_its_newest_loss_for_train_loss(runs) -> None:  # type: ignore[no-untyped-def]
    assert runs[0]["async"]["newest"][-1] == STEPS * M - 1


def test_close_gives_back_the_replica_groups(runs) -> None:  # type: ignore[no-untyped-def]
    for rank in (0, 1):
        assert runs[rank]["replicated"] == {"ranks": [0, 1], "left": [], "after_close": "destroyed"}
