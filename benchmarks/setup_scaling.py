"""Time the library's own schedule setup per rank on straight pipelines of 16, 64 and 256 stages.

Run: python benchmarks/setup_scaling.py [--stages 16 64 256] [--sync async flush ...]
[--whole-up-to 16]

What a rank does when its pipeline is built (``PipelineRunner``): ``SegmentStream.of_rank``,
which builds and validates the schedule its segments are cut from over its neighbourhood (its
stage and the next ones, and the input stage's), then cuts its first segment. No process is
started. ``setup s`` (and ``cpu s``, its CPU time: on a shared machine, what it would take
alone) is the slowest of ranks 0, S/2 and S-1 (the middle one holds the most
lists); ``drain s`` is the slowest first drain of those ranks at a step past the warm-up (the
largest schedule a drain is cut from, built and checked when first asked for). ``m`` is 1 and S
(2bw needs m >= S). With ``--whole-up-to N`` it also times, for S <= N, the full check of every
rank's schedules (``SegmentStream(...).validate()``, what the tests run). The last line says
whether every setup at 64 stages took under ``--limit`` seconds.
"""

from __future__ import annotations

import argparse
import time

from pl_pipedream.planner.plan import Plan
from pl_pipedream.schedule import SYNC_MODES, SegmentStream, SyncMode


def rank_setup(plan: Plan, sync: str, m: int, rank: int) -> tuple[float, float, float]:
    """Wall-clock and CPU seconds of rank's setup (stream built and checked, first segment
    cut), and wall-clock seconds of its first drain at a step past the warm-up."""
    start, start_cpu = time.perf_counter(), time.process_time()
    stream = SegmentStream.of_rank(plan, sync, m, rank)
    stream.segment(rank, 0)
    setup, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    start = time.perf_counter()
    stream.drain(rank, stream.steady_from + 1)
    return setup, cpu, time.perf_counter() - start


def whole(plan: Plan, sync: str, m: int) -> float:
    start = time.perf_counter()
    SegmentStream(plan, SyncMode.parse(sync), m).validate()
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", type=int, nargs="+", default=[16, 64, 256])
    parser.add_argument("--sync", nargs="+", default=list(SYNC_MODES), choices=SYNC_MODES)
    parser.add_argument("--whole-up-to", type=int, default=0, help="full check up to S stages")
    parser.add_argument("--limit", type=float, default=1.0, help="seconds per rank at 64 stages")
    args = parser.parse_args(argv)
    head = f"{'stages':>6} {'sync':<14} {'m':>4} {'setup s':>8} {'cpu s':>7} {'drain s':>8}"
    print(f"{head} {'whole s':>8}")
    worst_64 = (0.0, 0.0)
    for stages in args.stages:
        plan = Plan.from_balance([1] * stages)
        for sync in args.sync:
            for m in sorted({1, stages}):
                if m < SyncMode.parse(sync).min_microbatches(stages):
                    continue
                ranks = sorted({0, stages // 2, stages - 1})
                setup, cpu, drain = map(
                    max, zip(*(rank_setup(plan, sync, m, r) for r in ranks), strict=True)
                )
                full = (
                    f"{whole(plan, sync, m):8.2f}" if stages <= args.whole_up_to else "-".rjust(8)
                )
                print(
                    f"{stages:>6} {sync:<14} {m:>4} {setup:>8.3f} {cpu:>7.3f} {drain:>8.3f} {full}",
                    flush=True,
                )
                if stages == 64:
                    worst_64 = max(worst_64, (setup, cpu))
    under = worst_64[0] < args.limit
    print(
        f"every setup at 64 stages under {args.limit:g} s: {'yes' if under else 'NO'} "
        f"(slowest: {worst_64[0]:.3f} s, CPU {worst_64[1]:.3f} s)"
    )
    return under


if __name__ == "__main__":
    main()
