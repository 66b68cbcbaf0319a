"""``Pipeline.replan`` on one CUDA device: two ranks sharing the GPU over gloo switch plans in
the middle of a flushed run and equal one device on the GPU; the moved tensors land on the GPU
and Adam's ``step`` stays on the CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.planner.plan import Plan
from tests.engine.test_replan import SWITCH, adam, batches, tied_model
from tests.runtime.distributed import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

M = 2
TOLERANCE = 1e-5  # the GPU's sums run in another order than one device's


def _switch(rank: int, world: int) -> dict:
    with Pipeline(
        tied_model(), nn.functional.mse_loss, adam, microbatches=M,
        plan=Plan.from_balance([3, 3]), device="cuda:0",
    ) as p:  # fmt: skip
        losses = [p.train_step(batch).item() for batch in batches()[:SWITCH]]
        p.replan(Plan.from_balance([1, 5]))
        assert p.optimizer is not None
        steps = {s["step"].device.type for s in p.optimizer.state.values()}
        devices = {t.device.type for t in p.module.state_dict().values()}
        losses += [p.train_step(batch).item() for batch in batches()[SWITCH:]]
        weights = {k: v.cpu() for k, v in p.state_dict()["model"].items()}
        return {"losses": losses, "model": weights, "steps": steps, "devices": devices}


@pytest.mark.gpu
def test_a_switch_on_the_gpu_equals_one_device() -> None:
    results = run(2, _switch, timeout=180.0)
    model = tied_model().cuda()
    optimizer = adam(model.parameters())
    losses = []
    for x, y in batches():
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x.cuda()), y.cuda())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value["steps"] == {"cpu"} and value["devices"] == {"cuda"}, rank
        assert value["losses"] == pytest.approx(losses, abs=TOLERANCE), rank
        merged.update(value["model"])
    for name, expected in model.state_dict().items():
        assert torch.allclose(merged[name], expected.cpu(), rtol=0, atol=TOLERANCE), name
