"""Sharded checkpoints: one file per stage plus a description of the pipeline, published whole.

``trainer.save_checkpoint("run.ckpt")`` under ``PipeDreamStrategy`` writes a directory:

```
run.ckpt/
  pipeline.json        the plan, the sync mode, the microbatches, the step, and every shard's
                       file name, size and sha256
  stage-00.pt          Lightning's checkpoint dict as stage 0 sees it (its state_dict holds only
  stage-01.pt          stage 0's parameters and buffers, under the LightningModule's names; its
                       optimizer states keyed by those names, ``core.named_state``)
```

The first replica of each stage writes that stage's shard; state outside the pipeline (shared by
every rank) goes into stage 0's shard. A rank holding several stages (the chunked modes,
``interleaved`` and ``zbv``) writes one shard for all of them, named after the last it holds in
pipeline order (``save``'s ``writers``): a chunked checkpoint has one shard per rank. Each shard's
record lists the state names it holds with their shapes, so that a rank reads only the shards that
hold its stage's names. ``consolidate_checkpoint`` merges the shards back into the LightningModule's
full ``state_dict``; ``merged_checkpoint`` merges the optimizer states too, which is what any plan
resumes from, and ``to_lightning`` gives the checkpoint dict one device resumes from.

A save is atomic: the writers (each stage's first replica) write and fsync their shards into a
staging directory beside the target (``.pipedream-partial-<key>-<token>``, a name no reader or
``ModelCheckpoint`` takes for a checkpoint), send rank 0 each shard's size and checksum, and rank
0 writes the description and swaps the staging directory into place (``publish``; the messages
among the writers: ``core.save_exchange``). Until then a checkpoint already at the path is
untouched, and a reader checks every shard against the description, so no reader ever accepts a
half-written shard or a mix of two saves.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from pl_pipedream.core import named_state
from pl_pipedream.core.atomic import (
    RETIRED,
    fsync_dir,
    leftovers,
    publish,
    remove,
    staging_dir,
    write_file,
)
from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.core.save_exchange import SaveExchange
from pl_pipedream.planner.plan import Plan

__all__ = [
    "consolidate_checkpoint",
    "is_keyed_by_name",
    "is_sharded",
    "merge_states",
    "merged_checkpoint",
    "read_description",
    "read_shard",
    "read_shards",
    "remove",
    "save",
    "shard_name",
    "state_shapes",
    "to_lightning",
    "write_description",
    "write_shard",
]

Shards = tuple[dict[str, Any], list[dict[str, Any]]]  # the description and every stage's dict

META_FILE = "pipeline.json"
FORMAT = "pl-pipedream sharded checkpoint"


def shard_name(stage: int) -> str:
    return f"stage-{stage:02d}.pt"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a directory with a PipeDream checkpoint's description."""
    return (Path(path) / META_FILE).is_file()


