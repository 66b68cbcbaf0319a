"""The launching command's exit code and last words, for ranks started by the script launcher.

With ``start_method="popen"`` rank 0 re-runs the user's script once per other rank. Lightning
watches those processes only while rank 0 runs: a rank that fails after rank 0 has finished (in
the user's code after ``trainer.fit`` or ``trainer.predict``) used to leave the launching command
exiting 0, and its error scrolled past among the other ranks' output.

``ExitReport`` fixes both. Before the other ranks start, rank 0 makes a directory for their
errors and passes it in ``PL_PIPEDREAM_ERRORS``; each of those ranks writes its uncaught
exception there (``record_uncaught_errors``). When rank 0's interpreter exits, it waits for the
other ranks (up to the strategy's timeout plus a margin, then stops them), prints the first
failed rank's error once, at the very end, and exits 1 if any rank failed. When rank 0 failed
too, its own error was just printed: the others get one line each, unless rank 0's error only
says that a peer stopped (``PeerError``), when the peer's error is the one to read.
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType

__all__ = [
    "ERRORS_VARIABLE",
    "ExitReport",
    "error_lines",
    "record_uncaught_errors",
    "write_error",
]

ERRORS_VARIABLE = "PL_PIPEDREAM_ERRORS"
LAST_LINES = 12  # of a rank's traceback, printed at the end


def record_uncaught_errors(rank: int) -> None:
    """On a rank started by the launcher, write its uncaught exception (formatted) to
    ``$PL_PIPEDREAM_ERRORS/rank-<rank>.txt`` before the usual printout. Nothing elsewhere."""
    directory = os.environ.get(ERRORS_VARIABLE)
    if not directory or rank == 0 or getattr(sys.excepthook, "records_errors", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        write_error(directory, rank, error)
        previous(kind, error, tb)

    hook.records_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def write_error(directory: str, rank: int, error: BaseException) -> None:
    """``error`` with its traceback, as rank ``rank``'s entry in ``directory``."""
    try:
        text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
        Path(directory, f"rank-{rank}.txt").write_text(text)
    except OSError:
        pass  # the report is a convenience: never hide the error itself


def error_lines(directory: str, rank: int) -> list[str]:
    """The last lines of rank ``rank``'s recorded error, indented; a note when none was."""
    path = Path(directory, f"rank-{rank}.txt")
    if not path.exists():
        return ["  (none recorded: it was killed or exited; its output above says where)"]
    return [f"  {line}" for line in path.read_text().rstrip().splitlines()[-LAST_LINES:]]


_planned_exit: int | None = None  # every rank's agreed exit status (a preemption), not a failure


def plan_exit(code: int) -> None:
    """Every rank is about to exit with ``code`` by agreement (a preemption): rank 0 does not
    count the others' ``code`` as a failure, and its own exit keeps that status."""
    global _planned_exit
    _planned_exit = code


class ExitReport:
    """Rank 0's side: made just before the other ranks start, checked when rank 0 exits."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.directory = tempfile.mkdtemp(prefix="pl-pipedream-errors-")
        os.environ[ERRORS_VARIABLE] = self.directory  # inherited by the ranks about to start
        self.procs: list[subprocess.Popen[bytes]] = []
        self.failed_here = False
        self.waited_on_peer = False  # rank 0 stopped because a peer did: that peer's error matters
        previous = sys.excepthook

        def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
            self.failed_here = True
            self.waited_on_peer = kind.__name__ == "PeerError"
            previous(kind, error, tb)

        sys.excepthook = hook

    def watch(self, procs: Sequence[subprocess.Popen[bytes]]) -> None:
        """Check ``procs`` (ranks 1, 2, ... in order) when this interpreter exits."""
        self.procs = list(procs)
        os.environ.pop(ERRORS_VARIABLE, None)
        atexit.register(self.at_exit)

    def at_exit(self) -> None:
        """Wait for the other ranks and report; exit 1 when one failed and rank 0 did not."""
        from pl_pipedream.strategy.lightning_patches import stop_child_observer

        stop_child_observer()  # it would kill rank 0 mid-report once it sees a failed rank
        wait = 5.0 if self.failed_here else self.timeout + 30.0
        codes = _wait_all(self.procs, wait)
        agreed = (0, _planned_exit)
        failed = [(rank, code) for rank, code in enumerate(codes, start=1) if code not in agreed]
        # Rank 0's own error was just printed; repeat another rank's only when rank 0's says
        # no more than that a peer stopped.
        brief = self.failed_here and not self.waited_on_peer
        report = self.describe(failed, brief)
        shutil.rmtree(self.directory, ignore_errors=True)
        if not failed:
            return
        logging.shutdown()
        sys.stdout.flush()
        print(report, file=sys.stderr, flush=True)
        if not self.failed_here:
            os._exit(1)

    def describe(self, failed: list[tuple[int, int | None]], brief: bool = False) -> str:
        """The first failed rank's error (the last lines of its traceback) and the others'
        exit codes, as one block; only the exit codes when ``brief``."""
        if not failed:
            return ""
        if brief:
            return "\n".join(
                f"pl-pipedream: rank {rank} failed as well ({_exit_text(code)})"
                for rank, code in failed
            )
        rank, code = failed[0]
        lines = [f"pl-pipedream: rank {rank} failed ({_exit_text(code)}); its error:"]
        lines += error_lines(self.directory, rank)
        for other, other_code in failed[1:]:
            lines.append(f"pl-pipedream: rank {other} failed as well ({_exit_text(other_code)})")
        return "\n".join(lines)


def _exit_text(code: int | None) -> str:
    if code is None:
        return "still running after the deadline: stopped"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}"
    return f"exit code: {code}"


def _wait_all(procs: Sequence[subprocess.Popen[bytes]], seconds: float) -> list[int | None]:
    """Each process's exit code; ``None`` for one still running after ``seconds`` (then
    killed, so that nothing is left behind)."""
    deadline = time.monotonic() + seconds
    codes: list[int | None] = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    return codes
