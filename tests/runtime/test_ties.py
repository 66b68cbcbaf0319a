"""TiedGradients: the holders of a tied parameter sum their partial gradients before an update."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.planner.ties import Tie
from pl_pipedream.runtime.frames import PeerError
from pl_pipedream.runtime.ties import TiedGradients, check_ties
from pl_pipedream.schedule.modes import SyncMode
from tests.runtime import distributed
from tests.runtime.distributed import one_rank_group

ONE_HOLDER = Tie(("weight",), stages=(0,), stage_names=("weight",), stage_ranks=((0,),))


def test_one_holder_keeps_its_sum_in_a_tensor_of_its_own() -> None:
    module = nn.Linear(3, 2)
    partial = torch.ones(2, 3)
    with one_rank_group():
        ties = TiedGradients.create([ONE_HOLDER], rank=0)
        accumulated = {"weight": partial, "bias": torch.ones(2)}
        assert ties.reduce(accumulated, module) == {"weight"}
    assert torch.equal(accumulated["weight"], partial)
    assert accumulated["weight"] is not partial  # the partial sum is not written in place


def test_a_holder_without_a_use_adds_zeros() -> None:
    module = nn.Linear(3, 2)
    with one_rank_group():
        ties = TiedGradients.create([ONE_HOLDER], rank=0)
        accumulated: dict[str, torch.Tensor] = {}
        ties.reduce(accumulated, module)
    assert torch.equal(accumulated["weight"], torch.zeros(2, 3))


def _sum_over_holders(rank: int, world: int) -> Any:
    module = nn.Linear(2, 2)
    # Rank 0 and 2 hold the tie; rank 1 does not (its stage has no layer using it).
    tie = Tie(
        ("weight",), stages=(0, 2), stage_names=("weight", "weight"), stage_ranks=((0,), (2,))
    )
    ties = TiedGradients.create([tie], rank)
    accumulated = {"weight": torch.full((2, 2), float(rank + 1))} if rank != 1 else {}
    names = ties.reduce(accumulated, module)
    return names, accumulated.get("weight")


@pytest.mark.slow
def test_holders_get_the_sum_of_every_holders_partial_sum() -> None:
    results = distributed.run(3, _sum_over_holders)
    assert {r: status for r, (status, _) in results.items()} == {0: "ok", 1: "ok", 2: "ok"}
    for rank in (0, 2):
        names, total = results[rank][1]
        assert names == {"weight"}
        assert torch.equal(total, torch.full((2, 2), 1.0 + 3.0))
    assert results[1][1] == (set(), None)


GLOO_TEXT = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:41563"


def test_a_holder_that_stopped_is_named_by_rank_and_stage(monkeypatch: pytest.MonkeyPatch) -> None:
    """The all-reduce's own error (gloo's text: an address and port) becomes a ``PeerError``
    naming the other holder, with the backend's reason in a few words."""

    def closed(*args: object, **kwargs: object) -> None:
        raise RuntimeError(GLOO_TEXT)

    tie = Tie(
        ("embed.weight", "head.weight"),
        stages=(0, 2),
        stage_names=("0.weight", "2.weight"),
        stage_ranks=((0,), (3,)),
    )
    module = nn.Sequential(nn.Linear(2, 2))
    with one_rank_group():
        ties = TiedGradients([("0.weight", dist.group.WORLD, tie)], rank=0, timeout=30.0)
        monkeypatch.setattr(dist, "all_reduce", closed)
        with pytest.raises(PeerError) as raised:
            ties.reduce({}, module)
    text = str(raised.value)
    assert text.startswith(
        "rank 0 (stage 0) could not sum the gradient of the tied parameter embed.weight = "
        "head.weight on stages [0, 2] with its fellow holder rank 3 (stage 2): the connection "
        "was closed by rank 3 (stage 2)"
    ), text
    assert "rank 3 (stage 2) has stopped" in text


def test_the_tie_groups_wait_the_pipelines_deadline() -> None:
    with one_rank_group():
        ties = TiedGradients.create([ONE_HOLDER], rank=0, timeout=12.5)
    assert ties.timeout == 12.5 and ties.held[0][2] is ONE_HOLDER


def test_the_per_minibatch_modes_refuse_a_tie_on_replicated_stages_naming_the_front_end() -> None:
    tie = ["wte.weight = head.weight on stages [0, 1]"]
    with pytest.raises(
        ValueError,
        match=r"only without replicated stages \(replicas: \[2, 1\], tied: wte.weight = "
        r"head.weight on stages \[0, 1\]\); use Pipeline\(sync='flush'\)",
    ):
        check_ties(SyncMode.ASYNC, tie, [2, 1], "Pipeline")
    check_ties(SyncMode.ASYNC, tie, [1, 1])
    check_ties(SyncMode.FLUSH, tie, [2, 1])
