"""Time the planner on every published PipeDream profile and every topology, against 1 s each.

Run: python benchmarks/planner_speed.py [--repeats 3] [--profiles DIR] [--profile NAME ...]
(default: the published profiles that ship with the package, ``pl_pipedream.published``).
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
from pl_pipedream.published import load_profile, profile_names

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


def profiles(directory: Path | None, names: list[str] | None) -> dict[str, Profile]:
    """Every profile in ``directory`` (default: the published ones), or only ``names``, by name."""
    found: dict[str, Path | None]
    if directory is None:
        found = {name: None for name in profile_names()}
    else:
        found = {p.stem: p for p in sorted(directory.glob("*.txt")) if p.stem != "LICENSE"}
    if names:
        missing = sorted(set(names) - set(found))
        if missing:
            raise SystemExit(
                f"no such profile in {directory or 'pl_pipedream.published'} (profile: "
                f"{', '.join(missing)}); pick from {', '.join(found)}"
            )
        found = {name: path for name, path in found.items() if name in names}
    return {
        name: load_profile(name) if path is None else Profile.load(path)
        for name, path in found.items()
    }


def main(argv: list[str] | None = None) -> bool:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profiles", type=Path, help="a folder of <name>.txt profiles")
    parser.add_argument("--profile", action="append", help="only this profile (repeatable)")
    parser.add_argument("--limit", type=float, default=1.0, help="seconds per case")
    args = parser.parse_args(argv)
    header = f"{'profile':<14} {'topology':<22} {'states':>6} {'shape':<28}"
    print(f"{header} {'slowest s':>11} {'seconds':>7} {'cpu s':>6}", flush=True)
    worst = (0.0, "")
    worst_cpu = 0.0
    for name, profile in profiles(args.profiles, args.profile).items():
        for label, topology in TOPOLOGIES.items():
            times, cpu = [], []
            for _ in range(max(args.repeats, 1)):
                start, start_cpu = time.perf_counter(), time.process_time()
                result = plan(profile, topology)
                times.append(time.perf_counter() - start)
                cpu.append(time.process_time() - start_cpu)
            states = f"{result.meta['states']}{'*' if result.meta['cuts'] == 'topological' else ''}"
            print(
                f"{name:<14} {label:<22} {states:>6} {result.shape:<28} "
                f"{result.slowest_stage_time:>11.6g} {min(times):>7.3f} {min(cpu):>6.3f}",
                flush=True,
            )
            worst = max(worst, (min(times), f"{name} on {label}"))
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
