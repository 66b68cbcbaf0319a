"""Start the other ranks of a job on this node, watch them, and report how they ended.

Rank 0 starts ranks 1..n-1 as processes (``RankProcesses.start``), for Lightning's
``start_method="popen"`` (``strategy.launcher``) and for the Hydra app (``hydra_ranks``) alike.
Each rank records its uncaught error, with its kind and time, in a directory that rank 0 makes and
passes in ``PL_PIPEDREAM_ERRORS`` (``record_uncaught_errors``, ``write_error``). A thread of rank 0
polls the ranks; once one fails, every rank gets ``FAILURE_GRACE`` seconds to stop by itself (the
neighbours of a dead rank name it in their own errors), then the ones still running are stopped
and rank 0 prints the report and exits 1. When rank 0 ends first, it waits for the others (its
timeout plus ``FINISH_MARGIN`` when it succeeded, ``FAILURE_GRACE`` when it failed), stops the
ones still running, and reports (``finish``).

The report leads with the rank that caused the failure: a rank killed by a signal nobody here
sent, or one that ended with its own error, earliest first; then the ranks that only saw a peer
stop (``PeerError``, gloo's "closed by peer"), then the ranks stopped at a deadline. The command
exits 1 whenever any rank failed, hung or was stopped; an exit every rank agreed on (a
preemption, ``agree_exit``) keeps its status. Nothing here imports Lightning or torch.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

__all__ = [
    "ERRORS_VARIABLE",
    "RankEnd",
    "RankProcesses",
    "agree_exit",
    "record_uncaught_errors",
    "render",
    "script_command",
    "write_error",
]

ERRORS_VARIABLE = "PL_PIPEDREAM_ERRORS"
LAST_LINES = 12  # of the leading rank's traceback, printed at the end
FAILURE_GRACE = 10.0  # seconds every rank has to stop by itself once one failed
FINISH_MARGIN = 10.0  # seconds beyond the timeout that rank 0 waits for the others when it is done
STOP_SECONDS = 3.0  # between SIGTERM and SIGKILL when stopping a rank
POLL_SECONDS = 0.2
_AGREED_FILE = "agreed-exit"
# An error that only says a peer stopped: the peer's error is the one to read.
_CONSEQUENCES = ("PeerError",)
_CONSEQUENCE_TEXTS = ("Connection closed by peer", "Connection reset by peer")


def script_command() -> list[str]:
    """The command line that re-runs this process's script (``python -m pkg`` or a file)."""
    import __main__

    spec = getattr(__main__, "__spec__", None)
    if spec is None:
        return [sys.executable, os.path.abspath(sys.argv[0]), *sys.argv[1:]]
    return [sys.executable, "-m", spec.name, *sys.argv[1:]]


# ----- each rank's side ---------------------------------------------------------------------------


def write_error(directory: str, rank: int, error: BaseException) -> None:
    """``error`` with its kind, traceback and time, as rank ``rank``'s entry in ``directory``."""
    text = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    entry = {"kind": type(error).__name__, "message": str(error), "time": time.time()}
    entry["text"] = text
    try:
        path = Path(directory, f"rank-{rank}.json")
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(entry))
        partial.replace(path)  # whole or absent for the reader
    except OSError:
        pass  # the report is a convenience: never hide the error itself


def record_uncaught_errors(rank: int) -> None:
    """Write this process's uncaught exception to ``$PL_PIPEDREAM_ERRORS`` (read when it
    happens) as rank ``rank``'s entry, before the usual printout; nothing while it is unset."""
    if not os.environ.get(ERRORS_VARIABLE) or getattr(sys.excepthook, "records_errors", False):
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], error: BaseException, tb: TracebackType | None) -> None:
        directory = os.environ.get(ERRORS_VARIABLE)
        if directory:
            write_error(directory, rank, error)
        previous(kind, error, tb)

    hook.records_errors = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def agree_exit(code: int) -> None:
    """Every rank is about to exit with ``code`` by agreement (a preemption): rank 0 counts
    that status as no failure. Each rank calls it before it exits."""
    directory = os.environ.get(ERRORS_VARIABLE)
    if directory:
        try:
            Path(directory, _AGREED_FILE).write_text(str(code))
        except OSError:
            pass


# ----- how a rank ended ---------------------------------------------------------------------------


