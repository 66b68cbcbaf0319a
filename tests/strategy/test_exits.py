"""The launching command's exit code and last words (``strategy.exits``)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pl_pipedream.strategy.exits import ERRORS_VARIABLE, ExitReport, record_uncaught_errors

SCRIPT = Path(__file__).with_name("failing_script.py")


@pytest.mark.slow
def test_a_rank_failing_after_rank_0_finished_fails_the_command(tmp_path: Path) -> None:
    """Rank 1 raises after ``fit``, when rank 0 has returned: the command exits 1 and its last
    lines are rank 1's error, printed once."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), "--fail", "after-fit"],
        cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=200,
    )
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    tail = result.stderr.rstrip().splitlines()
    start = max(i for i, line in enumerate(tail) if line.startswith("pl-pipedream: rank"))
    assert tail[start] == "pl-pipedream: rank 1 failed (exit code: 1); its error:", tail[start:]
    assert tail[-1].strip() == "RuntimeError: the user's code failed on rank 1 after fit"
    assert result.stderr.count("pl-pipedream: rank 1 failed") == 1


def test_the_report_names_the_first_failed_rank_and_its_error(tmp_path: Path) -> None:
    """Real processes, one per outcome: exit 0, an uncaught error recorded by the hook, a
    SIGKILL; the report names the first failure with its last lines and the others' codes."""
    hook = sys.excepthook
    report = ExitReport(timeout=30.0)
    try:
        code = "\n".join(
            [
                "import os, sys",
                "from pl_pipedream.strategy.exits import record_uncaught_errors",
                "record_uncaught_errors(int(sys.argv[1]))",
                "if sys.argv[2] == 'raise':",
                "    raise ValueError('bad batch on rank ' + sys.argv[1])",
                "if sys.argv[2] == 'kill':",
                "    os.kill(os.getpid(), 9)",
            ]
        )
        env = {**os.environ, ERRORS_VARIABLE: report.directory}
        procs = [
            subprocess.Popen([sys.executable, "-c", code, str(r), what], env=env)
            for r, what in ((1, "ok"), (2, "raise"), (3, "kill"))
        ]
        codes = [proc.wait(timeout=60) for proc in procs]
        assert codes == [0, 1, -9]
        text = report.describe([(2, 1), (3, -9)])
        assert text.splitlines()[0] == "pl-pipedream: rank 2 failed (exit code: 1); its error:"
        assert "  ValueError: bad batch on rank 2" in text.splitlines()
        assert text.splitlines()[-1] == "pl-pipedream: rank 3 failed as well (killed by SIGKILL)"
        assert report.describe([]) == ""
        brief = report.describe([(2, 1), (3, -9)], brief=True)  # rank 0's error came first
        assert brief.splitlines() == [
            "pl-pipedream: rank 2 failed as well (exit code: 1)",
            "pl-pipedream: rank 3 failed as well (killed by SIGKILL)",
        ]
    finally:
        os.environ.pop(ERRORS_VARIABLE, None)
        sys.excepthook = hook


def test_rank_0_records_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ERRORS_VARIABLE, str(tmp_path))
    hook = sys.excepthook
    record_uncaught_errors(0)
    assert sys.excepthook is hook
