"""The Accelerator's ``mixed_precision`` on the pipeline: "no", "bf16", "fp16" map onto the
engine's flags, what cannot run is refused naming the fix, and bf16 on 2 ranks equals one device
under the same autocast."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from pl_pipedream.accelerate import prepare_pipeline
from pl_pipedream.accelerate.precision import carry_scaler, engine_precision
from tests.accelerate.ranks import accelerator_on
from tests.engine.test_pipeline import M, make_batches, make_model, sgd
from tests.engine.test_precision import bf16_one_device
from tests.runtime.distributed import run

# Measured: 0.0 (weights and losses) against one device running the microbatches' backward
# passes one by one under the same autocast; against one backward over the whole batch under
# autocast the weights differ by up to 6.7e-4, against fp32 by 7.6e-4.
BF16_TOLERANCE = 1e-6


def fake(mixed: str, device: str = "cpu", handler: object = None) -> SimpleNamespace:
    return SimpleNamespace(
        mixed_precision=mixed, device=torch.device(device), autocast_handler=handler
    )


def test_the_mixed_precisions_map_onto_the_engines_flags() -> None:
    assert engine_precision(fake("no")) == "32-true"
    assert engine_precision(fake("bf16")) == "bf16-mixed"
    assert engine_precision(fake("fp16", "cuda")) == "16-mixed"


def test_what_cannot_run_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(mixed precision: 'fp16', device: cpu\); use "):
        engine_precision(fake("fp16"))
    with pytest.raises(ValueError, match=r"\(mixed precision: 'fp8'\); use Accelerator\(mixed"):
        engine_precision(fake("fp8"))
    with pytest.raises(ValueError, match=r"without kwargs_handlers=\[AutocastKwargs\(...\)\]"):
        engine_precision(fake("bf16", handler=object()))


def test_the_accelerators_scaler_settings_carry_over() -> None:
    ours = torch.amp.GradScaler("cpu")
    theirs = torch.amp.GradScaler("cpu", init_scale=8.0, growth_interval=3)
    carry_scaler(SimpleNamespace(scaler=theirs), ours)
    assert ours.get_scale() == 8.0 and ours.get_growth_interval() == 3
    carry_scaler(SimpleNamespace(scaler=None), None)  # no loss scale: nothing to carry


def _train_bf16(rank: int, world: int) -> tuple[list[float], dict]:
    accelerator = accelerator_on(rank, world, mixed_precision="bf16")
    model = make_model()
    with prepare_pipeline(
        accelerator, model, sgd, nn.functional.mse_loss, microbatches=M, balance=[3, 3]
    ) as pipeline:
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        return losses, pipeline.state_dict()["model"]


@pytest.mark.slow
def test_bf16_equals_one_device_under_the_same_autocast() -> None:
    results = run(2, _train_bf16, timeout=120.0)
    # one backward pass per microbatch, as Accelerate accumulates, under its autocast
    losses, model = bf16_one_device()
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value[0] == pytest.approx(losses, abs=BF16_TOLERANCE), rank
        merged.update(value[1])
    fp32 = make_model()
    for name, tensor in model.state_dict().items():
        assert merged[name].dtype == torch.float32  # master weights stay fp32
        assert (merged[name] - tensor).abs().max() <= BF16_TOLERANCE, name
    assert any(not torch.equal(merged[n], t) for n, t in fp32.state_dict().items())
