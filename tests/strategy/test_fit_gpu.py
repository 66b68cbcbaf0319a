"""The same end-to-end check on GPUs: two ranks on two GPUs (NCCL), or every rank sharing the one
GPU there is (gloo); skipped without a CUDA device."""

from __future__ import annotations

import json

import pytest
import torch

from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model
from tests.strategy.test_fit import launch

needs_two_gpus = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA devices (NCCL, one GPU per rank)"
)
needs_a_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
MODES = ["async", "vertical_sync", "2bw", "flush", "gpipe"]


def check_against_the_oracle(tmp_path, balance, m, sync) -> float:  # type: ignore[no-untyped-def]
    """The largest difference of the consolidated weights to the oracle's, at most 1e-4."""
    out = tmp_path / f"{sync}-sgd"
    assert json.loads((out / "done.json").read_text())["global_step"] == 5
    got = torch.load(out / "weights.pt")
    expected = oracle.train(
        make_model(),
        Plan.from_balance(balance),
        sync,
        make_batches(m),
        m,
        loss_fn,
        OPTIMIZERS["sgd"],
    )
    largest = 0.0
    for key, tensor in expected.items():
        diff = (got[f"net.{key}"] - tensor).abs().max().item()
        assert diff <= 1e-4, f"{sync} {key}: {diff}"
        largest = max(largest, diff)
    return largest


@pytest.mark.gpu
@needs_a_gpu
def test_three_ranks_sharing_one_gpu_equal_the_oracle_in_every_mode(  # type: ignore[no-untyped-def]
    tmp_path, record_property
) -> None:
    configs = [f"{sync}:sgd" for sync in MODES]  # 2bw wants as many microbatches as stages
    result = launch(
        tmp_path, [2, 2, 2], None, 3, configs, accelerator="gpu", extra=["--share-device"]
    )
    assert result.returncode == 0, result.stderr[-3000:]
    for sync in MODES:
        record_property(sync, check_against_the_oracle(tmp_path, [2, 2, 2], 3, sync))


@pytest.mark.gpu
@needs_two_gpus
@pytest.mark.parametrize("sync", ["async", "flush"])
def test_two_gpus_equal_the_oracle(tmp_path, sync: str) -> None:
    result = launch(tmp_path, [3, 3], None, 2, [f"{sync}:sgd"], accelerator="gpu")
    assert result.returncode == 0, result.stderr[-3000:]
    check_against_the_oracle(tmp_path, [3, 3], 2, sync)
