"""The same end-to-end check on GPUs (NCCL, one GPU per rank); skipped without two GPUs."""

from __future__ import annotations

import json

import pytest
import torch

from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model
from tests.strategy.test_fit import launch

pytestmark = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, one GPU per rank)"
)


@pytest.mark.gpu
@pytest.mark.parametrize("sync", ["async", "flush"])
def test_two_gpus_equal_the_oracle(tmp_path, sync: str) -> None:
    result = launch(tmp_path, [3, 3], None, 2, [f"{sync}:sgd"], accelerator="gpu")
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / f"{sync}-sgd"
    assert json.loads((out / "done.json").read_text())["global_step"] == 5
    got = torch.load(out / "weights.pt")
    expected = oracle.train(
        make_model(),
        Plan.from_balance([3, 3]),
        sync,
        make_batches(2),
        2,
        loss_fn,
        OPTIMIZERS["sgd"],
    )
    for key, tensor in expected.items():
        assert (got[f"net.{key}"] - tensor).abs().max().item() <= 1e-4
