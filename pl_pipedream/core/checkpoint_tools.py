"""What ``pl-pipedream checkpoint`` does: describe a sharded checkpoint, write it as one plain
state dict or as one Lightning checkpoint file, and make one from a plain state dict.

Every read and write goes through the format's own functions (``core.checkpoint``: the shards
checked against ``pipeline.json``'s sha256 records; ``core.atomic``: the staged, fsynced, swapped
publish), so that the command and ``trainer.save_checkpoint`` cannot drift apart. A checkpoint
made from a plain state dict is what a one-stage pipeline on one worker would save at step 0
(``flush``, one microbatch): a Lightning checkpoint dict in ``stage-00.pt`` holding every name,
with no optimizer, scheduler or loop state, so that a fit resumed from it starts fresh from
those weights.
"""

from __future__ import annotations

import os
import secrets
from importlib import metadata
from pathlib import Path
from typing import Any

import torch

from pl_pipedream.core.atomic import publish, staging_dir
from pl_pipedream.core.checkpoint import (
    META_FILE,
    consolidate_checkpoint,
    is_sharded,
    read_shards,
    to_lightning,
    write_description,
    write_shard,
)
from pl_pipedream.core.errors import CheckpointError
from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule.modes import SyncMode

__all__ = [
    "describe",
    "from_torch",
    "read_state_dict",
    "require_checkpoint",
    "to_lightning_file",
    "to_torch",
]

FROM_TORCH_SYNC = SyncMode.FLUSH  # a one-stage flush pipeline trains as one device does


def require_checkpoint(path: str | Path) -> Path:
    """``path`` as a ``Path``, refused with the fix when it is a file or missing (a directory
    without a description is refused by ``read_shards``, which names a retired save)."""
    root = Path(path)
    if root.is_file():
        raise CheckpointError(
            f"a PipeDream checkpoint is a directory with {META_FILE}, not a file (path: {root}); "
            f"a plain state dict or a Lightning .ckpt file converts with "
            f"'pl-pipedream checkpoint from-torch {root} OUT'"
        )
    if not root.exists() and not root.parent.is_dir():
        raise CheckpointError(
            f"a PipeDream checkpoint is a directory with {META_FILE} (path: {root}, no such "
            "directory); pass the path given to trainer.save_checkpoint"
        )
    return root


def describe(path: str | Path) -> str:
    """The checkpoint as text: step, sync mode, microbatches, the saving plan, every shard file
    with its size, every name with its shape, dtype and stage, and stage 0's other entries."""
    root = require_checkpoint(path)
    meta, shards = read_shards(root)
    plan = Plan.from_dict(meta["plan"])
    lines = [
        f"checkpoint    {root}",
        f"step          {meta.get('step')}",
        f"sync          {meta.get('sync')}",
        f"microbatches  {meta.get('microbatches')}",
        "",
        "plan that saved it",
        plan.render(),
        "",
        "shards",
    ]
    for stage, record in enumerate(meta["shards"]):
        name = record["file"] if isinstance(record, dict) else record
        size = (root / name).stat().st_size
        digest = record["sha256"][:16] + "..." if isinstance(record, dict) else "(no record)"
        lines.append(f"  stage {stage:<3} {name:<14} {size:>14,} bytes  sha256 {digest}")
    lines += ["", *_names(shards)]
    others = sorted(key for key in shards[0] if key != "state_dict")
    lines += ["", f"other entries (stage 0)  {', '.join(others) or '(none)'}"]
    return "\n".join(lines)


def _names(shards: list[dict[str, Any]]) -> list[str]:
    """One line per name of the merged state dict: shape, dtype, the stages that hold it."""
    holders: dict[str, list[int]] = {}
    tensors: dict[str, Any] = {}
    for stage, shard in enumerate(shards):
        for name, value in shard["state_dict"].items():
            holders.setdefault(name, []).append(stage)
            tensors.setdefault(name, value)
    total = sum(_bytes(v) for v in tensors.values())
    width = max((len(n) for n in tensors), default=4)
    lines = [f"names ({len(tensors)}, {total:,} bytes)"]
    lines.append(f"  {'name':<{width}}  {'shape':<20} {'dtype':<10} stage")
    for name, value in tensors.items():
        shape = str(list(value.shape)) if isinstance(value, torch.Tensor) else "-"
        dtype = str(value.dtype).removeprefix("torch.") if isinstance(value, torch.Tensor) else ""
        stages = ",".join(map(str, holders[name]))
        lines.append(f"  {name:<{width}}  {shape:<20} {dtype or type(value).__name__:<10} {stages}")
    return lines


def _bytes(value: Any) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0


def to_torch(path: str | Path, out: str | Path) -> dict[str, torch.Tensor]:
    """Write the LightningModule's full ``state_dict`` (``consolidate_checkpoint``) to ``out``
    with ``torch.save``, through a temporary file renamed into place; return it."""
    target = _output_file(out, "to-torch")
    state = consolidate_checkpoint(require_checkpoint(path))
    _save_file(state, target)
    return state


