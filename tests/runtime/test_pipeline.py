"""The pipeline runner over gloo: a run of Lightning-sized steps, a drain, the groups given back."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import (
    OPTIMIZERS,
    loss_fn,
    make_batches,
    make_model,
    optimizer_update,
)

pytestmark = pytest.mark.slow  # one spawn of two ranks for the module: about 3 s

M = 2  # microbatches per batch
STEPS = 3


def _stage_module(plan: Plan, rank: int) -> nn.Sequential:
    model = make_model()
    stage = plan.stage_of_rank(rank)
    return nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))


def _sgd_update(module: nn.Module):  # type: ignore[no-untyped-def]
    return optimizer_update(module, OPTIMIZERS["sgd"](module.parameters()))


def _async_run_then_close(rank: int, world: int) -> dict:
    plan = Plan.from_balance([3, 3])
    module = _stage_module(plan, rank)
    runner = PipelineRunner.create(
        plan, SyncMode.ASYNC, M, module, rank, _sgd_update(module), torch.device("cpu"), 30.0
    )
    batches = make_batches(M)[:STEPS]
    drained, logged, computed, of_batch = [], [], {}, []
    built: list[tuple[int, int]] = []
    segment = runner.stream.segment

    def counted(rank: int, t: int):  # type: ignore[no-untyped-def]
        built.append((rank, t))
        return segment(rank, t)

    object.__setattr__(runner.stream, "segment", counted)  # (a frozen dataclass)

    def loss(out, j, t, ys):  # type: ignore[no-untyped-def]
        value = loss_fn(out, ys[j])
        computed[(t, j)] = value.item()
        return value

    for t, (x, y) in enumerate(batches):
        xs, ys = x.chunk(M), y.chunk(M)
        runner.train_batch(
            lambda j, xs=xs: xs[j],
            lambda out, j, t=t, ys=ys: loss(out, j, t, ys),
            t == STEPS - 1,
        )
        drained.append(runner.drained)
        logged.append(runner.loss)
        of_batch.append(runner.loss_batch)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    channel = runner.executor.channel
    runner.close()
    return {
        "weights": weights,
        "drained": drained,
        "logged": logged,
        "loss_batches": of_batch,
        "computed": computed,
        "channel_group": channel.group,
        "groups": runner.groups,
        "built": built,
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
    computed = {}

    def loss(out, j):  # type: ignore[no-untyped-def]
        value = loss_fn(out, mine[1][j])
        computed[j] = value.item()
        return value

    runner.train_batch(lambda j: mine[0][j], loss, drain=True)
    logged = runner.loss
    ranks = dist.get_process_group_ranks(replica_groups[0])
    runner.close()
    runner.close()  # a second close has nothing left to give back
    try:
        dist.get_process_group_ranks(replica_groups[0])
        after_close = "known"
    except (KeyError, ValueError, RuntimeError):
        after_close = "destroyed"
    return {
        "ranks": ranks,
        "left": runner.groups,
        "after_close": after_close,
        "logged": logged,
        "computed": computed,
    }


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


def test_every_rank_has_the_mean_of_the_newest_batch_finished_at_the_first_stage(runs) -> None:  # type: ignore[no-untyped-def]
    # 2-stage async, 2 microbatches: stage 0 runs F0 F1 B0 in step 0 (batch 0 unfinished), its
    # step 1 finishes batch 0, and the drain after step 2 finishes every batch up to 2
    computed = runs[1]["async"]["computed"]  # the last stage's losses by (batch, microbatch)
    mean = {t: (computed[(t, 0)] + computed[(t, 1)]) / 2 for t in range(STEPS)}
    for rank in (0, 1):
        assert runs[rank]["async"]["logged"] == [None, mean[0], mean[2]], f"rank {rank}"
        assert runs[rank]["async"]["loss_batches"] == [None, 0, 2], f"rank {rank}"


def test_each_segment_is_built_once_per_run(runs) -> None:  # type: ignore[no-untyped-def]
    # every step asks for its own segment, the next lookahead ones and the first stage's
    for rank in (0, 1):
        built = runs[rank]["async"]["built"]
        assert len(built) == len(set(built)), f"rank {rank}: {built}"
        assert (rank, 0) in built and (0, 0) in built  # its own and the first stage's


def test_replicas_of_the_last_stage_share_their_losses(runs) -> None:  # type: ignore[no-untyped-def]
    # one stage, two replicas, flush: each replica computes one of the 2 microbatches' losses
    assert runs[0]["replicated"]["computed"].keys() == {0}
    assert runs[1]["replicated"]["computed"].keys() == {1}
    expected = (runs[0]["replicated"]["computed"][0] + runs[1]["replicated"]["computed"][1]) / 2
    for rank in (0, 1):
        assert runs[rank]["replicated"]["logged"] == expected, f"rank {rank}"


def test_close_gives_back_the_replica_groups(runs) -> None:  # type: ignore[no-untyped-def]
    for rank in (0, 1):
        got = {k: runs[rank]["replicated"][k] for k in ("ranks", "left", "after_close")}
        assert got == {"ranks": [0, 1], "left": [], "after_close": "destroyed"}


def test_setup_builds_and_validates_only_the_ranks_own_neighbourhood(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Rank 17 of 32 stages: its setup builds the lists of stages 16-18 and of the input stage's
    neighbourhood (stages 0-1, whose backward passes say which batch finished), and validates
    one schedule that holds exactly those (no process needed: the runner is built on a stand-in
    executor that only names its rank)."""
    import importlib
    from types import SimpleNamespace

    build_module = importlib.import_module("pl_pipedream.schedule.build")
    validate_module = importlib.import_module("pl_pipedream.schedule.validate")
    expanded: list[int] = []
    expand, checks = build_module.expand, validate_module.CHECKS

    def counted(plan, sync, m, rank, tokens):  # type: ignore[no-untyped-def]
        expanded.append(rank)
        return expand(plan, sync, m, rank, tokens)

    held: list[tuple[int, ...]] = []

    def first_check(schedule):  # type: ignore[no-untyped-def]
        held.append(tuple(r for r, actions in enumerate(schedule.actions) if actions))
        return checks[0](schedule)

    monkeypatch.setattr(build_module, "expand", counted)
    monkeypatch.setattr(validate_module, "CHECKS", (first_check, *checks[1:]))
    plan = Plan.from_balance([1] * 32)
    runner = PipelineRunner(plan, SyncMode.ASYNC, 1, SimpleNamespace(rank=17), None)  # type: ignore[arg-type]
    assert sorted(set(expanded)) == [0, 1, 16, 17, 18]
    assert held == [(0, 1, 16, 17, 18)]
    assert runner.stream.segment(17, 0)  # cut from the schedule validated above
    assert held == [(0, 1, 16, 17, 18)]
