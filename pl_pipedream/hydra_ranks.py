"""Start the other ranks of a Hydra job as copies of that exact job, sharing its output directory.

Lightning's script launcher starts ranks 1..n-1 by re-running ``sys.argv``. Under Hydra that is
wrong in two ways: with ``--multirun`` every child would run the whole sweep, and each child
would pick its own time-stamped output directory. Here rank 0 starts the children itself, the
way ``torchrun`` would: each child runs ``python -m pl_pipedream.apps.train`` with the overrides of
this one job (``hydra.overrides.task``: in a sweep, the values of this job only), in RUN mode,
with ``hydra.run.dir`` set to rank 0's output directory. ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR`` and ``MASTER_PORT`` are set for every rank, rank 0 included, so Lightning sees
processes created externally and launches nothing more.

When ``LOCAL_RANK`` is already set (a child, or a run under torchrun or SLURM), nothing is started.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hydra.core.hydra_config import HydraConfig

__all__ = ["child_command", "other_ranks"]

log = logging.getLogger(__name__)

# Hydra overrides a child must not inherit: they would make it sweep or move its output.
_NOT_FORWARDED = (
    "hydra.mode",
    "hydra.run.",
    "hydra.sweep.",
    "hydra.job.name",
    "hydra.output_subdir",
    "hydra.sweeper",
    "hydra/sweeper",
    "hydra.launcher",
    "hydra/launcher",
)
_RANK_VARIABLES = ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


def _slurm_tasks() -> int:
    """The tasks of the SLURM job step this process belongs to (1 outside SLURM): ``srun``
    with one task per device starts every rank itself, as Lightning's SLURM support expects."""
    try:
        return int(os.environ.get("SLURM_NTASKS", "1"))
    except ValueError:
        return 1


@contextmanager
def other_ranks(num_processes: int) -> Iterator[None]:
    """Run ranks 1..n-1 of the current Hydra job for the duration of the block.

    On leaving the block normally, waits for every child and raises if one failed. If a child
    fails while the block runs, rank 0 may be blocked on it inside a collective; the child's
    error is logged, the other children are stopped and rank 0 is killed (as Lightning's own
    launcher does), so a failure never hangs until the strategy's timeout. Either way the
    failed child's own error (the last lines of its traceback, which each child records in a
    directory named by ``PL_PIPEDREAM_ERRORS``) is in rank 0's last message.
    """
    # strategy.exits is imported where needed: the strategy package loads Lightning, which
    # train.py's checks run without.
    if num_processes <= 1 or "LOCAL_RANK" in os.environ or _slurm_tasks() > 1:
        # a launcher (torchrun, srun with a task per device, or rank 0 here) started every rank
        try:
            yield
        except BaseException as error:
            from pl_pipedream.strategy.exits import ERRORS_VARIABLE, write_error

            errors = os.environ.get(ERRORS_VARIABLE)
            if errors and "LOCAL_RANK" in os.environ:  # for rank 0's report (Hydra prints it)
                write_error(errors, int(os.environ["LOCAL_RANK"]), error)
            raise
        return
    from pl_pipedream.strategy.exits import ERRORS_VARIABLE

    saved = {name: os.environ.get(name) for name in _RANK_VARIABLES}
    shared = {
        "NODE_RANK": "0",
        "WORLD_SIZE": str(num_processes),
        "MASTER_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
        "MASTER_PORT": str(_free_port()),
    }
    hydra = HydraConfig.get()
    command = child_command(
        hydra.overrides.task,
        hydra.overrides.hydra,
        hydra.runtime.output_dir,
        hydra.job.config_name,
        [s.path for s in hydra.runtime.config_sources if s.provider == "command-line"],
    )
    errors = tempfile.mkdtemp(prefix="pl-pipedream-errors-")  # each child's error, if any
    children = []
    for rank in range(1, num_processes):
        env = {**os.environ, **shared, "LOCAL_RANK": str(rank), ERRORS_VARIABLE: errors}
        rank_command = [*command, f"hydra.job.name={hydra.job.name}_rank{rank}"]
        children.append(subprocess.Popen(rank_command, env=env, cwd=hydra.runtime.cwd))
    os.environ.update({**shared, "LOCAL_RANK": "0"})
    watcher = _Watcher(children, errors=errors)
    watcher.start()
    try:
        yield
        watcher.stop()
        _wait(children, errors=errors)
    finally:
        watcher.stop()
        _stop(children)
        shutil.rmtree(errors, ignore_errors=True)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def child_command(
    task_overrides: Sequence[str],
    hydra_overrides: Sequence[str],
    output_dir: str,
    config_name: str | None,
    config_dirs: Sequence[str] = (),
) -> list[str]:
    """The command line that re-creates this job's configuration in a child process."""
    command = [sys.executable, "-m", "pl_pipedream.apps.train"]
    if config_name:
        command.append(f"--config-name={config_name}")
    command += [f"--config-dir={path}" for path in config_dirs]
    command += list(task_overrides)
    command += [o for o in hydra_overrides if not o.lstrip("+~").startswith(_NOT_FORWARDED)]
    command += [f"hydra.run.dir={_quoted(output_dir)}", "hydra.output_subdir=null"]
    return command


