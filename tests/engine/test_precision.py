"""``Pipeline(precision=...)``: the flags the engine runs, refused where they cannot run (fp16's
loss scale off CUDA or outside the flushed modes), and bf16 on one rank equals one device under
the same autocast, evaluation included."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline
from pl_pipedream.engine.precision import choose_precision
from pl_pipedream.runtime.precision import StagePrecision
from pl_pipedream.schedule.modes import SyncMode
from tests.engine.test_pipeline import M, make_batches, make_model, sgd
from tests.runtime.distributed import one_rank_group

CPU = torch.device("cpu")


def test_32_true_and_bf16_mixed() -> None:
    plain = choose_precision("32-true", SyncMode.FLUSH, CPU)
    assert plain.scaler is None and plain.stage == StagePrecision()
    bf16 = choose_precision("bf16-mixed", SyncMode.ASYNC, CPU)
    assert bf16.scaler is None and bf16.stage.scale is None
    with bf16.stage.forward():
        assert torch.is_autocast_enabled("cpu")
        assert torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_a_stage_precision_is_taken_as_given_without_a_loss_scale() -> None:
    given = StagePrecision(nullcontext)
    assert choose_precision(given, SyncMode.FLUSH, CPU).stage is given
    with pytest.raises(ValueError, match=r"pass Pipeline\(..., precision='16-mixed'\)"):
        choose_precision(StagePrecision(nullcontext, lambda t: t), SyncMode.FLUSH, CPU)


def test_what_cannot_run_is_refused_naming_the_fix() -> None:
    with pytest.raises(ValueError, match=r"\(precision: '16-mixed', device: cpu\); use "):
        choose_precision("16-mixed", SyncMode.FLUSH, CPU)
    with pytest.raises(ValueError, match=r"\(precision: '16-mixed', sync: async\); use "):
        choose_precision("16-mixed", SyncMode.ASYNC, torch.device("cuda", 0))
    with pytest.raises(ValueError, match=r"\(precision: 'bf16-true'\); for example Pipeline"):
        choose_precision("bf16-true", SyncMode.FLUSH, CPU)


def bf16_one_device() -> tuple[list[float], nn.Module]:
    """One device under ``torch.autocast(bfloat16)`` with each microbatch's backward pass run
    on its own, as every pipeline stage runs them: the losses and the trained model."""
    model = make_model()
    optimizer, expected = sgd(model.parameters()), []
    for x, y in make_batches():
        optimizer.zero_grad()
        loss = 0.0
        for a, b in zip(x.chunk(M), y.chunk(M), strict=True):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                microbatch = nn.functional.mse_loss(model(a), b)
            (microbatch / M).backward()
            loss += microbatch.item() / M
        optimizer.step()
        expected.append(loss)
    return expected, model


def test_bf16_on_one_rank_equals_one_device_under_the_same_autocast() -> None:
    with one_rank_group():
        with Pipeline(
            make_model(),
            nn.functional.mse_loss,
            sgd,
            microbatches=M,
            balance=[6],
            precision="bf16-mixed",
        ) as pipeline:
            losses = [pipeline.train_step(batch).item() for batch in make_batches()]
            x, y = make_batches()[0]
            evaluated = pipeline.eval_step((x, y))
            weights = pipeline.state_dict()["model"]
    expected, model = bf16_one_device()
    assert losses == pytest.approx(expected, abs=1e-6)
    for name, tensor in model.state_dict().items():
        assert torch.allclose(weights[name], tensor, rtol=0, atol=1e-6), name
    x, y = make_batches()[0]
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        reference = nn.functional.mse_loss(model(x), y)
    assert torch.allclose(evaluated, reference, rtol=0, atol=1e-6)