@dataclass
class RankEnd:
    """How one rank ended: its exit code (negative: the signal), its recorded error, whether
    rank 0 stopped it, and when (seconds since the epoch)."""

    rank: int
    code: int | None
    at: float
    kind: str | None = None
    text: str | None = None
    message: str = ""
    stopped: str | None = None  # why rank 0 stopped it, when it did

    def failed(self, agreed: int | None) -> bool:
        return self.stopped is not None or self.code not in (0, agreed)

    def order(self) -> tuple[int, float, int]:
        """Causes first (killed by a signal, its own error), then ranks that saw a peer stop,
        then those stopped at a deadline with no error of their own; earliest first in each
        (the stopped ones by rank)."""
        if self.kind is None and self.stopped is not None:
            return (2, 0.0, self.rank)
        consequence = self.kind in _CONSEQUENCES or any(
            text in self.message for text in _CONSEQUENCE_TEXTS
        )
        return (1 if consequence else 0, self.at, self.rank)

    def exit_text(self) -> str:
        if self.code is None:
            return "still running"
        if self.code < 0:
            return f"killed by {_signal_name(-self.code)}"
        return f"exit code: {self.code}"

    def line(self, lead: bool) -> str:
        """This rank's line of the report (the first line when ``lead``)."""
        if self.kind is None and self.stopped is not None:
            return f"rank {self.rank} was stopped {self.stopped} ({self.exit_text()})"
        status = self.exit_text()
        if self.stopped is not None:
            status = f"then stopped {self.stopped}: {status}"
        if lead:
            return f"rank {self.rank} failed ({status}); its error:"
        detail = status if self.kind is None else f"{self.kind}; {status}"
        return f"rank {self.rank} failed as well ({detail})"


def render(ends: Sequence[RankEnd], agreed: int | None = None) -> str:
    """The report: the leading failure with the last lines of its error, then one line per other
    failed rank; "" when none failed."""
    failed = sorted((end for end in ends if end.failed(agreed)), key=RankEnd.order)
    if not failed:
        return ""
    lead = failed[0]
    lines = [f"pl-pipedream: {lead.line(lead=True)}"]
    if lead.text:
        lines += [f"  {line}" for line in lead.text.rstrip().splitlines()[-LAST_LINES:]]
    else:
        lines.append(
            "  (no error recorded: it was killed, exited or hung; its output above says where)"
        )
    lines += [f"pl-pipedream: {end.line(lead=False)}" for end in failed[1:]]
    return "\n".join(lines)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


# ----- rank 0's side ------------------------------------------------------------------------------


