"""runtime.processes: rank 0 starts, watches and reports the other ranks; real processes throughout.

The end-to-end cases through Lightning (a rank that hangs after fit, a SIGKILL of a middle rank
on 4 processes) are in tests/strategy/test_launcher.py; through the Hydra app in
tests/test_hydra_ranks.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pl_pipedream.runtime import processes as ranks
from pl_pipedream.runtime.processes import (
    ERRORS_VARIABLE,
    RankEnd,
    RankProcesses,
    record_uncaught_errors,
    render,
)

ROOT = Path(__file__).resolve().parents[2]

# A child rank: what it does is argv[1]; it records its uncaught error as launched ranks do.
CHILD = textwrap.dedent(
    """
    import os, signal, sys, time
    from pl_pipedream.runtime.processes import agree_exit, record_uncaught_errors
    record_uncaught_errors(int(os.environ["LOCAL_RANK"]))
    what = sys.argv[1]
    class PeerError(RuntimeError):
        pass
    if what == "peer":
        raise PeerError("rank 1 could not receive from rank 2")
    if what == "kill":
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    if what == "raise":
        time.sleep(0.5)
        raise ValueError("bad batch on rank " + os.environ["LOCAL_RANK"])
    if what == "hang":
        time.sleep(3600)
    if what == "agree":
        agree_exit(143)
        sys.exit(143)
    """
)


def children(*whats: str) -> list[list[str]]:
    return [[sys.executable, "-c", CHILD, what] for what in whats]


def environment() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.fixture(autouse=True)
def restore_excepthook():  # type: ignore[no-untyped-def]
    hook = sys.excepthook
    yield
    sys.excepthook = hook
    os.environ.pop(ERRORS_VARIABLE, None)


# ----- the report ---------------------------------------------------------------------------------


def test_the_report_leads_with_the_killed_rank_not_the_neighbour_that_saw_it_first() -> None:
    ends = [
        RankEnd(0, 0, 10.0),
        RankEnd(1, 1, 10.1, kind="PeerError", text="Traceback\nPeerError: from rank 2"),
        RankEnd(2, -9, 10.4),  # seen after its neighbour's error, yet the cause
        RankEnd(3, 1, 10.2, kind="RuntimeError", message="... Connection closed by peer ..."),
        RankEnd(4, -15, 10.0, stopped="at the deadline, still running 10 s after rank 0 ended"),
    ]
    assert render(ends).splitlines() == [
        "pl-pipedream: rank 2 failed (killed by SIGKILL); its error:",
        "  (no error recorded: it was killed, exited or hung; its output above says where)",
        "pl-pipedream: rank 1 failed as well (PeerError; exit code: 1)",
        "pl-pipedream: rank 3 failed as well (RuntimeError; exit code: 1)",
        "pl-pipedream: rank 4 was stopped at the deadline, still running 10 s after rank 0 "
        "ended (killed by SIGTERM)",
    ]


def test_an_own_error_leads_by_time_and_its_last_lines_are_shown() -> None:
    text = "\n".join(["Traceback (most recent call last):", *[f"  line {i}" for i in range(20)]])
    ends = [
        RankEnd(1, 1, 5.0, kind="ValueError", text=text + "\nValueError: bad batch"),
        RankEnd(2, 3, 4.0),  # os._exit(3) earlier: its own failure, the first
    ]
    lines = render(ends).splitlines()
    assert lines[0] == "pl-pipedream: rank 2 failed (exit code: 3); its error:"
    assert lines[-1] == "pl-pipedream: rank 1 failed as well (ValueError; exit code: 1)"
    ends[1].at = 6.0  # rank 2's exit now comes after rank 1's error
    lines = render(ends).splitlines()
    assert lines[0] == "pl-pipedream: rank 1 failed (exit code: 1); its error:"
    assert (
        len(lines) == 1 + ranks.LAST_LINES + 1
        and lines[ranks.LAST_LINES] == "  ValueError: bad batch"
    )


def test_a_rank_that_failed_then_hung_on_its_way_out_counts_by_its_error() -> None:
    end = RankEnd(3, -15, 1.0, kind="PeerError", stopped="at the deadline, still running 10 s")
    assert end.order()[0] == 1
    assert end.line(lead=False) == (
        "rank 3 failed as well (PeerError; then stopped at the deadline, still running 10 s: "
        "killed by SIGTERM)"
    )


def test_an_agreed_exit_is_no_failure_and_nothing_is_reported() -> None:
    ends = [RankEnd(0, 0, 1.0), RankEnd(1, 143, 1.0), RankEnd(2, 0, 1.0)]
    assert render(ends, agreed=143) == ""
    assert render(ends).startswith("pl-pipedream: rank 1 failed (exit code: 143)")


# ----- each rank's record -------------------------------------------------------------------------


def test_a_rank_records_its_uncaught_error_only_where_a_report_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    hook = sys.__excepthook__  # whatever an earlier test of this process installed, not kept
    monkeypatch.setattr(sys, "excepthook", hook)
    monkeypatch.delenv(ERRORS_VARIABLE, raising=False)
    record_uncaught_errors(1)
    assert sys.excepthook is hook  # no PL_PIPEDREAM_ERRORS: nothing to do
    monkeypatch.setenv(ERRORS_VARIABLE, str(tmp_path))
    record_uncaught_errors(1)
    assert sys.excepthook is not hook
    installed = sys.excepthook
    record_uncaught_errors(1)
    assert sys.excepthook is installed  # once


def test_the_script_command_reruns_the_script_as_it_was_started(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(
        "import json\nfrom pl_pipedream.runtime.processes import script_command\n"
        "print(json.dumps(script_command()))\n"
    )
    for how in ([str(script)], ["-m", "job"]):
        done = subprocess.run(
            [sys.executable, *how, "--devices", "2"],
            env={**environment(), "PYTHONPATH": f"{ROOT}:{tmp_path}"},
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        )
        assert json.loads(done.stdout) == [sys.executable, *how, "--devices", "2"]


# ----- rank 0's side: finish ----------------------------------------------------------------------


def test_a_rank_still_running_after_the_deadline_fails_the_command(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The deadline is the timeout plus ``FINISH_MARGIN`` (10 s; 0.5 s here, to keep it quick)."""
    monkeypatch.setattr(ranks, "FINISH_MARGIN", 0.5)
    started = RankProcesses.start(children("hang"), environment(), timeout=0.5)
    began = time.monotonic()
    report, status = started.finish()
    assert status == 1 and 1.0 <= time.monotonic() - began < 1.0 + 5
    assert report.splitlines()[0] == (
        "pl-pipedream: rank 1 was stopped at the deadline, still running 1 s after rank 0 "
        "ended (killed by SIGTERM)"
    )
    assert started.procs[0].poll() is not None  # nothing left behind
    assert started.finish() == (report, status)  # once
    assert ERRORS_VARIABLE not in os.environ


