"""``prepare_pipeline`` on GPUs under NCCL, as ``accelerate launch --multi_gpu --num_processes 2``
starts it: fp32, bf16 and fp16 (one loss scale for the pipeline) in ``flush`` against one GPU
accumulating the same microbatches under the same autocast and scaler. Needs two GPUs."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream.accelerate import prepare_pipeline
from tests.accelerate.ranks import accelerator_on
from tests.engine.test_pipeline import M, make_batches, make_model, sgd
from tests.runtime.distributed import run

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]

# Not yet measured on GPUs: torch's foreach SGD (its GPU default) may round the last bit
# differently from the single-tensor step the pipeline takes (runtime/update.py).
TOLERANCE = {"no": 1e-6, "bf16": 1e-5, "fp16": 1e-4}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _train(rank: int, world: int, mixed: str) -> tuple[list[float], dict, str]:
    accelerator = accelerator_on(rank, world, cpu=False, mixed_precision=mixed)
    model = make_model()
    with prepare_pipeline(
        accelerator,
        model,
        sgd(model.parameters()),
        nn.functional.mse_loss,
        microbatches=M,
        balance=[3, 3],
    ) as pipeline:
        losses = [pipeline.train_step(batch).item() for batch in make_batches()]
        state = pipeline.state_dict()["model"]
        return losses, state, f"{accelerator.distributed_type}/{pipeline.device}"


def one_gpu(mixed: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = make_model().cuda()
    optimizer = sgd(model.parameters())
    scaler = torch.amp.GradScaler("cuda", enabled=mixed == "fp16")
    losses = []
    for x, y in make_batches():
        optimizer.zero_grad()
        loss = 0.0
        for a, b in zip(x.cuda().chunk(M), y.cuda().chunk(M), strict=True):
            with torch.autocast("cuda", dtype=DTYPES.get(mixed), enabled=mixed in DTYPES):
                microbatch = nn.functional.mse_loss(model(a), b)
            scaler.scale(microbatch / M).backward()
            loss += microbatch.item() / M
        scaler.step(optimizer)
        scaler.update()
        losses.append(loss)
    return losses, {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.parametrize("mixed", ["no", "bf16", "fp16"])
def test_flush_on_two_gpus_equals_one_gpu(mixed: str) -> None:
    results = run(2, _train, mixed, backend="cpu:gloo,cuda:nccl", timeout=240.0)
    losses, weights = one_gpu(mixed)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value[2] == f"DistributedType.MULTI_GPU/cuda:{rank}"
        assert value[0] == pytest.approx(losses, abs=TOLERANCE[mixed]), rank
        merged.update(value[1])
    for name, tensor in weights.items():
        got = merged[name].cpu()
        assert got.dtype == torch.float32
        assert torch.allclose(got, tensor, rtol=0, atol=TOLERANCE[mixed]), name
