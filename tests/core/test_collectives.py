"""The collectives Lightning asks the strategy for: reduce ops by type, the group honoured."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pl_pipedream.core.collectives import barrier, broadcast, reduce, reduce_op_of
from tests.runtime.distributed import one_rank_group, run

SUM, MAX, MIN, AVG = dist.ReduceOp.SUM, dist.ReduceOp.MAX, dist.ReduceOp.MIN, dist.ReduceOp.AVG


@pytest.mark.parametrize(
    ("reduce_op", "expected"),
    [
        ("mean", (SUM, True)),
        ("avg", (SUM, True)),
        ("MEAN", (SUM, True)),
        ("sum", (SUM, False)),
        ("max", (MAX, False)),
        ("min", (MIN, False)),
        (None, (SUM, False)),
        (SUM, (SUM, False)),
        (MAX, (MAX, False)),
        (AVG, (SUM, True)),  # gloo has no AVG: sum, then divide
    ],
)
def test_reduce_op_of(reduce_op: object, expected: tuple) -> None:
    assert reduce_op_of(reduce_op) == expected


def test_an_unknown_reduce_op_names_the_choices() -> None:
    with pytest.raises(ValueError, match=r"one of 'sum', 'mean', .* \(reduce_op: 'median'\)"):
        reduce_op_of("median")


def test_without_a_process_group_everything_comes_back_as_is() -> None:
    assert not dist.is_initialized()
    tensor = torch.ones(2)
    assert reduce(tensor) is tensor
    assert broadcast({"a": 1}) == {"a": 1}
    barrier()


def test_in_a_group_reduce_returns_a_copy_and_leaves_other_values() -> None:
    tensor = torch.tensor([1.0, 2.0])
    with one_rank_group():
        reduced = reduce(tensor, reduce_op="sum")
        assert reduce("text") == "text" and reduce(3.0) == 3.0
        assert broadcast(["object"], src=0) == ["object"]
        barrier()
    assert reduced is not tensor and torch.equal(reduced, tensor)


def _collectives(rank: int, world: int) -> dict:
    value = torch.tensor([float(rank + 1)])  # 1 on rank 0, 2 on rank 1
    alone = [dist.new_group([r]) for r in range(world)]  # every rank makes every group
    out = {op: reduce(value, reduce_op=op).item() for op in ("mean", "sum", "max", "min", "avg")}
    out["AVG"] = reduce(value, reduce_op=AVG).item()
    out["SUM"] = reduce(value, reduce_op=SUM).item()
    out["own group mean"] = reduce(value, group=alone[rank], reduce_op="mean").item()
    out["unchanged"] = value.item()
    out["broadcast"] = broadcast({"from": rank}, src=1)
    barrier()
    return out


@pytest.mark.slow  # two processes that import Lightning: about 5 s
def test_reduce_and_broadcast_over_two_ranks() -> None:
    results = run(2, _collectives, timeout=60.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value == {
            "mean": 1.5,
            "sum": 3.0,
            "max": 2.0,
            "min": 1.0,
            "avg": 1.5,
            "AVG": 1.5,
            "SUM": 3.0,
            "own group mean": float(rank + 1),
            "unchanged": float(rank + 1),
            "broadcast": {"from": 1},
        }
