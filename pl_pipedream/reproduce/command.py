"""``pl-pipedream reproduce [ROW ...|all]``: its arguments and its run.

Reads the rows (``table``), plans and simulates them (``predict``), and prints the table with
the assumptions under it (``report``); ``--markdown``, ``--png`` (``chart``) and ``--json`` write
it too. A chart asked for without matplotlib installed is refused before any row is planned.
Like the rest of the CLI this module imports neither torch nor Lightning.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from pl_pipedream.reproduce.chart import require_matplotlib, write_png
from pl_pipedream.reproduce.epochs import DEFAULT_SPEED_FACTOR
from pl_pipedream.reproduce.predict import predict
from pl_pipedream.reproduce.report import assumptions, render_markdown, render_text
from pl_pipedream.reproduce.table import read_table, select

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The subcommand's arguments, added to ``parser``."""
    parser.add_argument(
        "rows", nargs="*", default=["all"], help="row ids (e.g. vgg16_A_4x4) or all (default)"
    )
    parser.add_argument(
        "--table",
        type=Path,
        metavar="PATH",
        help="Table 1 CSV (default: the checked table that ships with the package)",
    )
    parser.add_argument(
        "--profiles",
        type=Path,
        metavar="DIR",
        help="PipeDream's profiles, <name>.txt (default: the published ones the package ships)",
    )
    parser.add_argument(
        "--markdown", type=Path, metavar="PATH", help="also write the table as Markdown here"
    )
    parser.add_argument("--png", type=Path, metavar="PATH", help="also draw the speedups here")
    parser.add_argument("--json", action="store_true", help="print one JSON list of rows")
    parser.add_argument(
        "--speed-factor",
        type=float,
        default=DEFAULT_SPEED_FACTOR,
        help="how much faster a V100 is than one thread of this CPU (default: %(default)s)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        help="our profiles' cache (default: reproduce_cache beside --markdown/--png, else in .)",
    )
    parser.add_argument(
        "--no-own-profile", action="store_true", help="plan from the published profiles only"
    )
    parser.add_argument(
        "--microbatches",
        type=int,
        metavar="M",
        help="GPipe's microbatches per flush (default: 4 per stage)",
    )


def run(args: argparse.Namespace) -> int:
    """Plan, simulate and print the rows ``args`` names; 0 when done."""
    if args.png:
        require_matplotlib(args.png)
    cache = None
    if not args.no_own_profile:
        outputs = [p for p in (args.markdown, args.png) if p is not None]
        cache = args.cache or (outputs[0].parent if outputs else Path.cwd()) / "reproduce_cache"
    outcomes = predict(
        select(read_table(args.table), args.rows),
        args.profiles,
        cache,
        args.speed_factor,
        args.microbatches,
    )
    rates = sorted({o.own_meta.get("gemm_gflops", "") for o in outcomes if o.own_meta} - {""})
    notes = assumptions(rates, args.speed_factor, args.microbatches, not args.no_own_profile)
    if args.markdown:
        args.markdown.write_text(render_markdown(outcomes, notes))
    if args.png:
        write_png(outcomes, args.png)
    if args.json:
        print(json.dumps([outcome.to_dict() for outcome in outcomes]))
    else:
        print(render_text(outcomes))
        print()
        print(notes)
    return 0
