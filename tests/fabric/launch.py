"""Run a function on N ranks through ``Fabric.launch`` itself and collect what every rank
returns (Fabric's launcher hands back rank 0's result only, so each rank saves its own).

The ranks are forked (``start_method="fork"``), as ``tests/runtime/distributed.py`` explains:
the test process has torch and Lightning imported and is in no process group."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric import Fabric

from pl_pipedream.fabric import PipeDreamFabricStrategy
from tests.runtime.distributed import free_port


def launch(
    monkeypatch: pytest.MonkeyPatch,
    out: Path,
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    loggers: Any = None,
    precision: str = "32-true",
    **strategy: Any,
) -> dict[int, Any]:
    """``fn(fabric, *args)`` on ``world`` forked ranks of ``Fabric(strategy=
    PipeDreamFabricStrategy(**strategy), accelerator="cpu", devices=world)``; {rank: result}."""
    for name in ("MASTER_PORT", "MASTER_ADDR"):  # Fabric's launcher writes them: restored after
        monkeypatch.setenv(name, "0")
        monkeypatch.delenv(name)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    out.mkdir(parents=True, exist_ok=True)
    fabric = Fabric(
        strategy=PipeDreamFabricStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=world,
        loggers=loggers,
        precision=precision,  # type: ignore[arg-type]
    )
    fabric.launch(_saving, fn, out, *args)
    return {r: torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)}


def _saving(fabric: Fabric, fn: Callable[..., Any], out: Path, *args: Any) -> None:
    result = fn(fabric, *args)
    torch.save(result, out / f"rank{fabric.global_rank}.pt")
