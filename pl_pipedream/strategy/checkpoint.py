"""Sharded checkpoints: one file per stage plus a description of the pipeline.

``trainer.save_checkpoint("run.ckpt")`` under ``PipeDreamStrategy`` writes a directory:

```
run.ckpt/
  pipeline.json        the plan, the sync mode, the number of microbatches, the shard files
  stage-00.pt          Lightning's checkpoint dict as stage 0 sees it (its state_dict holds only
  stage-01.pt          stage 0's parameters and buffers, under the LightningModule's names)
```

The first replica of each stage writes that stage's shard; state outside the pipeline (shared
by every rank) goes into stage 0's shard. ``consolidate_checkpoint`` merges the shards back into
the LightningModule's full ``state_dict``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "consolidate_checkpoint", "read_shards", "shard_name"]

META_FILE = "pipeline.json"


class CheckpointError(ValueError):
    """A path that is not a complete PipeDream checkpoint."""


def shard_name(stage: int) -> str:
    return f"stage-{stage:02d}.pt"


def read_shards(path: str | Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The pipeline description and every stage's checkpoint dict, in stage order."""
    root = Path(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        raise CheckpointError(
            f"a PipeDream checkpoint is a directory with {META_FILE} and one shard per stage "
            f"(path: {root}); pass the path given to trainer.save_checkpoint"
        )
    meta = json.loads(meta_path.read_text())
    shards = []
    for stage, name in enumerate(meta["shards"]):
        shard = root / name
        if not shard.is_file():
            raise CheckpointError(
                f"a PipeDream checkpoint needs every stage's shard (missing: {shard}, stage "
                f"{stage}); the rank serving that stage did not finish saving"
            )
        shards.append(torch.load(shard, map_location="cpu", weights_only=False))
    return meta, shards


def consolidate_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The LightningModule's full ``state_dict``, every stage merged under the original names."""
    _, shards = read_shards(path)
    merged: dict[str, torch.Tensor] = {}
    for shard in shards:
        for name, tensor in shard["state_dict"].items():
            merged.setdefault(name, tensor)
    return merged
