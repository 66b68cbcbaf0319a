"""``accelerator.save_state(dir)`` / ``load_state(dir)`` with a pipeline, through Accelerate's
state hooks (``register_save_state_pre_hook`` / ``register_load_state_pre_hook``).

The pipeline is not one of the Accelerator's prepared models, so Accelerate saves only what it
owns (RNG states, prepared optimizers, schedulers, data loaders, its step). The hooks, which
Accelerate calls on every process before it writes, add the pipeline in the project's sharded
format: ``Pipeline.save`` into ``<dir>/pipeline`` (one shard per stage, ``docs/checkpoints.md``;
``pl_pipedream.consolidate_checkpoint`` gives the whole model back for one device) and, under
fp16, the loss scale beside it. ``load_state`` resumes it under any plan over the same layers.
A pipeline once closed is no longer saved or loaded: its hooks do nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pl_pipedream.engine import Pipeline

__all__ = ["PIPELINE", "SCALER", "register"]

PIPELINE = "pipeline"  # the sharded checkpoint's directory inside Accelerate's
SCALER = "pipeline_scaler.pt"  # the pipeline's loss scale (fp16), one file


def register(accelerator: Any, pipeline: Pipeline) -> tuple[Any, Any]:
    """Register the pipeline's save and load hooks; returns their removable handles."""

    def save(models: list[Any], weights: list[Any], output_dir: str) -> None:
        if pipeline.runner is None:
            return  # closed: a later pipeline of the same Accelerator saves in its place
        pipeline.save(Path(output_dir) / PIPELINE)  # every rank: a barrier when it returns
        if pipeline.scaler is not None and pipeline.rank == 0:
            torch.save(pipeline.scaler.state_dict(), Path(output_dir) / SCALER)

    def load(models: list[Any], input_dir: str) -> None:
        if pipeline.runner is None:
            return
        pipeline.load(Path(input_dir) / PIPELINE)
        scale = Path(input_dir) / SCALER
        if pipeline.scaler is not None and scale.exists():  # saved under fp16
            pipeline.scaler.load_state_dict(torch.load(scale))

    return (
        accelerator.register_save_state_pre_hook(save),
        accelerator.register_load_state_pre_hook(load),
    )
