"""Preemption: signal names, the exit status, and SIGTERM mid-training to one rank or to every
rank, resumed to the weights of an uninterrupted run (``preempt_script.py``)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from pl_pipedream.strategy.preemption import exit_code, parse_signals

SCRIPT = Path(__file__).with_name("preempt_script.py")


def test_signals_are_parsed_and_uncatchable_ones_refused() -> None:
    assert parse_signals(("SIGTERM", "usr1", 15)) == (signal.SIGTERM, signal.SIGUSR1)
    assert exit_code(signal.SIGTERM) == 143 and exit_code(signal.SIGUSR1) == 138
    with pytest.raises(ValueError, match="preempt_signals must name signals"):
        parse_signals(("SIGNOPE",))
    with pytest.raises(ValueError, match="SIGKILL and SIGSTOP cannot be caught"):
        parse_signals(("SIGKILL",))


def run(out: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    command = [sys.executable, str(SCRIPT), "--out", str(out), *args]
    # A session of its own: "--target group" signals the whole process group, as scancel does.
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=90, start_new_session=True
    )


@pytest.mark.slow
@pytest.mark.parametrize(
    ("sync", "target", "seed"),
    # one rank signalled (flush: bitwise) and every rank at once, as scancel does (async)
    [("flush", "rank1", 1), ("async", "group", 3)],
    ids=str,
)
def test_sigterm_stops_every_rank_with_a_checkpoint_that_resumes_exactly(
    tmp_path: Path, sync: str, target: str, seed: int
) -> None:
    at = random.Random(seed).randrange(2, 40)  # 48 steps in all
    stopped = run(tmp_path / "stopped", "--sync", sync, "--signal-at", str(at), "--target", target)
    ended = time.time()
    assert stopped.returncode == 143, stopped.stderr[-3000:]
    signalled = float((tmp_path / "stopped" / "signalled").read_text())
    exits = [json.loads((tmp_path / "stopped" / f"exit-rank{r}.json").read_text()) for r in (0, 1)]
    assert [e["code"] for e in exits] == [143, 143]
    assert exits[0]["step"] == exits[1]["step"] > at  # one agreed step, after the signal
    assert ended - signalled < 30, ended - signalled
    last = tmp_path / "stopped" / "ckpts" / "last.ckpt"
    assert json.loads((last / "pipeline.json").read_text())["step"] == exits[0]["step"]

    resumed = run(tmp_path / "stopped", "--sync", sync, "--resume")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    straight = run(tmp_path / "straight", "--sync", sync)
    assert straight.returncode == 0, straight.stderr[-3000:]
    got = torch.load(tmp_path / "stopped" / "weights.pt")
    want = torch.load(tmp_path / "straight" / "weights.pt")
    assert got.keys() == want.keys()
    for key in want:
        if sync == "flush":
            assert torch.equal(got[key], want[key]), key
        else:  # the drain at the agreed step changes the staleness of the minibatches in flight
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=2e-3)


class _Stopped(Exception):
    pass


def _agree(rank: int, world: int, signal_at: int) -> dict:
    """60 steps of ``at_step`` with no work between them (steps far below MIN_INTERVAL); rank 1
    records SIGUSR1 at step ``signal_at``. Returns the steps at which this rank posted and the
    step at which it was told to stop."""
    from pl_pipedream.strategy import preemption

    posted: list[int] = []
    original = preemption.dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        posted.append(step)
        return original(*args, **kwargs)

    def stop(trainer, strategy, signum):  # type: ignore[no-untyped-def]
        raise _Stopped(signum)

    preemption.dist.all_reduce = counted
    preemption.stop_fit = stop
    watch = preemption.Preemption((signal.SIGUSR1,))

    class Strategy:
        timeout = 30.0

    stopped = None
    try:
        for step in range(60):
            if rank == 1 and step == signal_at:
                watch._record(int(signal.SIGUSR1), None)
            watch.at_step(None, Strategy())
    except _Stopped as error:
        stopped = (step, error.args[0])
    watch.finish(failed=stopped is not None)
    return {"posted": posted, "stopped": stopped}


@pytest.mark.slow
def test_short_steps_share_an_agreement_at_the_same_steps_on_every_rank() -> None:
    from pl_pipedream.strategy.preemption import MAX_PERIOD
    from tests.runtime.distributed import run as run_ranks

    results = run_ranks(2, _agree, 30, timeout=60.0)
    (status0, got0), (status1, got1) = results[0], results[1]
    assert status0 == "ok" and status1 == "ok", (got0, got1)
    assert got0["posted"] == got1["posted"]  # the same steps on both ranks
    posted = got0["posted"]
    assert len(posted) < 30  # fewer posts than steps: sub-millisecond steps share them
    assert max(b - a for a, b in zip(posted, posted[1:], strict=False)) <= MAX_PERIOD
    # both stop at the same step, within lag (2) posts of MAX_PERIOD steps after the signal
    assert got0["stopped"] == got1["stopped"]
    step, signum = got0["stopped"]
    assert signum == int(signal.SIGUSR1) and 30 <= step <= 30 + 3 * MAX_PERIOD
