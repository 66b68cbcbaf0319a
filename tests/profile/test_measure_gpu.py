"""profile_layers on a CUDA device; skipped without one."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from pl_pipedream.profile.measure import profile_layers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 16, 3), nn.BatchNorm2d(16), nn.ReLU(), nn.Flatten())


def test_model_on_cuda_is_measured_there() -> None:
    layers = model().cuda()
    result = profile_layers(layers, torch.randn(4, 3, 10, 10, device="cuda"))
    assert result.meta["device"] == f"cuda:{torch.cuda.current_device()}"
    assert result.nodes[0].activation_bytes == (4 * 16 * 8 * 8 * 4.0,)
    assert result.nodes[0].parameter_bytes == (3 * 16 * 9 + 16) * 4.0
    for node in result.nodes[:3]:
        assert math.isfinite(node.forward_ms) and node.forward_ms > 0
        assert math.isfinite(node.backward_ms) and node.backward_ms > 0
    assert all(p.grad is None for p in layers.parameters())


def test_cpu_model_measured_on_cuda_stays_on_cpu_unchanged() -> None:
    layers = model()
    state = {k: v.clone() for k, v in layers.state_dict().items()}
    result = profile_layers(layers, torch.randn(4, 3, 10, 10), device="cuda")
    assert result.meta["device"].startswith("cuda")
    assert all(p.device.type == "cpu" for p in layers.parameters())
    assert all(torch.equal(state[k], v) for k, v in layers.state_dict().items())