class RankProcesses:
    """Ranks ``first_rank + 1 ..`` started by this process (the job's rank ``first_rank``),
    watched until ``finish``."""

    def __init__(self, timeout: float, first_rank: int = 0, grace: float = FAILURE_GRACE) -> None:
        self.timeout = timeout
        self.grace = grace
        self.first_rank = first_rank
        self.directory = tempfile.mkdtemp(prefix="pl-pipedream-errors-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.ended: dict[int, float] = {}  # rank -> when its exit was first seen
        self.stopped: dict[int, str] = {}  # rank -> why rank 0 stopped it
        self._closing = threading.Event()
        self._lock = threading.Lock()
        self._watcher: threading.Thread | None = None
        self._result: tuple[str, int] | None = None

    @classmethod
    def start(
        cls,
        commands: Sequence[Sequence[str]],
        env: Mapping[str, str],
        timeout: float,
        cwd: str | None = None,
        first_rank: int = 0,
        grace: float = FAILURE_GRACE,
    ) -> RankProcesses:
        """Run ``commands[i]`` as local rank i + 1 (``LOCAL_RANK`` set, with ``env``) and watch
        them; this process records its own uncaught error as local rank 0."""
        ranks = cls(timeout, first_rank, grace)
        os.environ[ERRORS_VARIABLE] = ranks.directory
        for local, command in enumerate(commands, start=1):
            child_env = {**env, "LOCAL_RANK": str(local), ERRORS_VARIABLE: ranks.directory}
            ranks.procs.append(subprocess.Popen(list(command), env=child_env, cwd=cwd))
        record_uncaught_errors(first_rank)
        ranks._watcher = threading.Thread(
            target=ranks._watch, daemon=True, name="pl-pipedream-rank-watcher"
        )
        ranks._watcher.start()
        return ranks

    def send_signal(self, signum: int) -> None:
        """Forward ``signum`` to every rank still running (they count as stopped by rank 0)."""
        for rank, proc in self._ranked():
            if proc.poll() is None:
                why = f"with {_signal_name(signum)} from rank {self.first_rank}"
                self.stopped.setdefault(rank, why)
                proc.send_signal(signum)

    def finish(self) -> tuple[str, int]:
        """At this rank's end: wait for the others (``grace`` s when this rank recorded an
        error, else the timeout plus ``FINISH_MARGIN``), stop the ones still running, and
        return the report and the status the command should end with (0 when none failed)."""
        self._closing.set()
        with self._lock:
            if self._result is not None:
                return self._result
            failed_here = Path(self.directory, f"rank-{self.first_rank}.json").exists()
            wait = self.grace if failed_here else self.timeout + FINISH_MARGIN
            self._wait_all(time.monotonic() + wait)
            self._stop_running(
                f"at the deadline, still running {wait:.0f} s after rank {self.first_rank} ended"
            )
            self._result = self._conclude()
            return self._result

    def report_at_exit(self) -> None:
        """``finish`` when this interpreter exits; on a failure print the report as the last
        words and exit 1, whatever status the interpreter was about to exit with."""
        atexit.register(self._exit_with_report)

    def _exit_with_report(self) -> None:
        report, status = self.finish()
        if report:
            _print_last(report)
            os._exit(status)

    # ----- the watching -----

    def _ranked(self) -> list[tuple[int, subprocess.Popen[bytes]]]:
        return [(self.first_rank + i, proc) for i, proc in enumerate(self.procs, start=1)]

    def _poll(self) -> bool:
        """Note the ranks that ended; True when any of them failed (not by agreement)."""
        agreed = self._agreed()
        failed = False
        for rank, proc in self._ranked():
            code = proc.poll()
            if code is not None:
                self.ended.setdefault(rank, time.time())
                failed = failed or code not in (0, agreed)
        return failed

    def _watch(self) -> None:
        failed_at = None
        while not self._closing.wait(POLL_SECONDS):
            if failed_at is None and self._poll():
                failed_at = time.monotonic()
            if failed_at is None or time.monotonic() - failed_at < self.grace:
                continue
            with self._lock:
                if self._closing.is_set():
                    return  # this rank ended meanwhile: finish reports
                self._closing.set()
                late = f"at the deadline, still running {self.grace:.0f} s after a rank failed"
                self._stop_running(late)
                self.stopped[self.first_rank] = late
                _print_last(self._conclude()[0])
                os._exit(1)

    def _wait_all(self, deadline: float) -> None:
        while time.monotonic() < deadline:
            self._poll()
            if all(proc.poll() is not None for proc in self.procs):
                return
            time.sleep(min(POLL_SECONDS, max(0.0, deadline - time.monotonic())))
        self._poll()

    def _stop_running(self, why: str) -> None:
        """SIGTERM to every rank still running, SIGKILL after ``STOP_SECONDS``."""
        running = [(rank, proc) for rank, proc in self._ranked() if proc.poll() is None]
        for rank, proc in running:
            self.stopped.setdefault(rank, why)
            proc.terminate()
        for _, proc in running:
            try:
                proc.wait(timeout=STOP_SECONDS)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._poll()

    def _agreed(self) -> int | None:
        try:
            return int(Path(self.directory, _AGREED_FILE).read_text())
        except (OSError, ValueError):
            return None

    def _conclude(self) -> tuple[str, int]:
        """The report over every rank, this one included; the directory is removed."""
        agreed = self._agreed()
        own = self._end(self.first_rank, 1 if self.first_rank in self.stopped else 0)
        ends = [own, *(self._end(rank, proc.returncode) for rank, proc in self._ranked())]
        report = render(ends, agreed)
        os.environ.pop(ERRORS_VARIABLE, None)
        shutil.rmtree(self.directory, ignore_errors=True)
        return report, 1 if report else 0

    def _end(self, rank: int, code: int | None) -> RankEnd:
        end = RankEnd(rank, code, self.ended.get(rank, time.time()), stopped=self.stopped.get(rank))
        try:
            entry = json.loads(Path(self.directory, f"rank-{rank}.json").read_text())
        except (OSError, ValueError):
            return end
        end.kind, end.text, end.message = entry["kind"], entry["text"], entry["message"]
        end.at = min(end.at, float(entry["time"]))
        if end.code == 0:
            end.code = 1  # this rank's own error, recorded before its exit status exists
        return end


def _print_last(report: str) -> None:
    """``report`` as this process's last words on stderr, after everything it logged."""
    logging.shutdown()
    sys.stdout.flush()
    print(report, file=sys.stderr, flush=True)
