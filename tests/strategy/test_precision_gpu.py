"""Mixed precision through the pipeline on CUDA, against one GPU; skipped without one.

Two ranks on two GPUs (NCCL), or both on the one GPU there is (gloo). ``16-mixed`` is CUDA's
main use of a loss scale: one scale for the pipeline, whose history equals one device's
accumulating the same microbatches, step by step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.strategy.test_precision import (
    RecordScale,
    fit_and_validate,
    fp16_plugin,
    largest_difference,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

TOLERANCE = 1e-5  # on one H100 the pipeline was bit-identical to one GPU (docs/precision.md)


@pytest.mark.gpu
@pytest.mark.parametrize("microbatches", [1, 2])
def test_cuda_bf16_mixed_flush_equals_one_gpu(
    tmp_path: Path, microbatches: int, record_property
) -> None:
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    reference, reference_val = fit_and_validate(
        one, "bf16-mixed", accumulate=microbatches, gpu=True
    )
    fp32, _ = fit_and_validate(tmp_path / "fp32", "32-true", accumulate=microbatches, gpu=True)
    got, val = fit_and_validate(
        pipe, "bf16-mixed", gpu=True, sync="flush", microbatches=microbatches
    )
    record_property("difference_to_one_gpu", largest_difference(got, reference))
    record_property("validation_difference", abs(val - reference_val))
    record_property("difference_to_fp32", largest_difference(got, fp32))
    assert largest_difference(got, reference) <= TOLERANCE
    assert abs(val - reference_val) <= TOLERANCE
    assert largest_difference(got, fp32) > 1e-4


@pytest.mark.gpu
@pytest.mark.parametrize("microbatches", [1, 2])
def test_cuda_16_mixed_has_one_loss_scale_that_evolves_as_one_gpus(
    tmp_path: Path, microbatches: int, record_property
) -> None:
    one, pipe = tmp_path / "one", tmp_path / "pipe"
    reference, _ = fit_and_validate(
        one,
        plugins=[fp16_plugin("cuda")],
        extra_callbacks=[RecordScale(one)],
        accumulate=microbatches,
        gpu=True,
    )
    got, _ = fit_and_validate(
        pipe,
        plugins=[fp16_plugin("cuda")],
        extra_callbacks=[RecordScale(pipe)],
        gpu=True,
        sync="flush",
        microbatches=microbatches,
    )
    expected = json.loads((one / "scale-rank0.json").read_text())[microbatches - 1 :: microbatches]
    record_property("scales", expected)
    record_property("difference_to_one_gpu", largest_difference(got, reference))
    for rank in (0, 1):
        assert json.loads((pipe / f"scale-rank{rank}.json").read_text()) == expected
    assert largest_difference(got, reference) <= TOLERANCE
    assert all(t.dtype == torch.float32 for t in got.values())
