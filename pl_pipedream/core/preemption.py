"""Preemption agreement: a signal to any rank stops every rank at one step.

SLURM and Kubernetes send SIGTERM (SLURM with ``--signal=USR1@90``: SIGUSR1) some time before
they kill a job. While training, the handler for each of the signals only records it. At the
start of a training step each rank posts, without waiting, an all-reduce (max) of the signal it
has recorded (0 for none) over a process group of its own, and waits for the one it posted
``lag`` posts earlier (``lag`` = the number of ranks, so that the first stage may run as far
ahead of the last as 1F1B lets it). Every rank thus reads the same value at the same step: the
first non-zero one stops them all there (``stop(signum)``), whether the signal reached one rank
(one node of several preempted) or all of them at once (``scancel``). What stopping means (drain,
save, exit with ``exit_code``) is the front end's (``strategy.preemption.stop_fit``).

Posting an all-reduce costs about 0.1-0.2 ms of CPU on a gloo group, which steps of a
millisecond or two notice (docs/performance.md). So a post happens every ``period`` steps, not
every step: the all-reduce also carries each rank's time per step since its previous post, and
the agreed (largest) one sets the next period to the steps that fill ``MIN_INTERVAL`` seconds,
at most ``MAX_PERIOD``. Every rank reads the same agreed values at the same post, so every rank
posts at the same steps; a signal stops the ranks within ``lag`` posts, about
``lag x max(MIN_INTERVAL, one step)`` after it arrives.
"""

from __future__ import annotations

import collections
import math
import signal
import time
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pl_pipedream.runtime.channel import PeerError
from pl_pipedream.runtime.ranks import describe, group_failure

__all__ = ["MAX_PERIOD", "MIN_INTERVAL", "Preempted", "Preemption", "exit_code", "parse_signals"]

MIN_INTERVAL = 0.03  # seconds: steps shorter than this share one agreement
MAX_PERIOD = 8  # steps between two agreements at most


class Preempted(SystemExit):
    """Raised on every rank at the agreed step, after the checkpoint; its code is the exit
    status (``exit_code``)."""


def parse_signals(names: Sequence[str | int | signal.Signals]) -> tuple[signal.Signals, ...]:
    """``("SIGTERM", "USR1", 15, signal.SIGUSR1)`` as signals; an unknown name is refused."""
    parsed = []
    for name in names:
        try:
            if isinstance(name, str):
                upper = name.upper()
                parsed.append(signal.Signals[upper if upper.startswith("SIG") else "SIG" + upper])
            else:
                parsed.append(signal.Signals(name))
        except (KeyError, ValueError):
            raise ValueError(
                f"preempt_signals must name signals (preempt_signals: {tuple(names)!r}); for "
                'example preempt_signals=("SIGTERM", "SIGUSR1"), or () for none'
            ) from None
        if parsed[-1] in (signal.SIGKILL, signal.SIGSTOP):
            raise ValueError(
                f"SIGKILL and SIGSTOP cannot be caught (preempt_signals: {tuple(names)!r}); ask "
                "the scheduler for a signal before the kill, e.g. SLURM's --signal=USR1@90"
            )
    return tuple(dict.fromkeys(parsed))


def exit_code(signum: int) -> int:
    """The exit status of a preempted rank: 128 + the signal's number, the status of a process
    that the signal ended, so the scheduler accounts the job as ended by it."""
    return 128 + int(signum)


class Preemption:
    """The recorded signal and the per-step agreement of one fit (see the module docstring)."""

    def __init__(self, signals: tuple[signal.Signals, ...]) -> None:
        self.signals = signals
        self.received = 0  # the signal this rank recorded (its number), 0 for none
        self.group: Any = None
        self._pending: collections.deque[tuple[Any, torch.Tensor]] = collections.deque()
        self._lag = 1
        self._step = 0  # training steps seen in this fit
        self._next = 0  # the step of the next post
        self._period = 1  # steps between posts, as last agreed
        self._posted_at = 0.0  # this rank's clock at its last post
        self._previous: dict[signal.Signals, Any] = {}
        self._started = False

    def _record(self, signum: int, frame: Any) -> None:
        """The handler: records the signal, nothing else (no collective, no I/O)."""
        self.received = max(self.received, int(signum))

    def start(self, timeout: float) -> None:
        """At the first training step, on every rank: the agreement's group, then the handlers
        (which replace the front end's for these signals until ``finish``)."""
        self._started = True
        self._step = self._next = 0
        self._period = 1
        if not self.signals or not dist.is_initialized():
            return
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout))
        self._lag = dist.get_world_size()
        for signum in self.signals:
            self._previous[signum] = signal.signal(signum, self._record)

    def at_step(self, timeout: float, stop: Callable[[int], None]) -> None:
        """At the start of each training step, on every rank: post this rank's signal, and
        call ``stop(signum)`` when the value agreed ``lag`` posts ago is a signal. The first
        call starts the fit's agreement (``start(timeout)``)."""
        if not self._started:
            self.start(timeout)
        if self.group is None:
            return
        step, self._step = self._step, self._step + 1
        if step < self._next:
            return
        now = time.perf_counter()
        per_step = 0 if step == 0 else (now - self._posted_at) / self._period
        self._posted_at = now
        flag = torch.tensor([self.received, int(per_step * 1e6)], dtype=torch.int64)
        work = dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._pending.append((work, flag))
        self._next = step + self._period
        if len(self._pending) <= self._lag:
            return
        work, agreed = self._pending.popleft()
        self._wait(work, timeout)
        signum, micros = (int(v) for v in agreed.tolist())
        if signum:
            self._pending.clear()  # every rank stops here: none waits for the rest
            stop(signum)
        fill = math.ceil(MIN_INTERVAL * 1e6 / micros) if micros else 1
        self._period = max(1, min(MAX_PERIOD, fill))
        self._next = step + self._period

    def _wait(self, work: Any, timeout: float) -> None:
        """Wait for an agreement posted earlier; a rank that stopped fails it on every other
        rank, named as the backend cannot (``runtime.ranks.group_failure``)."""
        start = time.perf_counter()
        try:
            work.wait()
        except RuntimeError as error:
            me, world = dist.get_rank(), dist.get_world_size()
            others = [describe(rank) for rank in range(world) if rank != me]
            waited = time.perf_counter() - start
            text = group_failure(
                describe(me), "the preemption signals", "peer", others, error, waited, timeout
            )
            raise PeerError(text) from None

    def finish(self, failed: bool) -> None:
        """At the end of training: the handlers back, and the group given back (after the
        reductions under way, which every rank posted, unless the fit failed)."""
        self._started = False
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
        group, self.group = self.group, None
        if group is None or (failed and self._pending):
            return  # a peer that failed may never join the reductions under way
        for work, _ in self._pending:
            work.wait()
        self._pending.clear()
        dist.destroy_process_group(group)
