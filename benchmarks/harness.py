"""What the benchmarks share: start N ranks and collect what each returns, a free port, the
environment of a child process, the steady window of a run, medians with their range, and the
figures written as JSON.

Two ways to start ranks. ``start_ranks`` runs a command in N fresh processes (``RANK``,
``MASTER_ADDR`` and ``MASTER_PORT`` set; Lightning's launcher starts further ranks itself), each
writing its result as JSON (``write_result``), and ends the others at the first that fails.
``fork_ranks`` forks N ranks of a function from this process into a gloo group (no interpreter
to start) and collects what each returns.

A benchmark is run as ``python benchmarks/<name>.py`` from the repository root and imports this
module by its bare name (Python puts the script's folder first on ``sys.path``); the tests find
it, and the benchmarks they import, through ``pythonpath`` in pyproject.toml.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "NODE_RANK", "WORLD_SIZE")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def child_env(**variables: str) -> dict[str, str]:
    """This process's environment for a child that runs a benchmark's worker: the repository
    root first on ``PYTHONPATH`` (the package as checked out), and ``variables``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env.update(variables)
    return env


# ----- ranks in fresh processes -----------------------------------------------------------------


def start_ranks(
    command: list[str], ranks: int, timeout: float, expected: int = 0
) -> list[dict[str, Any]]:
    """Run ``command`` with ``--out FILE`` in ``ranks`` processes, one thread each; return the
    results of ``expected`` ranks (default ``ranks``; Lightning starts a pipeline's other ranks
    itself), rank 0's from FILE and rank r's from ``FILE.rank<r>``. A rank that fails (or
    outlives ``timeout`` seconds) ends the others and exits this process with its log."""
    expected = expected or ranks
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        command = [*command, "--out", str(out)]
        env = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = []
        for rank in range(ranks):
            log = open(Path(tmp) / f"log{rank}.txt", "w")  # noqa: SIM115
            rank_env = {**env, "RANK": str(rank)} if ranks > 1 else env
            procs.append((subprocess.Popen(command, env=rank_env, stdout=log, stderr=log), log))
        failed = wait_all([proc for proc, _ in procs], timeout)
        for _, log in procs:
            log.close()
        if failed is not None:
            rank, code = failed
            text = Path(procs[rank][1].name).read_text()[-3000:]
            sys.exit(f"worker {shlex.join(command)} failed (rank {rank}, exit {code}):\n{text}")
        paths = [out] + [Path(f"{out}.rank{rank}") for rank in range(1, expected)]
        deadline = time.monotonic() + 60
        while not all(path.exists() for path in paths) and time.monotonic() < deadline:
            time.sleep(0.1)  # Lightning's rank 1 may still be writing when rank 0 exits
        return [json.loads(path.read_text()) for path in paths]


def wait_all(procs: list[subprocess.Popen], timeout: float) -> tuple[int, int | None] | None:
    """Wait for every process; at the first that fails (or at ``timeout`` seconds: exit None)
    end the others and return its (rank, exit code)."""
    deadline = time.monotonic() + timeout
    while True:
        codes = [proc.poll() for proc in procs]
        bad = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
        late = time.monotonic() > deadline and None in codes
        if bad or late:
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
            return bad[0] if bad else (codes.index(None), None)
        if None not in codes:
            return None
        try:  # wakes at once when it ends, else twice a second: a rank's core is left alone
            procs[codes.index(None)].wait(timeout=0.5)
        except subprocess.TimeoutExpired:
            pass


def launched_rank() -> int:
    """This process's rank: ``RANK`` as ``start_ranks`` sets it, ``LOCAL_RANK`` as Lightning's
    launcher does, else 0."""
    return int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", "0")))


def write_result(out: str, result: Any) -> None:
    """A rank's result as JSON where ``start_ranks`` reads it."""
    rank = launched_rank()
    Path(out if rank == 0 else f"{out}.rank{rank}").write_text(json.dumps(result))


# ----- ranks forked from this process ------------------------------------------------------------


def fork_ranks(world: int, fn: Callable[..., Any], *args: Any, timeout: float = 600.0) -> list[Any]:
    """``fn(rank, world, *args)`` on ``world`` ranks forked from this process, in a gloo group on
    one thread each; what each returned, by rank. A rank's exception is raised here, naming it."""
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    queue = context.Queue()
    port = free_port()
    procs = [
        context.Process(target=_forked, args=(r, world, port, fn, args, queue), daemon=True)
        for r in range(world)
    ]
    for proc in procs:
        proc.start()
    results = dict(queue.get(timeout=timeout) for _ in range(world))
    for proc in procs:
        proc.join(timeout=10)
    errors = {r: v[1] for r, v in results.items() if v[0] == "error"}
    if errors:
        raise RuntimeError(f"a run failed: {errors}")
    return [results[r][1] for r in range(world)]


def _forked(  # type: ignore[no-untyped-def]
    rank: int, world: int, port: int, fn: Callable[..., Any], args: tuple, queue
) -> None:
    import torch
    import torch.distributed as dist

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        queue.put((rank, ("ok", fn(rank, world, *args))))
    except BaseException as error:  # noqa: BLE001 - reported to the parent
        queue.put((rank, ("error", f"{type(error).__name__}: {error}")))
    finally:
        dist.destroy_process_group()


# ----- measuring ----------------------------------------------------------------------------------


def steady_window(times: Sequence[float], steps: int, warmup: int) -> tuple[float, float, int]:
    """(start, end, batches) of a run's batch-end ``times``: from the end of the ``warmup``
    batches to the end of the second-to-last batch (the last one may also drain a pipeline)."""
    if len(times) != steps:
        raise RuntimeError(f"a run must time every batch (batches: {len(times)}, steps: {steps})")
    return times[warmup - 1], times[-2], steps - 1 - warmup


def spread(values: Sequence[float], digits: int = 0, width: int = 0) -> str:
    """``median (min-max)``, each with ``digits`` decimals, the median ``width`` wide."""
    return (
        f"{statistics.median(values):{width}.{digits}f} "
        f"({min(values):.{digits}f}-{max(values):.{digits}f})"
    )


def write_json(path: str | Path, figures: Any) -> None:
    """The figures as indented JSON at ``path``, its folder made if need be."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(figures, indent=1))
