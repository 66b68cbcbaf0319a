"""Placement on a GPU: this stage's parameters and buffers move, other stages' stay on ``meta``;
skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from pl_pipedream.core.placement import move_to_device, process_group_backend
from pl_pipedream.runtime.channel import Channel
from tests.core.test_placement import cut_module
from tests.runtime.distributed import free_port

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
def test_move_to_device_moves_parameters_in_place_and_buffers() -> None:
    module = cut_module()
    weight = module.mine.weight
    optimizer = torch.optim.SGD(module.mine.parameters(), lr=0.1)
    move_to_device(module, torch.device("cuda", 0))
    assert module.mine.weight is weight  # the optimizer keeps stepping the same parameter
    assert optimizer.param_groups[0]["params"][0] is weight
    assert weight.device.type == "cuda"
    assert module.mine.running_mean.device.type == "cuda"
    assert module.mine.num_batches_tracked.device.type == "cuda"
    assert {t.device.type for t in module.other.state_dict().values()} == {"meta"}


@pytest.mark.gpu
def test_the_gpu_default_group_reduces_cpu_and_gpu_tensors_and_the_channel_uses_nccl() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    backend = process_group_backend(device, None)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        on_cpu, on_gpu = torch.tensor([2.0, -1.0]), torch.tensor([3.0], device=device)
        dist.all_reduce(on_cpu)  # refused by a group that is NCCL alone
        dist.all_reduce(on_gpu)
        assert on_cpu.tolist() == [2.0, -1.0] and on_gpu.item() == 3.0
        group = dist.new_group([0])  # later groups inherit the pair
        dist.all_reduce(on_cpu, group=group)
        assert Channel(0, device, group=group)._wire == device  # frames travel on the GPU
        assert Channel(0, torch.device("cpu"), group=group)._wire.type == "cpu"
    finally:
        dist.destroy_process_group()
