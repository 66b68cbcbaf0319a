"""An ``Accelerator`` on each rank of ``tests.runtime.distributed.run``'s gloo group, as
``accelerate launch`` would make it: the launcher's variables set, then ``Accelerator()``
(which finds the group joined, and joins no other). Only in the forked ranks: the variables and
Accelerate's process-wide state die with them."""

from __future__ import annotations

import os
from typing import Any


def accelerator_on(rank: int, world: int, cpu: bool = True, **kwargs: Any) -> Any:
    """Rank ``rank``'s Accelerator: on the CPU (gloo), or with ``cpu=False`` on ``cuda:rank``
    (the NCCL group of ``run(..., backend="cpu:gloo,cuda:nccl")``)."""
    from accelerate import Accelerator

    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world)
    )
    return Accelerator(cpu=cpu, **kwargs)
