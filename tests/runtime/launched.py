"""Run a scenario on N ranks as an external launcher (torchrun, srun, the Hydra app's rank 0)
starts them, forked from the test process: what each rank printed, its exit status, and what
the scenario returned.

Each rank is forked with ``LOCAL_RANK``, ``NODE_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` and
``MASTER_PORT`` set, so Lightning sees processes created externally, starts none and forms the
process group itself; a script's ``main(argv)`` runs as ``lambda _: main(argv)``. A rank's output
(file descriptors 1 and 2, ``sys.stdout`` and ``sys.stderr``, logging's stream handlers and the
warnings: pytest's capture of them undone) goes to ``rank{r}.out`` and ``rank{r}.err`` in
``folder``. A rank's status is what a process running the scenario as its main program would exit
with: 0, the code of ``SystemExit`` (a preemption's 143), 1 for any other exception (passed to
``sys.excepthook`` as an uncaught one is: printed to the rank's stderr, and recorded by a hook
the scenario set; its text is also kept apart, in ``Rank.error``), or ``-signal`` when a signal
ended it. Forking spares each rank the 3-5 s of importing torch and Lightning again that a fresh
interpreter pays; the tests that are about how ranks are started keep a real launch.

The ranks form a process group of their own, led by rank 0, as a command started in a session
of its own would: a scenario may signal the whole group (``os.killpg``, as ``scancel`` does)
without reaching the test process. ``tests.runtime.distributed`` instead runs plain functions
on ranks that it puts in a gloo group itself.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import pickle
import signal
import sys
import time
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch
import torch.distributed as dist

from tests.runtime.distributed import free_port


@dataclass
class Rank:
    """How one rank ended: its status, its output, and the scenario's return value."""

    code: int
    stdout: str
    stderr: str
    at: float  # when its end was seen (seconds since the epoch)
    value: Any = None
    error: str = ""  # an uncaught exception, as "Name: message" ("" when none)
    traceback: str = ""  # the exception as sys.excepthook printed it to stderr

    @property
    def output(self) -> str:
        return self.stdout + self.stderr