@pytest.mark.slow
def test_an_agreed_exit_passes_and_a_failed_rank_is_named_with_its_error() -> None:
    agreed = RankProcesses.start(children("agree", "agree"), environment(), timeout=30)
    assert agreed.finish() == ("", 0)
    failed = RankProcesses.start(children("agree", "raise"), environment(), timeout=30)
    report, status = failed.finish()
    lines = report.splitlines()
    assert status == 1
    assert lines[0] == "pl-pipedream: rank 2 failed (exit code: 1); its error:"
    assert lines[-1] == "  ValueError: bad batch on rank 2"  # rank 1's 143 was agreed


def test_ranks_signalled_by_rank_0_are_listed_as_stopped() -> None:
    started = RankProcesses.start(children("hang"), environment(), timeout=30)
    started.send_signal(15)
    report, status = started.finish()
    assert status == 1
    assert report.splitlines()[0] == (
        "pl-pipedream: rank 1 was stopped with SIGTERM from rank 0 (killed by SIGTERM)"
    )


# ----- rank 0's side: the watcher, while rank 0 runs ----------------------------------------------

RANK_0 = textwrap.dedent(
    """
    import sys, time
    from pl_pipedream.runtime.processes import RankProcesses
    whats = sys.argv[1:]
    command = [sys.executable, "-c", {child!r}]
    started = RankProcesses.start([[*command, w] for w in whats], {env!r}, timeout=30, grace=2)
    started.report_at_exit()
    time.sleep(3600)  # blocked, as in a collective with a dead rank
    """
)


@pytest.mark.slow
def test_a_failure_while_rank_0_is_blocked_ends_every_rank_and_names_the_killed_one() -> None:
    """Rank 1 fails with a PeerError at once, rank 2 is SIGKILLed half a second later, rank 3
    and rank 0 hang: after the grace the watcher stops them all, prints the report with rank 2
    first and exits 1 (Lightning's observer would have SIGKILLed rank 0: status 137)."""
    code = RANK_0.format(child=CHILD, env=environment())
    began = time.monotonic()
    result = subprocess.run(
        [sys.executable, "-c", code, "peer", "kill", "hang"],
        env=environment(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1, result.stderr[-3000:]
    assert time.monotonic() - began < 30
    report = result.stderr[result.stderr.index("pl-pipedream: rank") :].splitlines()
    assert report[0] == "pl-pipedream: rank 2 failed (killed by SIGKILL); its error:"
    assert report[2] == "pl-pipedream: rank 1 failed as well (PeerError; exit code: 1)"
    assert report[3] == (
        "pl-pipedream: rank 0 was stopped at the deadline, still running 2 s after a rank failed "
        "(exit code: 1)"
    )
    assert report[4] == (
        "pl-pipedream: rank 3 was stopped at the deadline, still running 2 s after a rank failed "
        "(killed by SIGTERM)"
    )
    assert len(report) == 5