def _free_port() -> int:
    """A TCP port nobody listens on right now (the operating system picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _quoted(path: str) -> str:
    """A path as a Hydra override value (quoted, so ':' or '=' in it stay literal). Inside a
    quoted value Hydra reads a backslash as an escape only in a run of backslashes before a quote
    or at the end, so only those runs are doubled, and each quote gets its backslash."""
    doubled = re.sub(r"(\\+)(?='|$)", lambda run: run.group(1) * 2, path)
    return "'" + doubled.replace("'", "\\'") + "'"


def _failure(rank: int, code: int, errors: str | None) -> str:
    """Rank ``rank``'s failure, with the last lines of its error when it recorded one."""
    from pl_pipedream.strategy.exits import error_lines

    if errors is None:
        return f"rank {rank} failed (exit code: {code}); its error is printed above"
    return "\n".join(
        [f"rank {rank} failed (exit code: {code}); its error:", *error_lines(errors, rank)]
    )


def _wait(
    children: list[subprocess.Popen[bytes]], timeout: float = 120.0, errors: str | None = None
) -> None:
    deadline = time.monotonic() + timeout
    for rank, child in enumerate(children, start=1):
        try:
            code = child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired as error:
            raise RuntimeError(
                f"rank {rank} did not finish within {timeout:.0f} s after rank 0 did (pid: "
                f"{child.pid}); its output above says where it stopped"
            ) from error
        if code != 0:
            raise RuntimeError(_failure(rank, code, errors))


def _stop(children: list[subprocess.Popen[bytes]]) -> None:
    for child in children:
        if child.poll() is None:
            child.terminate()
    for child in children:
        try:
            child.wait(timeout=10)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class _Watcher(threading.Thread):
    """Kills the job as soon as a child exits with an error (rank 0 may be blocked on it)."""

    def __init__(
        self,
        children: list[subprocess.Popen[bytes]],
        period: float = 1.0,
        errors: str | None = None,
    ) -> None:
        super().__init__(daemon=True, name="pl-pipedream-rank-watcher")
        self.children = children
        self.errors = errors
        self.period = period
        self.stopped = threading.Event()

    def stop(self) -> None:
        self.stopped.set()

    def run(self) -> None:
        while not self.stopped.wait(self.period):
            for rank, child in enumerate(self.children, start=1):
                code = child.poll()
                if code not in (None, 0) and not self.stopped.is_set():
                    _stop(self.children)
                    log.error("%s\nstopping every rank", _failure(rank, code, self.errors))
                    os.kill(os.getpid(), signal.SIGKILL)
