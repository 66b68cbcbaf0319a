"""Run a function on N gloo (or NCCL) ranks in fresh processes and collect what each returns
or raises; or make this process a one-rank gloo group for the duration of a test.

The ranks are forked from the test process, which has torch and the package imported already:
a spawned rank spends about 2-7 CPU-seconds importing them again, which on two cores was most of
the runtime tier's time. A rank is spawned instead where forking is unsafe: for CUDA (NCCL), and
while this process is itself in a process group (its gloo threads would not survive the fork)."""

from __future__ import annotations

import gc
import io
import os
import socket
import traceback
from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _worker(  # type: ignore[no-untyped-def]
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue, backend: str
) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)  # one GPU per rank
        dist.init_process_group(
            backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
        )
        buffer = io.BytesIO()
        torch.save(fn(rank, world, *args), buffer)  # tensors travel as bytes, not shared memory
        queue.put((rank, "ok", buffer.getvalue()))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", f"{type(error).__name__}: {error}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def start_method(backend: str) -> str:
    """``fork`` for gloo ranks on the CPU from a process outside any process group, else
    ``spawn`` (see the module docstring)."""
    if "nccl" in backend or dist.is_initialized() or torch.cuda.is_initialized():
        return "spawn"
    return "fork"


def run(
    world: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 120.0,
    backend: str = "gloo",
    killed: Collection[int] = (),
) -> dict[int, tuple[str, Any]]:
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return {rank: (status, value)}.
    With an NCCL ``backend`` (``"cpu:gloo,cuda:nccl"``), rank r uses GPU r. The ranks in
    ``killed`` end their process themselves (a test of a dead rank) and report nothing."""
    context = mp.get_context(start_method(backend))
    gc.collect()  # garbage process groups die here, not in a forked rank without their threads
    queue = context.Queue()
    port = free_port()
    procs = [
        context.Process(
            target=_worker, args=(r, world, port, fn, args, queue, backend), daemon=True
        )
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, tuple[str, Any]] = {}
    try:
        for _ in range(world - len(killed)):
            rank, status, value = queue.get(timeout=timeout)
            if status == "ok":
                value = torch.load(io.BytesIO(value), weights_only=False)
            results[rank] = (status, value)
    finally:
        for proc in procs:
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
    return results


@contextmanager
def one_rank_group() -> Iterator[None]:
    """This process as rank 0 of a one-rank gloo group, destroyed afterwards."""
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
