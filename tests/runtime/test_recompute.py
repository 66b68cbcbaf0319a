"""Activation recomputation (``recompute=True``) against the oracle, and what stages keep.

One spawn per plan; inside it every sync mode with and without recomputation, so the
multi-process cost is paid once per plan. Without dropout the recomputed pipeline must equal the
single-process oracle; with dropout (whose draws the oracle, one process, cannot reproduce) it
must equal the same pipeline without recomputation, bit for bit.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.runtime.recompute import Activations, Replay, detached, rng_state
from pl_pipedream.schedule import build
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import (
    NUM_BATCHES,
    OPTIMIZERS,
    loss_fn,
    make_batches,
    make_model,
    optimizer_update,
)

MODES = ("async", "vertical_sync", "2bw", "flush", "gpipe")


def make_dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Dropout(0.3), nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 3),
        nn.Identity(),
    )  # fmt: skip


def _train(rank, plan, sync, m, recompute, dropout, groups, prediction=False):  # type: ignore[no-untyped-def]
    model = make_dropout_model() if dropout else make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    optimizer = OPTIMIZERS["sgd"](list(module.parameters()))
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
        weight_prediction=prediction,
        recompute=recompute,
    )
    torch.manual_seed(100 + rank)  # the dropout draws: the same in both runs of a rank
    feed = Feed(lambda i: xs[i], lambda out, i: loss_fn(out, ys[i]))
    actions = build(plan, sync, NUM_BATCHES, m).actions[rank]
    executor.execute(actions, feed, optimizer_update(module, optimizer))
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    meter = executor.activations
    return weights, (meter.peak_kept_bytes, meter.peak_bytes), meter.replays


def _all(rank: int, world: int, plan_dict: dict, m: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    groups = [dist.new_group(list(s.ranks)) if s.replicas > 1 else None for s in plan.stages]
    out = {}
    for sync in MODES:
        for recompute in (False, True):
            for dropout in (False, True):
                out[sync, recompute, dropout] = _train(
                    rank, plan, sync, m, recompute, dropout, groups
                )
    for sync in ("async", "vertical_sync"):
        out[sync, "prediction"] = _train(rank, plan, sync, m, True, False, groups, True)
    return out


PLANS = {
    "2 stages": (Plan.from_balance([3, 3]), 2),
    "3 stages": (Plan.from_balance([2, 2, 2]), 3),
    "2-1 replicated": (Plan.from_balance([3, 3], replicas=[2, 1]), 4),
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(PLANS))
def test_recompute_equals_the_oracle_and_keeps_less(label: str) -> None:
    plan, m = PLANS[label]
    results = run(plan.num_workers, _all, plan.to_dict(), m, timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    sgd = OPTIMIZERS["sgd"]
    for sync in MODES:
        expected = oracle.train(make_model(), plan, sync, make_batches(m), m, loss_fn, sgd)
        for stage in plan.stages:
            for rank in stage.ranks:
                got, peak, replays = results[rank][1][sync, True, False]
                for key, tensor in got.items():
                    diff = (tensor - expected[key]).abs().max().item()
                    assert diff <= 1e-6, f"{sync} rank {rank} {key}: {diff}"
                plain, plain_dropout = (results[rank][1][sync, False, d] for d in (False, True))
                recomputed_dropout = results[rank][1][sync, True, True]
                for key, tensor in recomputed_dropout[0].items():
                    assert torch.equal(tensor, plain_dropout[0][key]), f"{sync} rank {rank} {key}"
                if stage.index < plan.num_stages - 1:  # the last stage keeps its graph
                    assert replays == NUM_BATCHES * m // stage.replicas
                    # what stays in flight shrinks; with the replay's graph, at most one more
                    kept, with_replay = peak
                    assert kept < plain[1][0], f"{sync} rank {rank}: {kept} >= {plain[1][0]}"
                    assert with_replay < plain[1][0] + plain[1][0] // stage.weight_versions
                    assert plain[1][0] == plain[1][1]  # no replay without recomputation
                else:
                    assert replays == 0
    for sync in ("async", "vertical_sync"):
        expected = oracle.train(
            make_model(), plan, sync, make_batches(m), m, loss_fn, sgd, weight_prediction=True
        )
        for rank, (_, value) in results.items():
            for key, tensor in value[sync, "prediction"][0].items():
                diff = (tensor - expected[key]).abs().max().item()
                assert diff <= 1e-6, f"{sync} prediction rank {rank} {key}: {diff}"


def test_a_dropped_forward_keeps_nothing_and_the_replay_draws_the_same_numbers() -> None:
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5), nn.Tanh())
    params = {n: p.detach().requires_grad_(True) for n, p in module.named_parameters()}
    x = torch.randn(32, 64)
    meter = Activations(True, torch.device("cpu"))
    state = rng_state(torch.device("cpu"))
    with meter.forward(0, x, params.values(), drop=True):
        first = torch.func.functional_call(module, params, (x,))
    assert first.requires_grad  # the flag the next stage reads
    (kept,) = detached([first])
    assert kept.requires_grad and kept.grad_fn is None
    meter.done(0, [x, kept])
    assert meter.in_flight[0] == 2 * 32 * 64 * 4  # the input and the output, nothing saved
    with pytest.raises(RuntimeError, match="replay the forward first"):
        first.sum().backward()
    after = torch.rand(3)  # what the generator gives next, with no replay in between
    torch.set_rng_state(state[0])
    torch.func.functional_call(module, params, (x,))
    after_forward = torch.get_rng_state()
    again = meter.replay(0, Replay(x, state), module, params)
    assert torch.equal(again, first.detach())  # the same dropout mask
    assert torch.equal(torch.get_rng_state(), after_forward)  # the generator as it was
    assert torch.equal(torch.rand(3), after)
    plain = Activations(False, torch.device("cpu"))
    with plain.forward(1, x, params.values(), drop=False):
        torch.func.functional_call(module, params, (x,))
    plain.done(1, [x])
    # x, the dropout mask and its output, the tanh output: the weights are not counted
    assert plain.in_flight[1] >= 3 * 32 * 64 * 4
    assert meter.peak_bytes > meter.in_flight[0]  # the replay's graph counted while it lived


def test_a_replay_on_an_input_changed_in_place_is_refused() -> None:
    # A first layer doubling its input in place: the replay would double it again and compute
    # other values (before: silently, the gradients of a 4x input).
    class Doubled(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.mul_(2)

    module = nn.Sequential(nn.Identity(), nn.Linear(8, 8))
    params = {n: p.detach().requires_grad_(True) for n, p in module.named_parameters()}
    meter = Activations(True, torch.device("cpu"))
    for changed in (False, True):
        module[0] = Doubled() if changed else nn.Identity()
        x = torch.randn(4, 8)
        replay = Replay(x, rng_state(torch.device("cpu")))
        with meter.forward(0, x, params.values(), drop=True):
            torch.func.functional_call(module, params, (x,))
        if changed:
            with pytest.raises(RuntimeError, match=r"changed in place .* \(minibatch: 0, input "):
                meter.replay(0, replay, module, params)
        else:
            meter.replay(0, replay, module, params)
    x = torch.randn(4, 8)
    structure = Replay((x, {"mask": x[:, 0], "n": 3}, [x.t()]), rng_state(torch.device("cpu")))
    assert structure.versions == [x._version] * 3  # every tensor, in order; views share one


def test_activations_are_counted_once_per_input_shape() -> None:
    module = nn.Sequential(nn.Linear(8, 8), nn.Tanh())
    params = dict(module.named_parameters())
    meter = Activations(False, torch.device("cpu"))
    for i, rows in enumerate((4, 4, 2)):
        x = torch.randn(rows, 8)
        with meter.forward(i, x, params.values(), drop=False):
            hooked = torch._C._autograd._top_saved_tensors_default_hooks(False) is not None
            out = torch.func.functional_call(module, params, (x,))
        assert hooked == (i != 1)  # the second minibatch of 4 rows is not counted again
        meter.done(i, (x, out))
    # x (Linear's input) and Tanh's output: each 4 x 8 floats, then 2 x 8
    assert meter.in_flight == {0: 2 * 4 * 8 * 4, 1: 2 * 4 * 8 * 4, 2: 2 * 2 * 8 * 4}
    assert meter.peak_bytes == 2 * 256 + 128  # all three in flight
