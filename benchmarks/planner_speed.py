"""Time the planner on every published PipeDream profile and every topology, against 1 s each.

Run: python benchmarks/planner_speed.py [--repeats 3] [--profiles DIR] [--profile NAME ...]
Each figure is the best of ``--repeats`` runs of ``plan`` (profile already loaded), in wall-clock
seconds and in CPU seconds of this process (on a machine shared with other work, the CPU time
is what the run would take alone; the verdict is on wall-clock time).
Topologies, levels innermost first: flat 2, 4, 8 and 16 workers at 1e9 B/s; servers of 8 GPUs
on 2.5e10 B/s links joined at 3.125e9 B/s (8x2); servers of 4 or 2 GPUs on 1e10 B/s joined at
1.25e9 B/s (4x4, 4x2, 2x8, 2x4). The last line says whether every case planned in under
``--limit`` seconds.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from pl_pipedream.planner.optimize import plan
from pl_pipedream.planner.topology import Topology
from pl_pipedream.profile.graph import Profile

DEFAULT = Path(__file__).resolve().parents[2] / "shared" / "data" / "pipedream_profiles"
TOPOLOGIES = {
    "2 @ 1e9": Topology.from_lists([2], [1e9]),
    "4 @ 1e9": Topology.from_lists([4], [1e9]),
    "8 @ 1e9": Topology.from_lists([8], [1e9]),
    "16 @ 1e9": Topology.from_lists([16], [1e9]),
    "4x4 @ 1e10,1.25e9": Topology.from_lists([4, 4], [1e10, 1.25e9]),
    "8x2 @ 2.5e10,3.125e9": Topology.from_lists([8, 2], [2.5e10, 3.125e9]),
    "2x8 @ 1e10,1.25e9": Topology.from_lists([2, 8], [1e10, 1.25e9]),
    "2x4 @ 1e10,1.25e9": Topology.from_lists([2, 4], [1e10, 1.25e9]),
    "4x2 @ 1e10,1.25e9": Topology.from_lists([4, 2], [1e10, 1.25e9]),
}


def profiles(directory: Path, names: list[str] | None) -> list[Path]:
    """Every published profile in ``directory`` (or only ``names``), by name."""
    found = sorted(p for p in directory.glob("*.txt") if p.stem != "LICENSE")
    if names:
        missing = sorted(set(names) - {p.stem for p in found})
        if missing:
            raise SystemExit(
                f"no such profile in {directory} (profile: {', '.join(missing)}); pick from "
                f"{', '.join(p.stem for p in found)}"
            )
        found = [p for p in found if p.stem in names]
    return found


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profiles", type=Path, default=DEFAULT)
    parser.add_argument("--profile", action="append", help="only this profile (repeatable)")
    parser.add_argument("--limit", type=float, default=1.0, help="seconds per case")
    args = parser.parse_args(argv)
    header = f"{'profile':<14} {'topology':<22} {'states':>6} {'shape':<28}"
    print(f"{header} {'slowest s':>11} {'seconds':>7} {'cpu s':>6}", flush=True)
    worst = (0.0, "")
    worst_cpu = 0.0
    for path in profiles(args.profiles, args.profile):
        profile = Profile.load(path)
        for label, topology in TOPOLOGIES.items():
            times, cpu = [], []
            for _ in range(max(args.repeats, 1)):
                start, start_cpu = time.perf_counter(), time.process_time()
                result = plan(profile, topology)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            states = f"{result.meta['states']}{'*' if result.meta['cuts'] == 'topological' else ''}"
            print(
                f"{path.stem:<14} {label:<22} {states:>6} {result.shape:<28} "
                f"{result.slowest_stage_time:>11.6g} {min(times):>7.3f} {min(cpu):>6.3f}",
                flush=True,
            )
            worst = max(worst, (min(times), f"{path.stem} on {label}"))
            worst_cpu = max(worst_cpu, min(cpu))
    print("* states are prefixes of one topological order (too many antichains)")
    under = worst[0] < args.limit
    verdict = "yes" if under else "NO"
    print(
        f"every case under {args.limit:g} s: {verdict} (slowest: {worst[1]}, {worst[0]:.3f} s; "
        f"most CPU time of any case: {worst_cpu:.3f} s)"
    )
    return under


if __name__ == "__main__":
    main()
