"""Keep each CPU rank on cores of its own, so that no two stages share a core.

A pipeline runs at the pace of its slowest stage. When the ranks of one node may all run on the
same cores, the kernel decides where each one runs, and it may put two busy ranks on one core
for seconds at a time while another core idles, and the whole pipeline then runs at that core's
pace (``benchmarks/pipeline_throughput.py``'s header has the measurements). Binding each local
rank to its share of the cores, as CPU launchers do for data parallelism, takes that choice away
from the kernel.

Only ranks that could all run on the same cores are bound: a launcher that has already given
each rank cores of its own (SLURM's ``--cpu-bind``, ``taskset`` per rank) is left alone.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

__all__ = ["bind_threads", "cpu_share", "current_cpus"]


def current_cpus() -> frozenset[int] | None:
    """The cores this process may run on, or None where the OS does not say (macOS, Windows)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    return frozenset(os.sched_getaffinity(0))


def cpu_share(
    pools: Sequence[frozenset[int] | None], local_ranks: Sequence[int], rank: int
) -> frozenset[int] | None:
    """The cores ``rank`` should be bound to, or None to leave it where it is.

    ``pools[r]`` is the set of cores rank r may run on and ``local_ranks`` the ranks on this
    rank's node, in local-rank order. When they all have the same pool, with at least one core
    per rank, local rank i gets the i-th of equal contiguous slices of it (the remainder is
    left unused, as Lightning's thread count ``cpu_count // ranks`` leaves it)."""
    pool = pools[rank]
    if pool is None or len(local_ranks) < 2:
        return None
    if any(pools[other] != pool for other in local_ranks):
        return None  # already placed by the launcher: keep its choice
    size = len(pool) // len(local_ranks)
    if size == 0:
        return None  # more ranks than cores: binding cannot keep them apart
    index = list(local_ranks).index(rank)
    return frozenset(sorted(pool)[index * size : (index + 1) * size])


def bind_threads(cpus: frozenset[int]) -> None:
    """Bind every thread of this process to ``cpus``; threads started later inherit it.

    ``sched_setaffinity`` acts on one thread, and by now the process has several (gloo's, the
    launcher's), so each thread listed in ``/proc/self/task`` is bound in turn; one that ended
    meanwhile is skipped."""
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except ProcessLookupError:
            continue
