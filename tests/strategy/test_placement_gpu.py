"""Placement on a GPU: this stage's parameters and buffers move, other stages' stay on ``meta``;
skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch

from pl_pipedream.strategy.placement import move_to_device
from tests.strategy.test_placement import cut_module

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
