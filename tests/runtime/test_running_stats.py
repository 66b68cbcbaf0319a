"""BatchNorm statistics of replicated stages (``runtime.running_stats``): the replicas' running
statistics equal one layer's that ran every forward in minibatch order, after every all-reduce.

The fast tests play the replicas in one process (the all-reduce is a sum of their messages);
the slow one runs the executor over gloo in every sync mode against the single-process oracle,
whose forwards run in minibatch order on the model's own buffers.
"""

from __future__ import annotations

import copy
from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.running_stats import RunningStats
from pl_pipedream.schedule import build
from pl_pipedream.schedule.actions import ActionKind
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import optimizer_update

MODES = ("async", "vertical_sync", "2bw", "flush", "gpipe")
RECOMPUTED = "2bw+recompute"  # a replay runs the forward again, on copies of the buffers
NUM_BATCHES = 4
TOLERANCE = 1e-5  # measured: 6.6e-7 (running statistics), weights as test_executor's


def _inputs(count: int, features: int = 5) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randn(4, features, generator=generator) * (1 + k) + k for k in range(count)]


def _play(layer: nn.BatchNorm1d, replicas: int, windows: list[list[int]]) -> list[nn.Module]:
    """Each window's minibatches run round robin on copies of ``layer``; an all-reduce (the
    sum of every replica's message) closes each window. Returns the replicas' layers."""
    copies = [copy.deepcopy(layer) for _ in range(replicas)]
    stats = [RunningStats.of(c, replicas, f"replica {r}") for r, c in enumerate(copies)]
    xs = _inputs(max(i for w in windows for i in w) + 1)
    for window in windows:
        for i in window:
            with stats[i % replicas].forward(i):  # type: ignore[union-attr]
                copies[i % replicas](xs[i])
        total = sum(s.message(r) for r, s in enumerate(stats))  # type: ignore[union-attr]
        for s in stats:
            s.combine(total.clone())  # type: ignore[union-attr]
    return copies


def _one_layer(layer: nn.BatchNorm1d, count: int) -> nn.Module:
    alone = copy.deepcopy(layer)
    for x in _inputs(count):
        alone(x)
    return alone


@pytest.mark.parametrize("momentum", [0.1, 0.5, None])
@pytest.mark.parametrize("replicas", [2, 3])
def test_replicas_hold_one_layers_statistics_after_every_all_reduce(momentum, replicas) -> None:
    layer = nn.BatchNorm1d(5, momentum=momentum)
    windows = [list(range(0, 2 * replicas)), list(range(2 * replicas, 3 * replicas)), []]
    windows.append(list(range(3 * replicas, 6 * replicas)))
    for end in range(1, len(windows) + 1):
        copies = _play(layer, replicas, windows[:end])
        count = sum(len(w) for w in windows[:end])
        alone = _one_layer(layer, count)
        for c in copies:
            for name, buffer in c.named_buffers():
                assert torch.equal(buffer, copies[0].get_buffer(name)), name  # bit-identical
                want = alone.get_buffer(name).double()
                diff = ((buffer.double() - want).abs() / want.abs().clamp(min=1)).max().item()
                assert diff <= 1e-6, (name, diff)  # relative; measured up to 2e-7
        assert int(copies[0].num_batches_tracked) == count


def test_replicas_without_the_combination_differ() -> None:
    """Guards the comparison above: each replica alone keeps only its own minibatches."""
    layer = nn.BatchNorm1d(5)
    copies = [copy.deepcopy(layer) for _ in range(2)]
    for i, x in enumerate(_inputs(4)):
        copies[i % 2](x)
    alone = _one_layer(layer, 4)
    assert (copies[0].running_mean - alone.running_mean).abs().max() > 1e-2
    assert int(copies[0].num_batches_tracked) == 2


def test_a_layer_that_skips_minibatches_is_refused() -> None:
    layer = nn.BatchNorm1d(5)
    stats = RunningStats.of(layer, 2, "rank 1 (stage 0)")
    assert stats is not None
    xs = _inputs(5)
    for i in (0, 4):  # replica 0 skipped minibatch 2
        with stats.forward(i):
            layer(xs[i])
    with pytest.raises(RuntimeError, match=r"rank 1 \(stage 0\).*consecutive minibatches"):
        stats.message(0)


