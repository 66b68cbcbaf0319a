"""Where a rank's work lives: its tensors on its device, its optimizers on its parameters, its
threads on its share of the cores."""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist
from torch import nn

from pl_pipedream.core.placement import (
    bind_to_cpu_share,
    join_process_group,
    keep_local_parameters,
    move_to_device,
    process_group_backend,
    share_threads,
)
from pl_pipedream.runtime.affinity import bind_threads, current_cpus
from tests.runtime.distributed import free_port, one_rank_group, run


def cut_module() -> nn.Module:
    """A module after ``cut_stage``: another stage's layers on ``meta``, this stage's on the CPU."""
    module = nn.Module()
    module.other = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2)).to("meta")
    module.mine = nn.BatchNorm1d(2)
    return module


def test_the_default_group_is_gloo_on_cpu_and_gloo_beside_nccl_on_a_gpu() -> None:
    assert process_group_backend(torch.device("cpu"), None) == "gloo"
    # CPU tensors (a checkpoint's file list, the replicas' loss table) need gloo on a GPU too
    assert process_group_backend(torch.device("cuda", 1), None) == "cpu:gloo,cuda:nccl"
    assert process_group_backend(torch.device("cuda", 0), "nccl") == "nccl"  # given: kept


def test_move_to_device_skips_meta_tensors() -> None:
    module = cut_module()
    weight = module.mine.weight
    move_to_device(module, torch.device("cpu"))  # a meta tensor cannot be copied out: skipped
    assert {t.device.type for t in module.other.state_dict().values()} == {"meta"}
    assert module.mine.weight is weight and weight.device.type == "cpu"


def test_keep_local_parameters_drops_the_other_stages_from_every_group() -> None:
    module = cut_module()
    module.scale = nn.Parameter(torch.ones(1))  # outside the pipeline: kept
    optimizers = [
        torch.optim.SGD(
            [
                {"params": [module.other[0].weight, module.scale, module.other[1].bias]},
                {"params": list(module.mine.parameters()), "lr": 0.5},
            ],
            lr=0.1,
        ),
        torch.optim.Adam(module.other[0].parameters()),
    ]
    keep_local_parameters(module, optimizers)
    first, second = optimizers[0].param_groups
    assert first["params"] == [module.scale]
    assert second["params"] == list(module.mine.parameters()) and second["lr"] == 0.5
    assert optimizers[1].param_groups[0]["params"] == []


needs_two_cores = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process that may run on 2 cores",
)


def test_a_lone_rank_is_left_where_it_is() -> None:
    before = current_cpus()
    with one_rank_group():
        assert bind_to_cpu_share(0, 1, range(1)) is None
    assert current_cpus() == before


def _bind(rank: int, world: int) -> dict:
    pool = current_cpus()
    assert pool is not None
    out: dict = {"pool": sorted(pool)}
    bind_threads(frozenset([sorted(pool)[rank]]))  # as a launcher that placed each rank would
    out["placed by the launcher"] = bind_to_cpu_share(rank, world, range(world))
    bind_threads(pool)
    bound = bind_to_cpu_share(rank, world, range(world))
    out["bound"] = None if bound is None else (sorted(bound[0]), sorted(bound[1]))
    out["threads"] = [sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")]
    bind_threads(pool)  # what teardown does
    out["restored"] = sorted(current_cpus() or ())
    return out


@pytest.mark.slow  # two processes that import Lightning: about 5 s
@needs_two_cores
def test_ranks_on_one_node_are_bound_to_their_share_of_the_cores() -> None:
    results = run(2, _bind, timeout=60.0)
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        pool = value["pool"]
        share = pool[rank * (len(pool) // 2) : (rank + 1) * (len(pool) // 2)]
        assert value["placed by the launcher"] is None
        assert value["bound"] == (pool, share)
        assert all(cpus == share for cpus in value["threads"])
        assert value["restored"] == pool


def test_join_process_group_joins_once_from_the_address_port_rank_and_world() -> None:
    assert not dist.is_initialized()
    before = dict(os.environ)
    try:
        join_process_group("127.0.0.1", free_port(), 0, 1, "gloo", timedelta(seconds=30))
        assert (dist.get_rank(), dist.get_world_size(), dist.get_backend()) == (0, 1, "gloo")
        join_process_group("127.0.0.1", free_port(), 0, 1, "gloo", timedelta(seconds=30))  # no-op
        assert dict(os.environ) == before  # no MASTER_ADDR / MASTER_PORT written
    finally:
        dist.destroy_process_group()


def test_share_threads_splits_the_cores_unless_omp_num_threads_is_set(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    threads = torch.get_num_threads()
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("OMP_NUM_THREADS")  # recorded, so that the value written below goes too
    try:
        share_threads(2)
        expected = max(1, len(current_cpus() or range(os.cpu_count() or 1)) // 2)
        assert os.environ["OMP_NUM_THREADS"] == str(expected) == str(torch.get_num_threads())
        monkeypatch.setenv("OMP_NUM_THREADS", "7")
        share_threads(2)
        assert os.environ["OMP_NUM_THREADS"] == "7"  # the user's setting stays
    finally:
        torch.set_num_threads(threads)
