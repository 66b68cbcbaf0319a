"""The preemption agreement: signal names, the exit status, and ranks that agree on one step to
stop at, posting at the same steps when steps are short."""

from __future__ import annotations

import signal

import pytest

from pl_pipedream.core import preemption
from pl_pipedream.core.preemption import MAX_PERIOD, Preemption, exit_code, parse_signals
from tests.runtime.distributed import run as run_ranks


def test_signals_are_parsed_and_uncatchable_ones_refused() -> None:
    assert parse_signals(("SIGTERM", "usr1", 15)) == (signal.SIGTERM, signal.SIGUSR1)
    assert exit_code(signal.SIGTERM) == 143 and exit_code(signal.SIGUSR1) == 138
    with pytest.raises(ValueError, match="preempt_signals must name signals"):
        parse_signals(("SIGNOPE",))
    with pytest.raises(ValueError, match="SIGKILL and SIGSTOP cannot be caught"):
        parse_signals(("SIGKILL",))


def test_without_a_process_group_nothing_is_posted_and_the_handlers_stay() -> None:
    before = signal.getsignal(signal.SIGUSR1)
    watch = Preemption((signal.SIGUSR1,))
    stopped: list[int] = []
    for _ in range(3):
        watch.at_step(30.0, stopped.append)
    assert watch.group is None and stopped == []
    assert signal.getsignal(signal.SIGUSR1) is before
    watch.finish(failed=False)


class _Stopped(Exception):
    pass


def _agree(rank: int, world: int, signal_at: int) -> dict:
    """60 steps of ``at_step`` with no work between them (steps far below MIN_INTERVAL); rank 1
    records SIGUSR1 at step ``signal_at``. Returns the steps at which this rank posted and the
    step at which it was told to stop."""
    posted: list[int] = []
    original = preemption.dist.all_reduce

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        posted.append(step)
        return original(*args, **kwargs)

    def stop(signum: int) -> None:
        raise _Stopped(signum)

    preemption.dist.all_reduce = counted  # (in the rank's own process)
    watch = Preemption((signal.SIGUSR1,))
    stopped = None
    try:
        for step in range(60):
            if rank == 1 and step == signal_at:
                watch._record(int(signal.SIGUSR1), None)
            watch.at_step(30.0, stop)
    except _Stopped as error:
        stopped = (step, error.args[0])
    watch.finish(failed=stopped is not None)
    return {"posted": posted, "stopped": stopped}


@pytest.mark.slow
def test_short_steps_share_an_agreement_at_the_same_steps_on_every_rank() -> None:
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
