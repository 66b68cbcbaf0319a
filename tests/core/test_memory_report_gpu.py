"""The GPU paths of memory per stage: free memory for the planner, the allocator's peak, the
device generator for a replay; skipped without a CUDA device."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.core.memory_limit import device_memory
from pl_pipedream.core.memory_report import measure
from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.recompute import Activations, Replay, rng_state
from pl_pipedream.schedule.modes import SyncMode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
def test_the_planner_gets_the_free_memory_of_the_gpu_unless_memory_is_given() -> None:
    device = torch.device("cuda", 0)
    free, total = torch.cuda.mem_get_info(device)
    got = device_memory(device, None)
    assert got is not None and 0 < got <= total
    assert abs(got - free) <= 0.05 * total  # other processes may allocate meanwhile
    assert device_memory(device, 1234.0) == 1234.0


@pytest.mark.gpu
def test_the_report_takes_the_allocators_peak_and_a_replay_the_gpus_draws() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.reset_peak_memory_stats(device)
    module = nn.Sequential(nn.Linear(256, 256), nn.Dropout(0.5)).to(device)
    params = {n: p.detach().requires_grad_(True) for n, p in module.named_parameters()}
    x = torch.randn(64, 256, device=device)
    meter = Activations(True, device)
    state = rng_state(device)
    assert state[1] is not None  # the GPU's generator is saved too
    with meter.forward(0, x, params.values(), drop=True):
        first = torch.func.functional_call(module, params, (x,))
    again = meter.replay(0, Replay(x, state), module, params)
    assert torch.equal(again, first.detach())

    plan = Plan.from_balance([2])
    peak, recompute = meter.peak_bytes, meter.recompute
    row = measure(0, plan, module, 0, peak, [], device, SyncMode.ASYNC, 1, recompute=recompute)
    assert row.device_peak is not None and row.device_peak >= torch.cuda.memory_allocated(device)