def test_nothing_is_recorded_outside_the_executors_forwards() -> None:
    layer = nn.BatchNorm1d(5)
    assert RunningStats.of(layer, 1, "") is None  # one replica: nothing to combine
    assert RunningStats.of(nn.BatchNorm1d(5, track_running_stats=False), 2, "") is None
    stats = RunningStats.of(layer, 2, "")
    assert stats is not None
    layer(_inputs(1)[0])  # a forward of someone else's (a summary, a replay)
    assert not stats.pending
    stats.close()
    with stats.forward(0):
        layer(_inputs(1)[0])
    assert not stats.pending


# ----- the executor over gloo, every sync mode -------------------------------------------------


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8),
        nn.BatchNorm1d(8),
        nn.Tanh(),
        nn.Linear(8, 8),
        nn.BatchNorm1d(8, momentum=None),  # the cumulative average
        nn.Linear(8, 3),
    )


def make_batches(m: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    size = 3 * m
    return [
        (torch.randn(size, 6, generator=generator) + t, torch.randn(size, 3, generator=generator))
        for t in range(NUM_BATCHES)
    ]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _pieces(actions):  # type: ignore[no-untyped-def]
    """A rank's list cut right after each ``ALLREDUCE``."""
    cuts = [k + 1 for k, a in enumerate(actions) if a.kind is ActionKind.ALLREDUCE]
    bounds = [0, *cuts, len(actions)]
    return [actions[a:b] for a, b in zip(bounds, bounds[1:], strict=False) if b > a]


def _train_stage(rank: int, plan: Plan, mode: str, m: int, groups):  # type: ignore[no-untyped-def]
    sync = mode.split("+")[0]
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    batches = make_batches(m)
    xs = [x for batch in batches for x in batch[0].chunk(m)]
    ys = [y for batch in batches for y in batch[1].chunk(m)]
    executor = StageExecutor(
        module,
        rank,
        stage.index,
        plan.num_stages,
        Channel(rank, torch.device("cpu"), timeout=60.0),
        update_settings(SyncMode(sync), m, stage.replicas),
        replica_group=groups[stage.index],
        num_replicas=stage.replicas,
        recompute=mode == RECOMPUTED,
    )
    feed = Feed(lambda i: xs[i], lambda out, i: loss_fn(out, ys[i]))
    actions = build(plan, sync, NUM_BATCHES, m).actions[rank]
    after_each = []  # the buffers after each all-reduce
    pieces = _pieces(actions)
    for k, piece in enumerate(pieces):
        rest = tuple(a for later in pieces[k + 1 :] for a in later)
        executor.execute(piece, feed, optimizer_update(module, optimizer), lookahead=rest)
        after_each.append({n: b.clone() for n, b in module.named_buffers()})
    state = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return state, after_each


def _all_modes(rank: int, world: int, plan_dict: dict, m: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    groups = [dist.new_group(list(s.ranks)) if s.replicas > 1 else None for s in plan.stages]
    return {mode: _train_stage(rank, plan, mode, m, groups) for mode in (*MODES, RECOMPUTED)}


PLANS = {
    "first stage replicated": (Plan.from_balance([3, 3], replicas=[2, 1]), 4),
    "last stage replicated": (Plan.from_balance([3, 3], replicas=[1, 2]), 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(PLANS))
def test_replicated_batchnorm_equals_the_oracle_in_every_mode(label: str) -> None:
    plan, m = PLANS[label]
    results = run(plan.num_workers, _all_modes, plan.to_dict(), m, timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    optimizer = lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9)  # noqa: E731
    worst = 0.0
    for sync in (*MODES, RECOMPUTED):
        rule = sync.split("+")[0]
        expected = oracle.train(make_model(), plan, rule, make_batches(m), m, loss_fn, optimizer)
        for stage in plan.stages:
            first = results[stage.ranks[0]][1][sync][1]
            for rank in stage.ranks:
                state, after_each = results[rank][1][sync]
                assert len(after_each) == len(first)
                for k, (got, want) in enumerate(zip(after_each, first, strict=True)):
                    for name in got:  # bit-identical after every all-reduce
                        assert torch.equal(got[name], want[name]), (sync, rank, k, name)
                for key, tensor in state.items():
                    diff = (tensor.double() - expected[key].double()).abs().max().item()
                    if "running" in key:
                        worst = max(worst, diff)
                    assert diff <= TOLERANCE, f"{sync} rank {rank} {key}: {diff}"
                    if key.endswith("num_batches_tracked"):
                        assert int(tensor) == int(expected[key]) == NUM_BATCHES * m
    print(f"largest running-statistics difference from the oracle: {worst:.2e}")
