"""Joining the process group a ``Pipeline`` runs in, and the device of this rank."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from pl_pipedream.core.errors import PipelineSetupError
from pl_pipedream.core.placement import join_process_group

__all__ = ["TORCHRUN", "default_device", "join_launched_group"]

TORCHRUN = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")


def join_launched_group(timeout: float) -> None:
    """Join the default process group from ``torchrun``'s variables unless this process is in
    one already (``torch.multiprocessing`` with ``init_process_group``)."""
    if dist.is_initialized():
        return
    missing = [name for name in TORCHRUN if name not in os.environ]
    if missing:
        raise PipelineSetupError(
            f"a Pipeline runs in a process group (none joined, and torchrun's variables are "
            f"not set: {', '.join(missing)}); start the script with torchrun --nproc_per_node "
            "N, or call torch.distributed.init_process_group in each process first"
        )
    backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
    join_process_group(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["RANK"]),
        int(os.environ["WORLD_SIZE"]),
        backend,
        timedelta(seconds=timeout),
    )


def default_device() -> torch.device:
    """``cuda:LOCAL_RANK`` when the default group runs NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()) and torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
