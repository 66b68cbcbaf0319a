"""``pl-pipedream``: plan a pipeline from a profile, and simulate its schedule.

Subcommands:

* ``plan --profile PATH --workers N [N ...] --bandwidth B [B ...]`` runs PipeDream's optimizer
  and prints the stages (or one JSON object with ``--json``);
* ``simulate`` plans the same way (or reads ``--plan plan.json``), builds the schedule of a sync
  mode, validates every rank's list (the full check, which a rank at setup runs only over its
  neighbourhood) and prints its timeline and figures;
* ``reproduce [ROW ...|all]`` plans PipeDream's published profiles for the rows of the paper's
  Table 1 and prints the paper's configuration and speedup beside the planner's
  (``pl_pipedream.reproduce``);
* ``checkpoint inspect|to-torch|to-lightning|from-torch`` prints a sharded checkpoint, writes
  it as one plain state dict or as one Lightning checkpoint file that one device resumes from,
  or makes one from a plain state dict (``apps.checkpoint_command``, which loads torch only when
  it runs).

This module imports neither torch nor Lightning (planner and schedule are pure Python), so
no planning command pays for loading them.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from pl_pipedream.apps.checkpoint_command import add_arguments as add_checkpoint_arguments
from pl_pipedream.apps.checkpoint_command import run as run_checkpoint
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan, PlanError
from pl_pipedream.planner.states import StateSpaceError
from pl_pipedream.planner.topology import Topology, TopologyError
from pl_pipedream.profile.graph import Profile, ProfileError
from pl_pipedream.reproduce.command import add_arguments as add_reproduce_arguments
from pl_pipedream.reproduce.command import run as run_reproduce
from pl_pipedream.schedule.modes import SYNC_MODES, SyncMode

__all__ = ["main"]


def _add_planning_arguments(parser: argparse.ArgumentParser, required: bool) -> None:
    parser.add_argument("--profile", required=required, help="graph.txt (PipeDream) or .json")
    parser.add_argument(
        "--workers",
        type=int,
        nargs="+",
        help="workers per topology level, innermost first (e.g. 4 4: 4 servers of 4 GPUs)",
    )
    parser.add_argument(
        "--bandwidth",
        type=float,
        nargs="+",
        help="bandwidth of each level in bytes/s, innermost first (e.g. 1e10 1.25e9)",
    )
    parser.add_argument("--straight", action="store_true", help="no replicated stages")
    parser.add_argument(
        "--memory", type=float, default=None, help="memory per worker in bytes (constraint)"
    )
    parser.add_argument(
        "--cuts",
        choices=("auto", "antichain", "topological"),
        default="auto",
        help="cuts the DP considers: every legal cut (antichain), prefixes of one topological "
        "order, or auto (antichains unless there are too many)",
    )
    parser.add_argument(
        "--ignore-transfers",
        action="store_true",
        help="leave activation transfers out of the cost model",
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="pl-pipedream",
        description="PipeDream pipeline planning, schedule simulation and checkpoints.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    plan_parser = commands.add_parser("plan", help="partition a profiled model over a topology")
    _add_planning_arguments(plan_parser, required=True)
    plan_parser.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per batch: only plans whose replica counts divide it (1F1B-RR)",
    )
    plan_parser.add_argument("--json", action="store_true", help="print one JSON object")
    plan_parser.add_argument("--output", help="also write the plan as JSON to this file")

    simulate = commands.add_parser("simulate", help="simulate the schedule of a plan")
    _add_planning_arguments(simulate, required=False)
    simulate.add_argument("--plan", help="a plan JSON written by 'pl-pipedream plan --output'")
    simulate.add_argument("--sync", default=SyncMode.ASYNC.value, choices=SYNC_MODES)
    simulate.add_argument("--batches", type=int, default=8, help="Lightning batches to simulate")
    simulate.add_argument(
        "--microbatches",
        type=int,
        default=None,
        help="microbatches per batch (default: the smallest count every stage's replicas share)",
    )
    simulate.add_argument(
        "--link-bandwidth",
        type=float,
        default=None,
        help="bytes/s between stages in the simulation (default: the outermost level's)",
    )
    simulate.add_argument(
        "--weight-share",
        type=float,
        default=0.5,
        help="part of a backward spent on weight gradients, for modes that split it (0..1)",
    )
    simulate.add_argument(
        "--compare",
        action="store_true",
        help="also simulate every mode on the plan (a split mode such as zero_bubble, or one "
        "of several stages per rank, is always compared with the flushed modes; interleaved "
        "and zbv run the plan recut into two chunks per rank)",
    )
    simulate.add_argument("--json", action="store_true", help="print the figures as JSON")
    simulate.add_argument("--no-table", action="store_true", help="omit the timeline table")

    reproduce = commands.add_parser(
        "reproduce", help="PipeDream's Table 1 beside the planner's prediction for each row"
    )
    add_reproduce_arguments(reproduce)

    checkpoint = commands.add_parser(
        "checkpoint",
        help="inspect a checkpoint, or convert it to or from a plain state dict or .ckpt file",
    )
    add_checkpoint_arguments(checkpoint)
    return parser


def _topology(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Topology:
    if not args.workers or not args.bandwidth:
        parser.error(
            "--workers and --bandwidth are required to plan (e.g. --workers 4 --bandwidth 1e9)"
        )
    return Topology.from_lists(args.workers, args.bandwidth)


def _planned(args: argparse.Namespace, parser: argparse.ArgumentParser) -> Plan:
    profile = Profile.load(args.profile)
    return make_plan(
        profile,
        _topology(args, parser),
        straight=args.straight,
        memory=args.memory,
        transfers=not args.ignore_transfers,
        cuts=args.cuts,
        microbatches=args.microbatches,  # a plan the batch's microbatches can serve
    )


def _run_plan(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    result = _planned(args, parser)
    if args.output:
        with open(args.output, "w") as handle:
            handle.write(result.to_json())
    print(json.dumps(result.to_dict()) if args.json else result.render())
    return 0


def _read_plan(path: str) -> Plan:
    """The plan in ``path``, or a ``PlanError`` naming the file and how to write a good one:
    a user who mistypes the name or passes another file should not have to read a traceback."""
    again = f"write it with 'pl-pipedream plan ... --output {path}'"
    try:
        with open(path) as handle:
            text = handle.read()
    except OSError as error:
        raise PlanError(
            f"the plan file must be a readable file (plan: {path}, {error.strerror}); "
            f"check the path, or {again}"
        ) from error
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise PlanError(
            f"a plan file must be JSON (plan: {path}, line {error.lineno} column "
            f"{error.colno}: {error.msg}); {again}"
        ) from error
    try:
        return Plan.from_dict(data)
    except (KeyError, TypeError, AttributeError, ValueError) as error:
        raise PlanError(
            f"a plan file must hold a plan written by 'pl-pipedream plan --output' (plan: "
            f"{path}, {type(error).__name__}: {error}); {again}"
        ) from error


def _run_simulate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    from pl_pipedream.schedule import build, render, rules, simulate, validate
    from pl_pipedream.schedule.compare import compare, plan_for, render_comparison

    if args.plan:
        chosen = _read_plan(args.plan)
    elif args.profile:
        chosen = _planned(args, parser)
    else:
        parser.error("simulate needs --plan FILE, or --profile with --workers and --bandwidth")
    bandwidth = args.link_bandwidth
    if bandwidth is None and chosen.topology is not None:
        bandwidth = chosen.topology.levels[-1].bandwidth
    mode = SyncMode.parse(args.sync)
    shown = plan_for(chosen, mode)  # recut into chunks for a mode of several stages per rank
    microbatches = args.microbatches
    if microbatches is None:
        microbatches = rules.fewest_microbatches(shown, mode)
    schedule = build(shown, mode, args.batches, microbatches)
    validate(schedule)
    times = {"bandwidth": bandwidth, "weight_share": args.weight_share}
    result = simulate(schedule, **times)
    modes = list(SyncMode) if args.compare else [m for m in SyncMode if m.flushes]
    rows = compare(chosen, modes, args.batches, microbatches, **times)
    show = args.compare or mode.splits_backward or mode.chunked
    if args.json:
        figures = result.to_dict()
        if show:
            figures["compare"] = [row.to_dict() for row in rows]
        print(json.dumps(figures))
        return 0
    print(shown.render())
    print()
    if not args.no_table:
        print(render(schedule))
        print()
    print(result.describe())
    if show:
        print()
        print(render_comparison(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "plan":
            return _run_plan(args, parser)
        if args.command == "reproduce":
            return run_reproduce(args)
        if args.command == "checkpoint":
            return run_checkpoint(args)
        return _run_simulate(args, parser)
    except (ProfileError, PlanError, TopologyError, StateSpaceError, ValueError) as error:
        print(f"pl-pipedream {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
