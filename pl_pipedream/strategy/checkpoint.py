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
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.strategy.stage import PipelineSetupError

__all__ = [
    "CheckpointError",
    "ShardedCheckpointHooks",
    "check_layout",
    "consolidate_checkpoint",
    "is_sharded",
    "merge_states",
    "merged_checkpoint",
    "optimizer_states",
    "read_shards",
    "remove",
    "save",
    "shard_name",
    "write_description",
    "write_shard",
]

Shards = tuple[dict[str, Any], list[dict[str, Any]]]  # the description and every stage's dict

META_FILE = "pipeline.json"


class CheckpointError(ValueError):
    """A path that is not a complete PipeDream checkpoint."""


def shard_name(stage: int) -> str:
    return f"stage-{stage:02d}.pt"


def save(
    path: str | Path,
    checkpoint: dict[str, Any],
    rank: int,
    stage: Stage,
    plan: Plan,
    sync: str,
    microbatches: int,
) -> None:
    """Write ``rank``'s part of a checkpoint: its stage's shard if it is the stage's first
    replica, and the description if it is rank 0."""
    if rank == stage.ranks[0]:
        write_shard(path, stage.index, checkpoint)
    if rank == 0:
        write_description(path, sync, microbatches, plan)


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a PipeDream checkpoint's description."""
    return (Path(path) / META_FILE).is_file()


def merged_checkpoint(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Lightning's checkpoint dict: every stage's weights merged, the rest from stage 0."""
    return {**shards[0], "state_dict": merge_states(shard["state_dict"] for shard in shards)}


def optimizer_states(saved: Shards, plan: Plan, stage: int) -> list[dict[str, Any]]:
    """The optimizer states ``stage`` saved, once ``plan`` is checked against the saved one."""
    meta, shards = saved
    check_layout(Plan.from_dict(meta["plan"]), plan)
    return shards[stage]["optimizer_states"]


def write_shard(path: str | Path, stage: int, checkpoint: dict[str, Any]) -> None:
    """Write ``stage``'s checkpoint dict into the checkpoint directory ``path``."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    torch.save(checkpoint, root / shard_name(stage))


def write_description(path: str | Path, sync: str, microbatches: int, plan: Plan) -> None:
    """Write ``pipeline.json``: the plan, the sync mode, the microbatches, the shard files."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": "pl-pipedream sharded checkpoint",
        "sync": str(sync),
        "microbatches": microbatches,
        "plan": plan.to_dict(),
        "shards": [shard_name(s.index) for s in plan.stages],
    }
    (root / META_FILE).write_text(json.dumps(meta, indent=1))


def remove(path: str | Path) -> None:
    """Delete the checkpoint directory ``path`` (what ``ModelCheckpoint`` replaces)."""
    if Path(path).is_dir():
        shutil.rmtree(path)


def merge_states(states: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One ``state_dict`` from the stages' parts (a name's first occurrence wins)."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for name, tensor in state.items():
            merged.setdefault(name, tensor)
    return merged


def check_layout(saved: Plan, plan: Plan) -> None:
    """Raise unless ``plan`` places layers and replicas as the ``saved`` plan did."""
    layout = [(s.nodes, s.replicas) for s in saved.stages]
    if layout != [(s.nodes, s.replicas) for s in plan.stages]:
        raise PipelineSetupError(
            f"a checkpoint resumes only under the plan that saved it (saved: {saved.shape} "
            f"with layers {[list(s.nodes) for s in saved.stages]}, now: {plan.shape} with "
            f"layers {[list(s.nodes) for s in plan.stages]}); resume with "
            f"PipeDreamStrategy(plan=...) from the checkpoint's pipeline.json, or load only "
            "the weights with consolidate_checkpoint()"
        )


def read_shards(path: str | Path) -> Shards:
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
    return merge_states(shard["state_dict"] for shard in shards)


class ShardedCheckpointHooks:
    """The strategy's checkpoint hooks (mixed into ``PipeDreamStrategy`` before Lightning's
    ``ParallelStrategy``): each stage's first replica writes its shard; loading merges the shards
    and keeps them so that each stage restores its own optimizer state."""

    # Set by PipeDreamStrategy; listed for readers and type checkers.
    local_stage: Any
    plan: Plan | None
    sync: Any
    microbatches: int
    global_rank: int
    lightning_module: Any
    optimizers: list[Any]
    _resume: Shards | None

    def drain(self) -> None:
        raise NotImplementedError

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """This stage's state under the LightningModule's names (drains first)."""
        self.drain()
        assert self.local_stage is not None
        return self.local_stage.state_dict(self.lightning_module)

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        assert self.local_stage is not None and self.plan is not None
        stage, rank = self.local_stage.stage, self.global_rank
        save(filepath, checkpoint, rank, stage, self.plan, self.sync, self.microbatches)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        if not is_sharded(checkpoint_path):
            return super().load_checkpoint(checkpoint_path, weights_only)
        self._resume = read_shards(checkpoint_path)
        return merged_checkpoint(self._resume[1])

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        """Each stage takes the optimizer state its own stage saved."""
        if self._resume is None:
            return super().load_optimizer_state_dict(checkpoint)
        assert self.local_stage is not None and self.plan is not None
        states = optimizer_states(self._resume, self.plan, self.local_stage.stage.index)
        for optimizer, state in zip(self.optimizers, states, strict=True):
            optimizer.load_state_dict(state)

    def remove_checkpoint(self, filepath: Any) -> None:
        if self.global_rank == 0:
            remove(filepath)
