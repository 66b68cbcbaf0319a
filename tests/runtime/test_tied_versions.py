"""TiedVersions through the pipeline runner over gloo: a weight tied between stages 0 and 2 of a
3-stage pipeline in ``async`` and ``vertical_sync`` trains as the oracle's tie rule says (version
max(0, i - 2) for minibatch i, one update per minibatch of the gradient summed over both uses), and
the two copies are bit-identical after the drain."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from pl_pipedream.planner.plan import Plan
from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime.pipeline import PipelineRunner
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import oracle
from tests.runtime.distributed import run
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, optimizer_update

pytestmark = pytest.mark.slow  # one spawn of three ranks: about 5 s

M = 2
PLAN = Plan.from_balance([2, 2, 1])  # layer 4's weight is layer 0's
TIED = {0: "0.weight", 2: "4.weight"}
TIE = Tie(
    names=("0.weight", "4.weight"),
    stages=(0, 2),
    stage_names=("0.weight", "4.weight"),
    stage_ranks=((0,), (2,)),
)
RUNS = [(sync, name) for sync in ("async", "vertical_sync") for name in ("sgd", "adam")]


def tied_model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    model[4].weight = model[0].weight
    return model


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(2 * M, 4, generator=generator), torch.randn(2 * M, 4, generator=generator))
        for _ in range(5)
    ]


def _train(
    rank: int, sync: str, optimizer_name: str, drains: tuple[int, ...] = (4,)
) -> dict[str, torch.Tensor]:
    model = tied_model()
    stage = PLAN.stage_of_rank(rank)
    module = nn.Sequential(OrderedDict((n, model[int(n)]) for n in stage.nodes))
    apply = optimizer_update(module, OPTIMIZERS[optimizer_name](module.parameters()))

    runner = PipelineRunner.create(
        PLAN, SyncMode(sync), M, module, rank, apply, torch.device("cpu"), 30.0, ties=[TIE]
    )
    data = batches()
    for t, (x, y) in enumerate(data):
        xs, ys = x.chunk(M), y.chunk(M)
        runner.train_batch(
            lambda j, xs=xs: xs[j],
            lambda out, j, ys=ys: loss_fn(out, ys[j]),
            drain=t in drains,
        )
    assert runner.executor.stash.exclude == ({TIED[rank]} if rank in TIED else set())
    weights = {k: v.detach().clone() for k, v in module.state_dict().items()}
    runner.close()
    return weights


def _every_run(rank: int, world: int) -> dict:
    out = {key: _train(rank, *key) for key in RUNS}
    out["two runs"] = _train(rank, "async", "adam", drains=(1, 4))
    return out


@pytest.mark.parametrize("key", RUNS)
def test_a_weight_tied_across_three_stages_follows_the_oracle(key, results) -> None:  # type: ignore[no-untyped-def]
    sync, name = key
    expected = oracle.train(tied_model(), PLAN, sync, batches(), M, loss_fn, OPTIMIZERS[name])
    for rank in range(3):
        for layer_name, tensor in results[rank][key].items():
            diff = (tensor - expected[layer_name]).abs().max().item()
            assert diff <= 1e-5, f"{sync} {name} rank {rank} {layer_name}: {diff}"
    assert torch.equal(results[0][key]["0.weight"], results[2][key]["4.weight"])


@pytest.fixture(scope="module")
def results() -> dict[int, dict]:
    out = run(3, _every_run, timeout=120.0)
    for rank, (status, value) in out.items():
        assert status == "ok", f"rank {rank}: {value}"
    return {rank: value for rank, (_, value) in out.items()}


def test_after_a_drain_the_next_run_keeps_the_copies_identical(results) -> None:  # type: ignore[no-untyped-def]
    two_runs = results[0]["two runs"], results[2]["two runs"]
    assert torch.equal(two_runs[0]["0.weight"], two_runs[1]["4.weight"])
    one_run = results[0][("async", "adam")]["0.weight"]
    assert not torch.equal(two_runs[0]["0.weight"], one_run)  # the drain changed the versions