def merged_checkpoint(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Lightning's checkpoint dict: every stage's weights (and named optimizer states) merged."""
    merged = {**shards[0], "state_dict": merge_states(shard["state_dict"] for shard in shards)}
    if is_keyed_by_name(shards):
        per_optimizer = zip(*(shard.get("optimizer_states", []) for shard in shards), strict=True)
        merged["optimizer_states"] = [named_state.merge(states) for states in per_optimizer]
    return merged


def is_keyed_by_name(shards: list[dict[str, Any]]) -> bool:
    """Whether the optimizer states are keyed by name (``core.named_state``), not position."""
    states = [state for shard in shards for state in shard.get("optimizer_states", [])]
    return all(named_state.is_named(state) for state in states)


def to_lightning(path: str | Path) -> dict[str, Any]:
    """The checkpoint at ``path`` as one Lightning checkpoint dict, which one device resumes
    (``Trainer(strategy="auto").fit(ckpt_path=file)`` once saved): the full ``state_dict``,
    each optimizer's state by position in ``configure_optimizers``' order."""
    _, shards = read_shards(path)
    if not is_keyed_by_name(shards):
        raise CheckpointError(
            f"a checkpoint converts to one device only when its optimizer state is keyed by "
            f"name (path: {path}: keyed by position); resume it once under the plan that "
            "saved it and save again, or load only the weights with consolidate_checkpoint()"
        )
    merged = merged_checkpoint(shards)
    merged["optimizer_states"] = [
        named_state.to_positional(state, [g["params"] for g in state["param_groups"]])
        for state in merged["optimizer_states"]
    ]
    return merged


def write_shard(path: str | Path, stage: int, checkpoint: dict[str, Any]) -> dict[str, Any]:
    """Write and fsync ``stage``'s checkpoint dict into the directory ``path``; return the
    shard's record for the description: its file name, size, sha256 and state shapes."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    data = buffer.getvalue()
    write_file(root / shard_name(stage), data)
    return {
        "file": shard_name(stage),
        "size": len(data),
        "sha256": hashlib.sha256(data).hexdigest(),
        "shapes": {
            name: list(tensor.shape)
            for name, tensor in checkpoint.get("state_dict", {}).items()
            if isinstance(tensor, torch.Tensor)
        },
    }


def write_description(
    path: str | Path,
    sync: str,
    microbatches: int,
    plan: Plan,
    shards: list[dict[str, Any]],
    step: int | None,
) -> None:
    """Write and fsync ``pipeline.json``: the plan, the sync mode, the microbatches, the global
    step, and every shard's record (``write_shard``), in stage order."""
    root = Path(path)
    root.mkdir(parents=True, exist_ok=True)
    meta = {
        "format": FORMAT,
        "sync": str(sync),
        "microbatches": microbatches,
        "step": step,
        "plan": plan.to_dict(),
        "shards": shards,
    }
    write_file(root / META_FILE, json.dumps(meta, indent=1).encode())
    fsync_dir(root)


def merge_states(states: Iterable[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """One ``state_dict`` from the stages' parts (a name's first occurrence wins)."""
    merged: dict[str, torch.Tensor] = {}
    for state in states:
        for name, tensor in state.items():
            merged.setdefault(name, tensor)
    return merged


def read_shards(path: str | Path) -> Shards:
    """The pipeline description and every stage's checkpoint dict, in stage order, each shard
    checked against its record in the description (size, sha256, step)."""
    meta = read_description(path)
    return meta, [read_shard(path, meta, stage) for stage in range(len(meta["shards"]))]


def read_description(path: str | Path) -> dict[str, Any]:
    """The checkpoint's ``pipeline.json``; refused where there is none."""
    root = Path(path)
    meta_path = root / META_FILE
    if not meta_path.is_file():
        retired = [p for p in leftovers(root) if p.name.startswith(RETIRED) and is_sharded(p)]
        hint = (
            f"; a save was interrupted between its two renames and left the previous "
            f"checkpoint at {retired[-1]}: rename it to {root}"
            if retired and not root.exists()
            else ""
        )
        raise CheckpointError(
            f"a PipeDream checkpoint is a directory with {META_FILE} and one shard per stage "
            f"(path: {root}); pass the path given to trainer.save_checkpoint{hint}"
        )
    return json.loads(meta_path.read_text())


def read_shard(path: str | Path, meta: dict[str, Any], stage: int) -> dict[str, Any]:
    """Stage ``stage``'s checkpoint dict, checked against its record in ``meta``."""
    return _read_shard(Path(path), stage, meta["shards"][stage], meta)


def _size_and_digest(path: Path, chunk: int = 1 << 24) -> tuple[int, str]:
    """The file's size and sha256, read in chunks (never the whole file in memory)."""
    digest, size = hashlib.sha256(), 0
    with path.open("rb") as file:
        while block := file.read(chunk):
            digest.update(block)
            size += len(block)
    return size, digest.hexdigest()


def state_shapes(meta: dict[str, Any]) -> list[dict[str, list[int]]] | None:
    """Per shard, the shape of each state name it holds; None for a checkpoint whose records
    do not list them (written before they did)."""
    records = meta["shards"]
    if not all(isinstance(record, dict) and "shapes" in record for record in records):
        return None
    return [record["shapes"] for record in records]


def _read_shard(root: Path, stage: int, record: Any, meta: dict[str, Any]) -> dict[str, Any]:
    """Stage ``stage``'s checkpoint dict, refused unless it is the shard the description
    records (a record is a file name alone in checkpoints older than the records)."""
    name = record["file"] if isinstance(record, dict) else record
    shard = root / name
    if not shard.is_file():
        raise CheckpointError(
            f"a PipeDream checkpoint needs every stage's shard (missing: {shard}, stage "
            f"{stage}); the rank serving that stage did not finish saving: use an earlier "
            "checkpoint"
        )
    if isinstance(record, dict):
        size, digest = _size_and_digest(shard)
        if size != record["size"]:
            raise CheckpointError(
                f"a shard must have the size {META_FILE} records ({shard}: {size} bytes, "
                f"recorded: {record['size']}); the file was cut short or replaced after the "
                "save: use an earlier checkpoint"
            )
        if digest != record["sha256"]:
            raise CheckpointError(
                f"a shard must have the sha256 {META_FILE} records ({shard}: {digest[:16]}..., "
                f"recorded: {record['sha256'][:16]}...); the file was corrupted or replaced "
                "after the save: use an earlier checkpoint"
            )
    # mapped, not read: a tensor takes memory once something reads it (a rank that reads a
    # shard for its loop state never touches the weights it holds)
    checkpoint = torch.load(shard, map_location="cpu", weights_only=False, mmap=True)
    step = meta.get("step")
    if step is not None and checkpoint.get("global_step") != step:
        raise CheckpointError(
            f"every shard must come from the step {META_FILE} records ({shard}: step "
            f"{checkpoint.get('global_step')}, recorded: {step}); the directory mixes two "
            "saves: use an earlier checkpoint"
        )
    return checkpoint


def consolidate_checkpoint(path: str | Path) -> dict[str, torch.Tensor]:
    """The LightningModule's full ``state_dict``, every stage merged under the original names."""
    _, shards = read_shards(path)
    return merge_states(shard["state_dict"] for shard in shards)


def save(
    checkpoint: dict[str, Any],
    filepath: str | Path,
    rank: int,
    plan: Plan,
    sync: str,
    microbatches: int,
    timeout: float,
) -> None:
    """Write this rank's shard if it is its stage's first replica; rank 0 publishes the
    checkpoint once every shard is on disk (``SaveExchange``, ``atomic.publish``). Ranks
    that write nothing return at once; the caller's barrier after the save holds them."""
    writers = {s.ranks[0]: s.index for s in plan.stages}
    if rank not in writers:
        return
    path = Path(filepath)
    exchange = SaveExchange(rank, sorted(writers), timeout, path)
    token = exchange.token()
    staged = staging_dir(path, token)
    record = write_shard(staged, writers[rank], checkpoint)
    records = exchange.records(record, writers)
    if not exchange.leads:
        exchange.outcome()
        return
    try:
        step = checkpoint.get("global_step")
        write_description(staged, sync, microbatches, plan, records, step)
        publish(staged, path, token)
    except OSError as error:
        exchange.outcome(
            f"a checkpoint is published by rank {rank} (path: {path}): "
            f"{error}; free space or fix the permissions of {path.parent}"
        )
        raise
    exchange.outcome()
