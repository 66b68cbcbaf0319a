"""The engine's precisions on one CUDA device, against one device running the same microbatches
under the same autocast (and ``torch.amp.GradScaler`` for fp16); skipped without CUDA.

One rank, and two ranks sharing the GPU over gloo; the chunked modes (``zbv``, ``interleaved``)
with several stages per rank, a whole pipeline on one rank too. On one H100 (torch 2.11) every
case gave the same weights as one device to the last bit, losses within 6e-8 (docs/engine.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from pl_pipedream import Pipeline
from tests.runtime.distributed import run

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

M = 4
TOLERANCE = 1e-6
DTYPES = {"bf16-mixed": torch.bfloat16, "16-mixed": torch.float16}


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 256), nn.Tanh(), nn.Linear(256, 256), nn.Tanh(), nn.Linear(256, 8)
    )


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    generator = torch.Generator().manual_seed(1)
    return [
        (torch.randn(32, 64, generator=generator), torch.randn(32, 8, generator=generator))
        for _ in range(6)
    ]


def sgd(params):  # type: ignore[no-untyped-def]
    return torch.optim.SGD(params, lr=0.05)


CHUNKED = {("zbv", 1): [3, 2], ("zbv", 2): [2, 1, 1, 1], ("interleaved", 1): [2, 1, 1, 1]}


def _train(rank: int, world: int, precision: str, sync: str) -> tuple[list[float], dict]:
    balance = CHUNKED.get((sync, world), [2, 1, 1, 1] if sync == "interleaved" else None)
    balance = balance or ([3, 2] if world == 2 else [5])
    with Pipeline(
        model(), nn.functional.mse_loss, sgd, sync=sync, microbatches=M, balance=balance,
        device="cuda:0", precision=precision,
    ) as pipeline:  # fmt: skip
        losses = [pipeline.train_step(batch).item() for batch in batches()]
        return losses, {k: v.cpu() for k, v in pipeline.state_dict()["model"].items()}


def one_device(precision: str) -> tuple[list[float], dict]:
    net = model().cuda()
    optimizer = sgd(net.parameters())
    scaler = torch.amp.GradScaler("cuda") if precision == "16-mixed" else None
    dtype = DTYPES.get(precision)
    losses = []
    for x, y in batches():
        x, y = x.cuda(), y.cuda()
        optimizer.zero_grad()
        total = 0.0
        for a, b in zip(x.chunk(M), y.chunk(M), strict=True):
            with torch.autocast("cuda", dtype=dtype or torch.float32, enabled=dtype is not None):
                loss = nn.functional.mse_loss(net(a), b)
            (scaler.scale(loss / M) if scaler else loss / M).backward()
            total += loss.item() / M
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
        losses.append(total)
    return losses, {k: v.cpu() for k, v in net.state_dict().items()}


@pytest.mark.gpu
@pytest.mark.parametrize("world", [1, 2], ids=["one rank", "two ranks sharing the GPU"])
@pytest.mark.parametrize(
    ("precision", "sync"),
    [
        ("32-true", "flush"),
        ("bf16-mixed", "flush"),
        ("16-mixed", "flush"),
        ("16-mixed", "gpipe"),
        ("16-mixed", "zero_bubble"),
        ("32-true", "zbv"),
        ("16-mixed", "zbv"),
        ("bf16-mixed", "interleaved"),
    ],
)
def test_the_flushed_pipeline_equals_one_gpu(precision: str, sync: str, world: int) -> None:
    losses, weights = one_device(precision)  # first: CUDA is up here, so the ranks are spawned
    results = run(world, _train, precision, sync, timeout=180.0)
    merged: dict[str, torch.Tensor] = {}
    for rank, (status, value) in results.items():
        assert status == "ok", f"rank {rank}: {value}"
        assert value[0] == pytest.approx(losses, abs=TOLERANCE), rank
        merged.update(value[1])
    for name, tensor in weights.items():
        assert torch.allclose(merged[name], tensor, rtol=0, atol=TOLERANCE), name
