"""One loss scale for the pipeline: ``unscale_`` agrees across the ranks (here a one-rank
group; two ranks in tests/strategy/test_precision.py) and ``found_inf`` reads the flag."""

from __future__ import annotations

import torch

from pl_pipedream.core.precision import found_inf, share_found_inf
from tests.runtime.distributed import one_rank_group


def test_found_inf_reads_the_agreed_flag() -> None:
    with one_rank_group():
        scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
        scaler.scale(torch.zeros(()))
        share_found_inf(scaler, torch.device("cpu"))
        layer = torch.nn.Linear(2, 1)
        optimizer = torch.optim.SGD(layer.parameters(), lr=0.1)
        for value, found in ((1.0, False), (float("inf"), True)):
            layer.weight.grad = torch.full_like(layer.weight, value)
            layer.bias.grad = torch.zeros_like(layer.bias)
            scaler.unscale_(optimizer)
            assert found_inf(scaler, optimizer) is found
            scaler.update()
        assert scaler.get_scale() == 2.0  # backed off once
