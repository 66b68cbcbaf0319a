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

import os
import re
import socket
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from hydra.core.hydra_config import HydraConfig

from pl_pipedream.runtime.processes import ERRORS_VARIABLE, RankProcesses, write_error

__all__ = ["RankFailure", "child_command", "other_ranks"]

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
def other_ranks(num_processes: int, timeout: float = 300.0) -> Iterator[None]:
    """Run ranks 1..n-1 of the current Hydra job for the duration of the block, started, watched
    and reported by ``runtime.processes.RankProcesses`` (``timeout``: the strategy's, how long a
    rank may wait for a peer).

    On leaving the block, rank 0 waits for every child; if any rank failed, hung or was
    stopped, it raises ``RankFailure`` whose message is the report, leading with the rank that
    failed first. If a child fails while the block runs, every rank gets a grace to stop on its
    own, then the ones still running, rank 0 included, are stopped, the report printed, and the
    command exits 1. An exit every rank agreed on (a preemption) passes through unchanged.
    """
    if num_processes <= 1 or "LOCAL_RANK" in os.environ or _slurm_tasks() > 1:
        # a launcher (torchrun, srun with a task per device, or rank 0 here) started every rank
        try:
            yield
        except Exception as error:
            errors = os.environ.get(ERRORS_VARIABLE)
            if errors and "LOCAL_RANK" in os.environ:  # for rank 0's report
                write_error(errors, int(os.environ["LOCAL_RANK"]), error)
            raise
        return
    saved = {name: os.environ.get(name) for name in (*_RANK_VARIABLES, ERRORS_VARIABLE)}
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
    commands = [
        [*command, f"hydra.job.name={hydra.job.name}_rank{rank}"]
        for rank in range(1, num_processes)
    ]
    ranks = RankProcesses.start(commands, {**os.environ, **shared}, timeout, cwd=hydra.runtime.cwd)
    os.environ.update({**shared, "LOCAL_RANK": "0"})
    try:
        try:
            yield
        except Exception as error:
            write_error(ranks.directory, 0, error)
            report, _ = ranks.finish()
            if report:
                raise RankFailure(report) from error
            raise
        except BaseException:  # an agreed exit (SystemExit) or Ctrl-C: this rank did not fail
            report, _ = ranks.finish()
            if report:
                print(report, file=sys.stderr, flush=True)
            raise
        report, _ = ranks.finish()
        if report:
            raise RankFailure(report)
    finally:
        ranks.finish()  # (again: returns at once) every child has ended
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


class RankFailure(RuntimeError):
    """A rank of the job failed, hung or was stopped; the message is the report."""


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
