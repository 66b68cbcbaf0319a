"""Moving a drained pipeline to another plan in memory (``core.relayout``): which rank sends
what (pure), then on gloo ranks: every rank's new stage holds the values and the Adam state of
one device's model, with a tied weight and a replicated stage; a lost peer is named by every
surviving rank, at once."""

from __future__ import annotations

import os
import time

import pytest
import torch
from torch import nn

from pl_pipedream.core import named_state, relayout
from pl_pipedream.core.elsewhere import HeldElsewhere, mark_other_stages
from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.placement import keep_local_parameters
from pl_pipedream.core.stage import cut_stage
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.frames import PeerError
from tests.runtime.distributed import run


def tied_model() -> nn.Sequential:
    """Six layers, the first and the last sharing a weight, one buffer."""
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(
        first, nn.Tanh(), nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), last
    )


def trained(model: nn.Sequential, steps: int = 2) -> torch.optim.Adam:
    """``steps`` Adam steps of ``model`` on one device; returns the optimizer."""
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(8, 4, generator=generator)
        optimizer.zero_grad()
        model(x).square().mean().backward()
        optimizer.step()
    return optimizer


def test_moves_send_each_missing_name_from_the_first_replica_of_its_first_holder() -> None:
    names = [["w"], [], ["a"], ["b", "w"]]  # layer 3 uses layer 0's weight
    old = Plan.from_balance([2, 2], replicas=[2, 1])  # ranks 0, 1 | 2
    new = Plan.from_balance([1, 3], replicas=[1, 2])  # rank 0 | ranks 1, 2
    # rank 1 kept "w" (layer 0's, and layer 3's); rank 2 held layers 2 and 3 already
    assert relayout.moves(old, new, names) == {(2, 1): ["a", "b"]}


def test_moves_take_a_name_from_the_first_old_stage_that_holds_it() -> None:
    names = [["w"], [], ["a"], ["b", "w"]]
    old = Plan.from_balance([1, 1, 2])  # ranks 0 | 1 | 2; "w" on stages 0 and 2
    new = Plan.from_balance([2, 2], replicas=[1, 2])  # rank 0 | ranks 1, 2
    # rank 1 held nothing: "w" comes from rank 0 (stage 0, its first holder), "a" and "b"
    # from rank 2; rank 2, the other replica, held them all already
    assert relayout.moves(old, new, names) == {(0, 1): ["w"], (2, 1): ["a", "b"]}


def test_a_new_plan_over_other_ranks_or_layers_is_refused() -> None:
    model = tied_model()
    plan = Plan.from_balance([6])
    local = cut_stage(model, model, plan, 0)
    for new, match in [
        (Plan.from_balance([3, 3]), "over the same ranks"),
        (Plan.from_balance([5]), "each of the 6 layers"),
    ]:
        with pytest.raises(PipelineSetupError, match=match):
            relayout.relayout(model, model, local, plan, new, 0, [], [], torch.device("cpu"), 5.0)


def _move(rank: int, world: int, old: Plan, new: Plan, lost: int | None = None) -> dict:
    """Cut a trained model under ``old`` as a pipeline rank does, move it to ``new``; return
    what the new stage holds: its tensors, its optimizer groups and state by name."""
    model = tied_model()
    optimizer = trained(model)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = [named_state.group_names(optimizer.param_groups, names)]
    local = cut_stage(model, model, old, rank)
    mark_other_stages(model, model, old, rank)
    keep_local_parameters(model, [optimizer])
    held = {id(p) for g in optimizer.param_groups for p in g["params"]}
    for param in [p for p in optimizer.state if id(p) not in held]:
        del optimizer.state[param]
    if rank == lost:
        exchange = relayout._Exchange._exchange

        def die(self, peer, payload, what=""):  # type: ignore[no-untyped-def]
            exchange(self, peer, payload, what)
            os._exit(0)  # lost in the middle of the move, after its first message

        relayout._Exchange._exchange = die  # type: ignore[method-assign]
    started = time.monotonic()
    try:
        moved = relayout.relayout(
            model, model, local, old, new, rank, [optimizer], groups, torch.device("cpu"), 20.0
        )
    except PeerError as error:
        return {"error": str(error), "seconds": time.monotonic() - started}
    state = optimizer.state
    by_name = {n: p for n, p in model.named_parameters()}
    return {
        "stage": moved.local.stage.index,
        "tensors": {n: t.detach().clone() for n, t in moved.local.module.state_dict().items()},
        "full": {moved.local.names[n]: t for n, t in moved.local.module.state_dict().items()},
        "groups": [[by_name_of(model, p) for p in g["params"]] for g in optimizer.param_groups],
        "state": {by_name_of(model, p): dict(s) for p, s in state.items()},
        "meta": sorted(n for n, p in by_name.items() if p.is_meta),
        "elsewhere": sorted(n for n, p in by_name.items() if isinstance(p, HeldElsewhere)),
        "received": moved.bytes_received,
        "ties": [t.stages for t in moved.local.ties],
    }


def by_name_of(model: nn.Module, param: torch.Tensor) -> str:
    return next(n for n, p in model.named_parameters() if p is param)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("old", "new"),
    [
        (Plan.from_balance([3, 3]), Plan.from_balance([1, 5])),
        (Plan.from_balance([2, 2, 2]), Plan.from_balance([4, 2], replicas=[2, 1])),
        (Plan.from_balance([4, 2], replicas=[2, 1]), Plan.from_balance([1, 2, 3])),
    ],
    ids=["2 ranks", "3 ranks to a replicated stage", "3 ranks from a replicated stage"],
)
def test_every_new_stage_holds_one_devices_values_and_adam_state(old: Plan, new: Plan) -> None:
    results = run(new.num_workers, _move, old, new, timeout=120.0)
    reference = tied_model()
    optimizer = trained(reference)
    expected = reference.state_dict()
    state = {n: optimizer.state[p] for n, p in reference.named_parameters()}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        stage = new.stage_of_rank(rank)
        assert value["stage"] == stage.index
        layers = {int(node) for node in stage.nodes}
        for name, tensor in value["full"].items():
            assert int(name.split(".")[0]) in layers or name == "0.weight", (rank, name)
            assert torch.equal(tensor, expected[name]), (rank, name)
        held = sorted({n for n in value["full"] if n in state})
        assert sorted(value["groups"][0]) == held, rank
        assert sorted(value["state"]) == held, rank
        for name in held:
            for key, tensor in state[name].items():
                assert torch.equal(value["state"][name][key], tensor), (rank, name, key)
            assert value["state"][name]["step"].device.type == "cpu"
        assert value["meta"] == value["elsewhere"]  # every other stage's parameter is marked
        assert not set(value["meta"]) & set(held)
    assert sum(value["received"] for _, value in results.values()) > 0


@pytest.mark.slow
def test_a_peer_lost_during_the_move_is_named_by_every_surviving_rank() -> None:
    old, new = Plan.from_balance([2, 2, 2]), Plan.from_balance([1, 1, 4])
    results = run(3, _move, old, new, 2, timeout=60.0, killed=(2,))
    assert sorted(results) == [0, 1]
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert "rank 2 was lost during the move" in value["error"], rank
        assert value["seconds"] < 20.0, rank  # named at once, not after the timeout
