"""An Accelerate training loop over pl_pipedream's pipeline: two stages, flushed 1F1B, on CPU.

    ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 \
        examples/accelerate_pipeline.py
    accelerate launch --multi_gpu --num_processes 2 --mixed_precision bf16 \
        examples/accelerate_pipeline.py

(``accelerate launch --cpu --num_processes 2`` starts one process: docs/accelerate.md.)
Accelerate starts the processes and their process group (gloo on CPUs, NCCL on GPUs); every
process builds the same model and draws the same batches, and ``prepare_pipeline`` keeps only
its own stage. The loop calls ``pipeline.train_step(batch)``, which runs the forward and
backward passes and the optimizer's step. Halfway it saves with ``accelerator.save_state`` and
reloads with ``load_state``. The main process prints the loss every 5 steps (every process gets
the same) and last ``final loss <value>`` (below 2.0 after 20 steps).
"""

import argparse
import tempfile

import torch
from accelerate import Accelerator
from torch import nn

from pl_pipedream.accelerate import prepare_pipeline


def main(steps: int = 20, mixed_precision: str = "no") -> None:
    accelerator = Accelerator(mixed_precision=mixed_precision)
    torch.manual_seed(0)  # the same model on every process
    model = nn.Sequential(
        nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    pipeline = prepare_pipeline(
        accelerator,
        model,
        optimizer,
        nn.functional.mse_loss,
        sync="flush",
        microbatches=4,
        balance=[3, 2],  # layers per stage: one stage per process
    )
    data = torch.Generator().manual_seed(1)  # the same batches on every process
    target = torch.randn(16, 1, generator=data)
    with tempfile.TemporaryDirectory() as scratch:
        for step in range(steps):
            inputs = torch.randn(32, 16, generator=data)
            loss = pipeline.train_step((inputs, inputs @ target))
            if step % 5 == 0:
                accelerator.print(f"step {step} loss {loss.item():.4f}")
            if step == steps // 2:
                checkpoint = accelerator.gather_for_metrics([scratch])[0]  # rank 0's directory
                accelerator.save_state(checkpoint)  # the pipeline's shards, through its hooks
                accelerator.load_state(checkpoint)
        accelerator.wait_for_everyone()
    pipeline.close()
    accelerator.print(f"final loss {loss.item():.6f}")
    accelerator.end_training()


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--mixed_precision", default="no", choices=["no", "bf16", "fp16"])
    arguments = parser.parse_args()
    main(arguments.steps, arguments.mixed_precision)
