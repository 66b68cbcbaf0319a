"""Time the planner on every published PipeDream profile (16 workers) and print the figures.

Run: python benchmarks/planner_speed.py [--repeats 3] [--profiles DIR]
Each figure is the best of ``--repeats`` wall-clock runs of ``plan`` (profile already loaded),
for a flat 16-worker topology at 1e9 B/s and two hierarchical 16-worker topologies.
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
    "16 @ 1e9": Topology.from_lists([16], [1e9]),
    "4x4 @ 1e10,1.25e9": Topology.from_lists([4, 4], [1e10, 1.25e9]),
    "8x2 @ 2.5e10,3.125e9": Topology.from_lists([8, 2], [2.5e10, 3.125e9]),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--profiles", type=Path, default=DEFAULT)
    args = parser.parse_args()
    header = f"{'profile':<14} {'topology':<22} {'states':>6} {'shape':<28}"
    print(f"{header} {'slowest s':>11} {'best s':>7}")
    for path in sorted(args.profiles.glob("*.txt")):
        if path.stem == "LICENSE":
            continue
        profile = Profile.load(path)
        for label, topology in TOPOLOGIES.items():
            times = []
            for _ in range(args.repeats):
                start = time.perf_counter()
                result = plan(profile, topology)
                times.append(time.perf_counter() - start)
            states = f"{result.meta['states']}{'*' if result.meta['cuts'] == 'topological' else ''}"
            print(
                f"{path.stem:<14} {label:<22} {states:>6} {result.shape:<28} "
                f"{result.slowest_stage_time:>11.6g} {min(times):>7.3f}"
            )
    print("* states are prefixes of one topological order (too many antichains)")


if __name__ == "__main__":
    main()
