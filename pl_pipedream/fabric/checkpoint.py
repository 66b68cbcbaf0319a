"""``fabric.save`` / ``fabric.load`` under the pipeline: the engine's sharded checkpoint.

Fabric hands the strategy a dict such as ``{"model": model, "optimizer": optimizer, "step": 3}``.
The module and its optimizer are the pipeline's: ``Pipeline.save`` writes them as one shard per
stage (``docs/checkpoints.md``), resumable under any plan. Every other entry is the loop's own
state, the same on every rank: converted as Fabric converts it (a module, optimizer or any
object with ``state_dict`` by its ``state_dict()``) and kept in stage 0's shard; ``restore``
puts it back as Fabric's own ``load`` does.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["loop_state", "restore"]


def loop_state(state: dict[str, Any], pipeline_objects: Iterable[Any]) -> dict[str, Any]:
    """The entries of ``state`` that are not the pipeline's objects, as savable values; the
    module ``fabric.setup`` returned must be one of the entries."""
    ours = [id(obj) for obj in pipeline_objects]
    if not any(id(obj) == ours[0] for obj in state.values()):
        raise ValueError(
            f"fabric.save under the pipeline saves the pipeline's stages through the module "
            f"fabric.setup returned, which the state must hold (state keys: {sorted(state)}); "
            'write fabric.save(path, {"model": model, "optimizer": optimizer, ...})'
        )
    return {
        key: obj.state_dict() if callable(getattr(obj, "state_dict", None)) else obj
        for key, obj in state.items()
        if id(obj) not in ours
    }


def restore(
    state: dict[str, Any], saved: dict[str, Any], pipeline_objects: Iterable[Any], strict: bool
) -> dict[str, Any]:
    """Put the loop's saved entries back into ``state`` (objects with ``load_state_dict``
    load theirs, plain values are replaced); return the saved entries ``state`` did not ask
    for. With ``strict``, an entry of ``state`` the checkpoint lacks is refused."""
    ours = {id(obj) for obj in pipeline_objects}
    wanted = [key for key, obj in state.items() if id(obj) not in ours]
    missing = [key for key in wanted if key not in saved]
    if strict and missing:
        raise KeyError(
            f"the checkpoint holds no entry for every key of the state (missing: {missing}, "
            f"saved: {sorted(saved)}); drop those keys from the state or pass "
            "fabric.load(path, state, strict=False)"
        )
    remainder = dict(saved)
    for key in wanted:
        if key not in remainder:
            continue
        value = remainder.pop(key)
        if callable(getattr(state[key], "load_state_dict", None)):
            state[key].load_state_dict(value)
        else:
            state[key] = value
    return remainder
