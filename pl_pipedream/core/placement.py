"""Where a rank's work lives: its stage's tensors on its device, its process on its cores.

After ``cut_stage`` the layers of other stages are on the ``meta`` device; everything else of
the LightningModule (its stage's layers and any state outside the pipeline) moves to the rank's
device, and the optimizers keep only those parameters. On a GPU the process groups run NCCL for
CUDA tensors and gloo for CPU ones (``process_group_backend``). On CPU, each rank is bound to an
equal share of the cores its node's ranks may all use (``runtime.affinity``): the kernel could
otherwise run two busy stages on one core while another idles, and the whole pipeline would run
at that core's pace. ``join_process_group`` joins the default process group from the cluster
environment's address, port, rank and world size; ``share_threads`` gives each of a node's ranks
an equal share of the cores for its threads.
"""

from __future__ import annotations

import atexit
import os
import warnings
from collections.abc import Sequence
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from pl_pipedream.runtime.affinity import bind_threads, cpu_share, current_cpus

__all__ = [
    "bind_to_cpu_share",
    "join_process_group",
    "keep_local_parameters",
    "move_to_device",
    "process_group_backend",
    "share_threads",
]

GPU_BACKEND = "cpu:gloo,cuda:nccl"


def join_process_group(
    address: str, port: int, rank: int, world_size: int, backend: str, timeout: timedelta
) -> None:
    """Join the default process group through a TCP store at ``address:port`` (rank 0 serves
    it), unless this process already belongs to one. A group that is NCCL alone is destroyed at
    exit, as torch asks of NCCL groups."""
    if dist.is_initialized():
        return
    host = f"[{address}]" if ":" in address else address  # an IPv6 address
    dist.init_process_group(
        backend,
        init_method=f"tcp://{host}:{port}",
        rank=rank,
        world_size=world_size,
        timeout=timeout,
    )
    if backend == "nccl":
        atexit.register(_leave_process_group)


def share_threads(num_processes: int) -> None:
    """Unless ``OMP_NUM_THREADS`` is set, give this process (and, through the variable, the
    ranks it starts) 1/``num_processes`` of the cores it may run on, as Lightning's launchers do:
    one rank's intra-op threads would otherwise take every core from the others."""
    if "OMP_NUM_THREADS" in os.environ:
        return
    cpus = current_cpus()
    threads = max(1, (len(cpus) if cpus is not None else os.cpu_count() or 1) // num_processes)
    torch.set_num_threads(threads)
    os.environ["OMP_NUM_THREADS"] = str(threads)


def _leave_process_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def process_group_backend(device: torch.device, given: str | None) -> str:
    """The backend of the default process group: ``given``, else gloo on CPU, else NCCL for
    CUDA tensors *and* gloo for CPU tensors. Some collectives run on CPU tensors on a GPU too (a
    checkpoint's file list, the replicas' loss table, the preemption flag), and a group that is
    NCCL alone refuses them; ``torch.distributed`` picks the backend by the tensor's device, and
    every group made later inherits the pair. The pipeline's messages and gradient sums travel
    on the GPU, through NCCL."""
    if given is not None:
        return given
    return "gloo" if device.type == "cpu" else GPU_BACKEND


def move_to_device(module: nn.Module, device: torch.device) -> None:
    """Move every parameter and buffer of ``module`` that is not on ``meta`` to ``device``."""
    for sub in module.modules():
        for param in list(sub._parameters.values()):
            if param is not None and param.device.type != "meta":
                param.data = param.data.to(device)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None and buffer.device.type != "meta":
                sub._buffers[name] = buffer.to(device)


def keep_local_parameters(module: nn.Module, optimizers: Sequence[Optimizer]) -> None:
    """Optimizers keep only this rank's parameters (its stage's, plus any outside the
    pipeline): the others are on ``meta``."""
    local = {id(p) for p in module.parameters() if p.device.type != "meta"}
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["params"] = [p for p in group["params"] if id(p) in local]


def bind_to_cpu_share(
    rank: int, world_size: int, node_ranks: range
) -> tuple[frozenset[int], frozenset[int]] | None:
    """Bind this rank to its share of the cores its node's ranks (``node_ranks``) may all use;
    one all-gather of every rank's cores (all ranks call it). Returns the cores the process had
    (to restore at teardown) and its share, or None when left alone: ranks a launcher already
    bound to different cores, fewer cores than ranks, or a binding that failed (warned)."""
    pool = current_cpus()
    pools: list[frozenset[int] | None] = [None] * world_size
    dist.all_gather_object(pools, pool)
    share = cpu_share(pools, node_ranks, rank)
    if share is None or pool is None:
        return None
    try:
        bind_threads(share)
    except OSError as error:
        warnings.warn(
            f"Rank {rank} could not be bound to cores {sorted(share)} ({error}); it runs where "
            "the kernel places it. PipeDreamStrategy(bind_cpus=False) skips binding.",
            stacklevel=2,
        )
        return None
    return pool, share
