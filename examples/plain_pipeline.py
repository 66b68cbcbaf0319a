"""A plain PyTorch loop over pl_pipedream's Pipeline: two stages, flushed 1F1B, on CPU (gloo).

    torchrun --nproc_per_node 2 examples/plain_pipeline.py

Every rank builds the same model and draws the same batches; each keeps and trains only its own
stage. Rank 0 prints the loss of each step (every rank gets the same) and the last line is
``final loss <value>``.
"""

import torch
from torch import nn

from pl_pipedream import Pipeline


def main(steps: int = 20) -> None:
    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    pipeline = Pipeline(
        model,
        nn.functional.mse_loss,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05),
        sync="flush",
        microbatches=4,
        balance=[3, 2],  # layers per stage: one stage per process
    )
    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    target = torch.randn(16, 1, generator=data)
    for step in range(steps):
        inputs = torch.randn(32, 16, generator=data)
        loss = pipeline.train_step((inputs, inputs @ target))
        if pipeline.rank == 0 and step % 5 == 0:
            print(f"step {step} loss {loss.item():.4f}")
    pipeline.close()
    if pipeline.rank == 0:
        print(f"final loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