def launch(
    world: int,
    scenario: Callable[..., Any],
    *args: Any,
    folder: Path,
    timeout: float = 180.0,
    launcher_env: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> list[Rank]:
    """Run ``scenario(rank, *args)`` on ``world`` forked ranks; each rank's end, by rank.
    ``launcher_env=False`` leaves the rank variables unset (a command run by hand, which may
    start its own ranks); ``env``: more variables for every rank; ``cwd``: the ranks' working
    directory (where a script writes its files). Ranks still running at ``timeout`` are killed
    (status ``-9``)."""
    started = start(
        world, scenario, *args, folder=folder, launcher_env=launcher_env, env=env, cwd=cwd
    )
    return started.wait(timeout)


@dataclass
class Launch:
    """Ranks started by ``start``: their process ids, by rank, and where their output goes."""

    pids: list[int]
    folder: Path

    def all_running(self) -> bool:
        """Whether every rank is still running (an ended one is left for ``wait`` to reap)."""
        peek = os.WEXITED | os.WNOHANG | os.WNOWAIT
        return all(os.waitid(os.P_PID, pid, peek) is None for pid in self.pids)

    def wait(self, timeout: float) -> list[Rank]:
        """Each rank's end, by rank; the ranks still running after ``timeout`` are killed."""
        codes = _wait(self.pids, time.monotonic() + timeout)
        ends = []
        for rank, (code, at) in enumerate(codes):
            value_file = self.folder / f"rank{rank}.value"
            value = pickle.loads(value_file.read_bytes()) if value_file.is_file() else None
            error = ("", "")
            if (error_file := self.folder / f"rank{rank}.error").is_file():
                error = tuple(pickle.loads(error_file.read_bytes()))
            out, err = (self.folder / f"rank{rank}.{kind}" for kind in ("out", "err"))
            stdout, stderr = out.read_text(errors="replace"), err.read_text(errors="replace")
            ends.append(Rank(code, stdout, stderr, at, value, *error))
        return ends


def start(
    world: int,
    scenario: Callable[..., Any],
    *args: Any,
    folder: Path,
    launcher_env: bool = True,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike[str] | None = None,
) -> Launch:
    """``launch``'s ranks, started; the caller waits for them (``Launch.wait``)."""
    if dist.is_initialized() or torch.cuda.is_initialized():
        raise RuntimeError("fork the ranks from a process outside any process group, without CUDA")
    folder.mkdir(parents=True, exist_ok=True)
    for rank in range(world):  # an earlier launch's results in the same folder
        for kind in ("value", "error"):
            (folder / f"rank{rank}.{kind}").unlink(missing_ok=True)
    shared = {
        "NODE_RANK": "0",
        "WORLD_SIZE": str(world),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(free_port()),
    }
    sys.stdout.flush()
    sys.stderr.flush()
    pids: list[int] = []
    tests = os.getpgrp()
    for rank in range(world):
        gc.collect()  # garbage process groups die here, not in a rank without their threads
        pid = os.fork()
        if pid == 0:  # the rank: never returns
            with contextlib.suppress(OSError):
                os.setpgid(0, pids[0] if pids else 0)
            if os.getpgrp() == tests:  # a signal to the ranks' group would reach the tests
                os._exit(70)
            variables = {**shared, "LOCAL_RANK": str(rank)} if launcher_env else {}
            _rank(rank, scenario, args, folder, {**variables, **(env or {})}, cwd)
        with contextlib.suppress(OSError):  # (also here: no race with the child's own call)
            os.setpgid(pid, pids[0] if pids else pid)
        pids.append(pid)
    return Launch(pids, folder)


def _rank(  # type: ignore[type-arg]
    rank: int,
    scenario: Callable[..., Any],
    args: tuple,
    folder: Path,
    env: dict,
    cwd: str | os.PathLike[str] | None,
) -> None:
    code = 1
    try:
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1):
            signal.signal(signum, signal.SIG_DFL)  # as a fresh process has them
        os.environ.update(env)
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)
        if cwd is not None:
            os.chdir(cwd)
        for fd, kind in ((1, "out"), (2, "err")):
            os.dup2(
                os.open(folder / f"rank{rank}.{kind}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd
            )
        _output_to_descriptors()
        try:
            value = scenario(rank, *args)
            if value is not None:
                (folder / f"rank{rank}.value").write_bytes(pickle.dumps(value))
            code = 0
        except SystemExit as stopped:
            code = stopped.code if isinstance(stopped.code, int) else int(stopped.code is not None)
        except BaseException as error:  # noqa: BLE001 - a rank's error ends its process with status 1
            _uncaught(error, folder / f"rank{rank}")
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush()
            sys.stderr.flush()
        os._exit(code)  # no test-process teardown (pytest's atexit, gloo's threads) in a rank


def _output_to_descriptors() -> None:
    """Send what pytest took over in the test process to fds 1 and 2, as in a process of its
    own: ``sys.stdout`` and ``sys.stderr`` (pytest's capture files), the stream handlers made
    while those were pytest's (Lightning's), the warnings (pytest records them in a list); the
    root logger's handlers (pytest's) are removed."""
    sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
    sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    for logger in logging.Logger.manager.loggerDict.values():
        for handler in getattr(logger, "handlers", ()):
            if type(handler) is logging.StreamHandler:  # not pytest's own (subclasses)
                handler.setStream(sys.stderr)
    warnings.showwarning = _print_warning


def _print_warning(  # the signature of warnings.showwarning
    message: Warning | str,
    category: type[Warning],
    filename: str,
    lineno: int,
    file: TextIO | None = None,
    line: str | None = None,
) -> None:
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


def _uncaught(error: BaseException, path: Path) -> None:
    """``error`` passed to ``sys.excepthook`` as an uncaught one is (printed to stderr, recorded
    by a hook the scenario set); it and what the hook printed kept in ``path.error``."""
    sys.stderr.flush()
    start = os.lseek(2, 0, os.SEEK_CUR)
    sys.excepthook(type(error), error, error.__traceback__)
    sys.stderr.flush()
    printed = path.with_suffix(".err").read_bytes()[start:].decode(errors="replace")
    path.with_suffix(".error").write_bytes(
        pickle.dumps((f"{type(error).__name__}: {error}", printed))
    )


def _wait(pids: list[int], deadline: float) -> list[tuple[int, float]]:
    """Each rank's status and when its end was seen; the ranks still running at ``deadline``
    are killed."""
    codes: dict[int, tuple[int, float]] = {}
    while len(codes) < len(pids):
        for pid in pids:
            if pid in codes:
                continue
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                codes[pid] = (os.waitstatus_to_exitcode(status), time.time())
        if len(codes) < len(pids):
            if time.monotonic() > deadline:
                for pid in pids:
                    if pid not in codes:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                        status = os.waitpid(pid, 0)[1]
                        codes[pid] = (os.waitstatus_to_exitcode(status), time.time())
                break
            time.sleep(0.05)
    return [codes[pid] for pid in pids]
