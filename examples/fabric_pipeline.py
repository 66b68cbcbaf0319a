"""A Lightning Fabric loop over pl_pipedream's pipeline: two stages, flushed 1F1B, on CPU (gloo).

    python examples/fabric_pipeline.py

``fabric.launch()`` starts the second rank (it runs this script again). Every rank builds the
same model and draws the same batches; each keeps and trains only its own stage. Rank 0 prints
the loss of every fifth step (every rank gets the same), logs each step's loss to
``lightning_logs/fabric_pipeline`` (CSV), the ranks save the sharded checkpoint
``lightning_logs/fabric_pipeline.ckpt``, and the last line is ``final loss <value>``.
"""

import torch
from lightning.fabric import Fabric
from lightning.fabric.loggers import CSVLogger
from torch import nn

from pl_pipedream.fabric import PipeDreamFabricStrategy


def main(steps: int = 20) -> None:
    strategy = PipeDreamFabricStrategy(
        loss_fn=nn.functional.mse_loss,  # loss_fn(output, targets), on the last stage
        sync="flush",  # flush | gpipe | 2bw | async | vertical_sync
        microbatches=4,
        balance=[3, 2],  # layers per stage: one stage per process
    )
    logger = CSVLogger("lightning_logs", name="fabric_pipeline")
    fabric = Fabric(strategy=strategy, accelerator="cpu", devices=2, loggers=logger)
    fabric.launch()

    torch.manual_seed(0)  # the same model on every rank
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    model, optimizer = fabric.setup(model, optimizer)  # each rank keeps its stage

    data = torch.Generator().manual_seed(1)  # the same batches on every rank
    target = torch.randn(16, 1, generator=data)
    for step in range(steps):
        inputs = torch.randn(32, 16, generator=data)
        loss = model((inputs, inputs @ target))  # the whole schedule for one batch
        fabric.backward(loss)  # accepted: the backward passes ran inside the schedule
        optimizer.step()  # confirms the update the schedule applied
        optimizer.zero_grad()
        fabric.log("train_loss", loss, step=step)  # the same loss on every rank: rank 0 logs
        if step % 5 == 0:
            fabric.print(f"step {step} loss {loss.item():.4f}")

    state = {"model": model, "optimizer": optimizer, "step": steps}
    fabric.save("lightning_logs/fabric_pipeline.ckpt", state)  # one shard per stage
    fabric.strategy.teardown()  # closes the pipeline
    logger.finalize("success")
    fabric.print(f"final loss {loss.item():.6f}")


if __name__ == "__main__":
    main()
