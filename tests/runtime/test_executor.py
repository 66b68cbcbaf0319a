"""The stage executor over gloo, against the single-process oracle of the update rules.

One spawn per plan; inside it every sync mode with SGD (momentum) and Adam, so the multi-process
cost is paid once per plan.
"""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.engine.pipeline import Pipeline
from pl_pipedream.planner.plan import Plan
from pl_pipedream.profile.handoff import HandoffError
from pl_pipedream.runtime import update
from pl_pipedream.runtime.channel import Channel
from pl_pipedream.runtime.executor import StageExecutor
from pl_pipedream.runtime.feed import Feed
from pl_pipedream.schedule import build
from pl_pipedream.schedule.modes import SyncMode, update_settings
from tests.runtime import oracle
from tests.runtime.distributed import one_rank_group, run

MODES = ("async", "vertical_sync", "2bw", "flush", "gpipe", "zero_bubble")
SAME_AS_ONE_DEVICE = {"flush", "gpipe", "zero_bubble"}  # the flushed modes update alike
OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}
NUM_BATCHES = 5


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3), nn.Identity()
    )


def make_batches(num_microbatches: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    size = 2 * num_microbatches
    return [
        (torch.randn(size, 6, generator=generator), torch.randn(size, 3, generator=generator))
        for _ in range(NUM_BATCHES)
    ]


def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return ((output - target) ** 2).mean()


def _train_stage(rank: int, plan: Plan, sync: str, m: int, optimizer_name: str, groups):  # type: ignore[no-untyped-def]
    model = make_model()
    stage = plan.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    params = list(module.parameters())
    optimizer = OPTIMIZERS[optimizer_name](params) if params else None
    batches = make_batches(m)
    xs = [x for batch in batches for x in batch[0].chunk(m)]
    ys = [y for batch in batches for y in batch[1].chunk(m)]

    apply_update = optimizer_update(module, optimizer)
    executor = StageExecutor(
        module,
        rank,
        stage.index,
        plan.num_stages,
        Channel(rank, torch.device("cpu"), timeout=60.0),
        update_settings(SyncMode(sync), m, stage.replicas),
        replica_group=groups[stage.index],
        num_replicas=stage.replicas,
    )
    feed = Feed(lambda i: xs[i], lambda out, i: loss_fn(out, ys[i]))
    executor.execute(build(plan, sync, NUM_BATCHES, m).actions[rank], feed, apply_update)
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    return weights, executor.stash.peak_count, executor.updates.copied_bytes


def _all_modes(rank: int, world: int, plan_dict: dict, m: int) -> dict:
    plan = Plan.from_dict(plan_dict)
    groups = [dist.new_group(list(s.ranks)) if s.replicas > 1 else None for s in plan.stages]
    out = {}
    for sync in MODES:
        for name in OPTIMIZERS:
            out[sync, name] = _train_stage(rank, plan, sync, m, name, groups)
    return out


PLANS = {
    "2 stages": (Plan.from_balance([3, 3]), 2),
    "3 stages": (Plan.from_balance([2, 2, 2]), 3),
    "4 stages": (Plan.from_balance([1, 2, 2, 1]), 4),
    "2-1 replicated": (Plan.from_balance([3, 3], replicas=[2, 1]), 4),  # linear sums + all-reduce
}


@pytest.mark.slow
@pytest.mark.parametrize("label", list(PLANS))
def test_pipeline_weights_equal_the_oracle(label: str) -> None:
    plan, m = PLANS[label]
    results = run(plan.num_workers, _all_modes, plan.to_dict(), m, timeout=240.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
    for sync in MODES:
        for name, make_optimizer in OPTIMIZERS.items():
            expected = oracle.train(
                make_model(), plan, sync, make_batches(m), m, loss_fn, make_optimizer
            )
            for stage in plan.stages:
                for rank in stage.ranks:
                    got, peak, copied = results[rank][1][sync, name]
                    for key, tensor in got.items():
                        diff = (tensor - expected[key]).abs().max().item()
                        assert diff <= 1e-5, f"{sync}/{name} rank {rank} {key}: {diff}"
                    if sync == "async":
                        assert peak <= stage.weight_versions
                    if name == "sgd":  # stashing SGD's weights copies nothing
                        assert copied == 0, f"{sync} rank {rank}: {copied} bytes copied"
                    elif sync == "async" and stage.index == 0 and stage.replicas == 1:
                        assert copied > 0  # Adam steps in place on a copy of stashed weights


def test_the_oracle_tells_the_modes_apart() -> None:
    """Guards the comparison above: stale weights must change the result."""
    plan, m = PLANS["3 stages"]
    results = {
        sync: oracle.train(make_model(), plan, sync, make_batches(m), m, loss_fn, OPTIMIZERS["sgd"])
        for sync in MODES
    }
    for a in MODES:
        for b in MODES:
            if a < b and not {a, b} <= SAME_AS_ONE_DEVICE:
                diff = max((results[a][k] - results[b][k]).abs().max().item() for k in results[a])
                assert diff > 1e-4, (a, b)


def optimizer_update(module: nn.Module, optimizer: torch.optim.Optimizer | None):  # type: ignore[no-untyped-def]
    """The executor's ``Update`` for a stage stepped by ``optimizer`` (None: no parameters)."""

    def apply_update(gradients: dict[str, torch.Tensor], storage) -> int:  # type: ignore[no-untyped-def]
        if optimizer is None:
            return 0
        params = dict(module.named_parameters())
        for name, param in params.items():
            param.grad = gradients.get(name)
        copied = update.step(optimizer, {params[n]: t for n, t in storage.items()})
        optimizer.zero_grad(set_to_none=True)
        return copied

    return apply_update


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


@pytest.mark.parametrize(
    ("sync", "balance", "boundary"),
    [
        ("flush", [4], "after layer 1: _Pair, on rank 0 (stage 0)"),
        ("zbv", [2, 2], "after layer 1 (the last of stage 0), on rank 0 (stage 1)"),
    ],
    ids=["in a stage", "between stages"],
)
def test_a_layer_that_cannot_take_the_tuple_before_it_names_the_boundary(
    sync: str, balance: list[int], boundary: str
) -> None:
    """One process: in a V both stages are rank 0's, so the tuple crosses a stage boundary."""
    model = nn.Sequential(nn.Linear(6, 4), _Pair(), nn.Linear(4, 3), nn.Identity())
    with one_rank_group():
        with Pipeline(
            model, nn.functional.mse_loss, OPTIMIZERS["sgd"], sync=sync, microbatches=2,
            balance=balance,
        ) as pipeline:  # fmt: skip
            with pytest.raises(HandoffError) as caught:
                pipeline.train_step(make_batches(2)[0])
    assert f"(layer 2: Linear, {boundary}; passed: tuple(Tensor(2, 4) float32, " in str(
        caught.value
    )
    assert type(caught.value.__cause__) is TypeError