def to_lightning_file(path: str | Path, out: str | Path) -> dict[str, Any]:
    """Write the checkpoint as one Lightning checkpoint file (``core.checkpoint.to_lightning``:
    the full ``state_dict``, each optimizer's state by position, the loops, callbacks and LR
    schedulers), which ``Trainer(...).fit(model, ckpt_path=out)`` on one device resumes from;
    through a temporary file renamed into place. Returns the dict written."""
    target = _output_file(out, "to-lightning")
    checkpoint = to_lightning(require_checkpoint(path))
    _save_file(checkpoint, target)
    return checkpoint


def _output_file(out: str | Path, action: str) -> Path:
    """``out`` as a ``Path``, refused before anything is read when its directory is missing."""
    target = Path(out)
    if not target.parent.is_dir():
        raise CheckpointError(
            f"{action} writes into an existing directory (output: {target}, no directory "
            f"{target.parent}); create it first"
        )
    return target


def _save_file(value: Any, target: Path) -> None:
    """``torch.save(value, target)`` through a temporary file beside it renamed into place."""
    partial = target.with_name(f".{target.name}.partial-{os.getpid()}")
    try:
        torch.save(value, partial)
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)


def read_state_dict(source: str | Path) -> dict[str, torch.Tensor]:
    """The state dict in ``source``: a plain ``torch.save`` state dict, or the ``state_dict`` of
    a Lightning checkpoint file; refused with the fix for anything else."""
    source = Path(source)
    if is_sharded(source):
        raise CheckpointError(
            f"from-torch reads one torch.save file (input: {source} is already a PipeDream "
            f"checkpoint); resume from it directly, or write a plain state dict with "
            f"'pl-pipedream checkpoint to-torch {source} OUT'"
        )
    if not source.is_file():
        raise CheckpointError(
            f"from-torch reads one torch.save file (input: {source}, no such file); pass a "
            "state dict saved with torch.save(module.state_dict(), PATH) or a Lightning .ckpt"
        )
    loaded = _load(source)
    if isinstance(loaded, dict) and isinstance(loaded.get("state_dict"), dict):
        loaded = loaded["state_dict"]  # a Lightning checkpoint
    if not isinstance(loaded, dict) or not loaded:
        raise CheckpointError(
            f"from-torch needs a state dict, names mapped to tensors (input: {source} holds "
            f"{type(loaded).__name__}{' (empty)' if isinstance(loaded, dict) else ''}); save "
            "one with torch.save(module.state_dict(), PATH)"
        )
    for name, value in loaded.items():
        if not isinstance(name, str) or not isinstance(value, torch.Tensor):
            raise CheckpointError(
                f"from-torch needs a state dict, names mapped to tensors (input: {source}, "
                f"entry {name!r}: {type(value).__name__}); save one with "
                "torch.save(module.state_dict(), PATH)"
            )
    return dict(loaded)


def _load(source: Path) -> Any:
    """``torch.load`` on the CPU, memory-mapped where the file's format allows."""
    try:
        return torch.load(source, map_location="cpu", weights_only=False, mmap=True)
    except RuntimeError:
        pass  # a legacy (non-zip) file cannot be memory-mapped; read it whole below
    try:
        return torch.load(source, map_location="cpu", weights_only=False)
    except Exception as error:
        raise CheckpointError(
            f"from-torch reads a file written by torch.save (input: {source}: "
            f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}); "
            "pass a state dict or a Lightning .ckpt file"
        ) from error


def from_torch(source: str | Path, out: str | Path, layers: int = 1) -> Plan:
    """Make the PipeDream checkpoint directory ``out`` from the state dict in ``source``: one
    stage of ``layers`` layers on one worker, step 0, published as ``trainer.save_checkpoint``
    publishes (staged, fsynced, swapped in). Returns the plan it records."""
    target = Path(out)
    if os.path.lexists(target):
        raise CheckpointError(
            f"from-torch writes a new checkpoint (output: {target} already exists); remove it "
            "or choose another output path"
        )
    if not target.parent.is_dir():
        raise CheckpointError(
            f"from-torch writes into an existing directory (output: {target}, no directory "
            f"{target.parent}); create it first"
        )
    plan = Plan.from_balance([layers])  # a bad count is refused before a large file is read
    state = read_state_dict(source)
    checkpoint = {
        "epoch": 0,
        "global_step": 0,
        "pytorch-lightning_version": _lightning_version(),
        "state_dict": state,
        "optimizer_states": [],
        "lr_schedulers": [],
    }
    token = f"{secrets.token_hex(4)}-{os.getpid()}"
    staged = staging_dir(target, token)
    record = write_shard(staged, 0, checkpoint)
    write_description(staged, FROM_TORCH_SYNC, 1, plan, [record], 0)
    publish(staged, target, token)
    return plan


def _lightning_version() -> str:
    """The installed Lightning's version, read without importing it (the core stays free of
    Lightning); Lightning migrates a checkpoint by the version it records."""
    for name in ("lightning", "pytorch-lightning"):
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "0.0.0"
