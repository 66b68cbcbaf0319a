"""docs/errors.md, "Errors you may see": every row of the table, each bad input given for real.

One row per bad input (model, batch, config, CLI arguments, profile, plan, checkpoint): the
input is built, handed to the public entry point a user calls, and the error's text must hold
the row's key words (what rule was broken, the value, and the fix). Rows run in one process;
a row whose error needs several ranks names the multi-process test that covers it instead.
The table itself must list every row here, with the row's key words in its error column.
``python -m tests.test_bad_inputs`` prints each row's full message (to refresh the table).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from torch import nn

from pl_pipedream import PipeDreamStrategy, Pipeline, Topology, consolidate_checkpoint
from pl_pipedream.apps.cli import main as cli
from pl_pipedream.apps.train import apply_smoke, check_machine, num_processes
from pl_pipedream.core.stage import pipeline_layers
from pl_pipedream.engine.arguments import choose_plan
from pl_pipedream.planner.optimize import plan as make_plan
from pl_pipedream.planner.plan import Plan
from pl_pipedream.profile.graph import Profile
from pl_pipedream.schedule import SegmentStream
from pl_pipedream.strategy.batches import first_stage_input, slice_batch

ERRORS_PAGE = Path(__file__).resolve().parents[1] / "docs" / "errors.md"

NODE = (
    "{id} -- Linear(4, 4) -- forward_compute_time={f}, backward_compute_time=2.5, "
    "activation_size=64.0, parameter_size=80.0"
)


@dataclass(frozen=True)
class Row:
    """A bad input: its kind, what is wrong, how to make it, and the error's key words."""

    kind: str
    bad: str
    make: Callable[[Path], object]
    words: tuple[str, ...]


def _run_cli(*argv: str) -> Callable[[Path], object]:
    """``pl-pipedream ARGV`` in ``tmp``; raises with stderr as the message unless it exited 2."""

    def run(tmp: Path) -> object:
        import contextlib
        import io

        err = io.StringIO()
        args = [a.replace("TMP", str(tmp)) for a in argv]
        with contextlib.redirect_stderr(err):
            try:
                code = cli(args)
            except SystemExit as leaving:  # argparse's own errors
                code = leaving.code
        assert code == 2, (code, err.getvalue())
        raise RuntimeError(err.getvalue())

    return run


def _file(name: str, text: str, then: Callable[[Path], object]) -> Callable[[Path], object]:
    def make(tmp: Path) -> object:
        (tmp / name).write_text(text)
        return then(tmp)

    return make


def _profile_text(f2: str = "1.5", edges: bool = True) -> str:
    text = NODE.format(id="node1", f="1.5") + "\n" + NODE.format(id="node2", f=f2) + "\n"
    return text + ("\tnode1 -- node2\n" if edges else "")


class _NoPipeline(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 2)


class _Foreign(_NoPipeline):
    def configure_pipeline(self) -> nn.Sequential:
        return nn.Sequential(self.layer, nn.ReLU())  # the ReLU is nobody's submodule


class _ListPipeline(_NoPipeline):
    def configure_pipeline(self) -> list:
        return [self.layer]


class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x, x


def _tuple_handed_on(tmp: Path) -> object:
    from pl_pipedream.profile import profile_layers

    return profile_layers(
        nn.Sequential(nn.Linear(6, 8), _Pair(), nn.Linear(8, 3)), torch.ones(4, 6)
    )


def _config(*overrides: str) -> object:
    from tests.apps.test_train import composed

    return composed(*overrides)


def _shards_missing(tmp: Path) -> object:
    root = tmp / "ckpt"
    root.mkdir()
    (root / "pipeline.json").write_text(json.dumps({"shards": ["stage-00.pt", "stage-01.pt"]}))
    torch.save({"state_dict": {}}, root / "stage-00.pt")
    return consolidate_checkpoint(root)


PLAN_2BW = Plan.from_balance([1, 1, 1]).to_json()

ROWS = {
    # ----- model --------------------------------------------------------------------------
    "model without configure_pipeline": Row(
        "model",
        "no `configure_pipeline`",
        lambda tmp: pipeline_layers(_NoPipeline()),
        ("has no configure_pipeline", "def configure_pipeline(self)"),
    ),
    "configure_pipeline returns a list": Row(
        "model",
        "`configure_pipeline` returns a list",
        lambda tmp: pipeline_layers(_ListPipeline()),
        ("must return a non-empty nn.Sequential", "returned: list"),
    ),
    "layer that is not a submodule": Row(
        "model",
        "a pipeline layer made inside `configure_pipeline`",
        lambda tmp: pipeline_layers(_Foreign()),
        ("must be a submodule", "layer 1: ReLU", "assign it to an attribute"),
    ),
    "layer that cannot take the tuple before it": Row(
        "model",
        "a layer returns a tuple the next layer cannot take",
        _tuple_handed_on,
        (
            "takes the previous layer's output as its one argument",
            "layer 2: Linear, after layer 1: _Pair",
            "passed: tuple(Tensor(4, 8) float32, Tensor(4, 8) float32)",
            "unpack it inside forward",
        ),
    ),
    # ----- batch --------------------------------------------------------------------------
    "batch size not a multiple of microbatches": Row(
        "batch",
        "batch of 5 with `microbatches=2`",
        lambda tmp: slice_batch((torch.zeros(5, 2), torch.zeros(5)), 2),
        ("equal microbatches", "batch size: 5, microbatches: 2", "drop_last=True"),
    ),
    "batch that is a string": Row(
        "batch",
        "a batch that is neither (inputs, targets) nor a tensor",
        lambda tmp: first_stage_input(nn.Module(), "text"),
        ("(inputs, targets) or a tensor", "got: str", "pipeline_split_batch"),
    ),
    # ----- strategy arguments -------------------------------------------------------------
    "unknown sync mode": Row(
        "config",
        "`PipeDreamStrategy(sync='fast')`",
        lambda tmp: PipeDreamStrategy(sync="fast"),
        ("sync must be one of async, vertical_sync, 2bw, flush, gpipe", "sync: 'fast'"),
    ),
    "microbatches zero": Row(
        "config",
        "`PipeDreamStrategy(microbatches=0)`",
        lambda tmp: PipeDreamStrategy(microbatches=0),
        ("microbatches must be a positive integer", "microbatches: 0", "microbatches=4"),
    ),
    "timeout zero": Row(
        "config",
        "`PipeDreamStrategy(timeout=0)`",
        lambda tmp: PipeDreamStrategy(timeout=0),
        ("timeout must be a positive number of seconds", "timeout: 0", "timeout=300"),
    ),
    "unknown start method": Row(
        "config",
        "`PipeDreamStrategy(start_method='thread')`",
        lambda tmp: PipeDreamStrategy(start_method="thread"),
        ("'popen', 'spawn' or 'fork'", "start_method: 'thread'"),
    ),
    "unknown divergence action": Row(
        "config",
        "`PipeDreamStrategy(divergence='loud')`",
        lambda tmp: PipeDreamStrategy(divergence="loud"),
        ("divergence must be one of error, strict, warn, off", "divergence: 'loud'"),
    ),
    "negative warm-up": Row(
        "config",
        "`PipeDreamStrategy(lr_warmup_per_delay=-1)`",
        lambda tmp: PipeDreamStrategy(lr_warmup_per_delay=-1),
        ("non-negative integer", "lr_warmup_per_delay: -1", "pass 0"),
    ),
    # ----- Hydra app config ---------------------------------------------------------------
    "devices zero in the Hydra app": Row(
        "config",
        "`pl-pipedream-train trainer.devices=0`",
        lambda tmp: num_processes(_config("trainer.devices=0").trainer),  # type: ignore[attr-defined]
        ("trainer.devices must be a positive number", "devices: 0", "trainer.devices=2"),
    ),
    "more processes than a server": Row(
        "config",
        "`pl-pipedream-train cluster=cluster_a trainer.devices=8`",
        lambda tmp: check_machine(_config("cluster=cluster_a", "trainer.devices=8")),  # type: ignore[arg-type]
        ("this run needs 8 processes", "innermost level holds 4 workers", "smoke=true"),
    ),
    "cluster topology of another size than the processes": Row(
        "config",
        "`pl-pipedream-train cluster=cluster_a trainer.num_nodes=2` (NODE_RANK set)",
        lambda tmp: check_machine(
            _config("cluster=cluster_a", "trainer.num_nodes=2"),  # type: ignore[arg-type]
            environ={"NODE_RANK": "0"},
        ),
        ("one worker per process", "topology workers: 2", "strategy.balance"),
    ),
    "smoke_settings not a mapping": Row(
        "config",
        "`pl-pipedream-train smoke=true smoke_settings=4`",
        lambda tmp: apply_smoke(_config("smoke=true", "smoke_settings=4")),  # type: ignore[arg-type]
        ("smoke_settings must be a block of config keys", "smoke_settings: 4"),
    ),
    # ----- CLI ----------------------------------------------------------------------------
    "plan without workers": Row(
        "CLI",
        "`pl-pipedream plan --profile graph.txt` (no --workers)",
        _file("graph.txt", _profile_text(), _run_cli("plan", "--profile", "TMP/graph.txt")),
        ("--workers and --bandwidth are required", "--workers 4 --bandwidth 1e9"),
    ),
    "simulate a missing plan file": Row(
        "CLI",
        "`pl-pipedream simulate --plan missing.json`",
        _run_cli("simulate", "--plan", "TMP/missing.json"),
        ("plan file must be a readable file", "missing.json", "--output"),
    ),
    "simulate a garbage plan file": Row(
        "CLI",
        "`pl-pipedream simulate --plan notes.txt` (not JSON)",
        _file("notes.txt", "hello", _run_cli("simulate", "--plan", "TMP/notes.txt")),
        ("plan file must be JSON", "line 1 column 1", "--output"),
    ),
    "simulate with too few microbatches": Row(
        "CLI",
        "`pl-pipedream simulate --plan p.json --sync 2bw --microbatches 1` (3 stages)",
        _file(
            "p.json",
            PLAN_2BW,
            _run_cli("simulate", "--plan", "TMP/p.json", "--sync", "2bw", "--microbatches", "1"),
        ),
        ("2bw needs at least as many microbatches", "stages: 3", "--microbatches 3"),
    ),
    # also tests/apps/test_cli.py::test_simulate_rejects_an_unknown_mode
    "simulate an unknown mode": Row(
        "CLI",
        "`pl-pipedream simulate --sync fast`",
        _run_cli("simulate", "--plan", "TMP/p.json", "--sync", "fast"),
        ("invalid choice: 'fast'",),
    ),
    # ----- profile ------------------------------------------------------------------------
    "missing profile": Row(
        "profile",
        "`--profile` names no file",
        lambda tmp: Profile.load(tmp / "none.txt"),
        ("profile file cannot be read", "none.txt"),
    ),
    "malformed profile line": Row(  # more forms: tests/profile/test_graph.py
        "profile",
        "a `graph.txt` line with `forward_compute_time=abc`",
        _file("graph.txt", _profile_text(f2="abc"), lambda tmp: Profile.load(tmp / "graph.txt")),
        ("a graph.txt line must be", "graph.txt, line 2", "fix or regenerate"),
    ),
    "negative time in a profile": Row(
        "profile",
        "a layer with a negative forward time",
        _file("graph.txt", _profile_text(f2="-0.5"), lambda tmp: Profile.load(tmp / "graph.txt")),
        ("finite and non-negative", "node: node2, forward_ms: -0.5"),
    ),
    "profile without edges": Row(
        "profile",
        "a `graph.txt` of two nodes and no edge lines",
        _file("graph.txt", _profile_text(edges=False), lambda tmp: Profile.load(tmp / "graph.txt")),
        ("must have an edge", "nodes without edges: ['node1', 'node2']", "add the edges"),
    ),
    # also tests/profile/test_graph.py::test_cycle_raises_and_names_file
    "profile with a cycle": Row(
        "profile",
        "edges that form a cycle",
        _file(
            "graph.txt",
            _profile_text() + "\tnode2 -- node1\n",
            lambda tmp: Profile.load(tmp / "graph.txt"),
        ),
        ("must be acyclic", "graph.txt"),
    ),
    # ----- plan ---------------------------------------------------------------------------
    "more devices than layers": Row(
        "plan",
        "a straight pipeline of 4 workers for 3 layers",
        lambda tmp: make_plan(
            Profile.chain([1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]),
            Topology.flat(4, 1e9),
            straight=True,
        ),
        ("at most 3 stages for 3 layers", "use fewer devices or more microbatches"),
    ),
    "balance not covering the layers": Row(  # also tests/strategy/test_errors.py
        "plan",
        "`balance=[3, 2]` for 6 layers",
        lambda tmp: Plan.from_balance([3, 2], [str(i) for i in range(6)]),
        ("layers: 6, sum of balance: 5", "change balance"),
    ),
    "memory limit zero": Row(
        "plan",
        "`pl-pipedream plan --memory 0`",
        lambda tmp: make_plan(
            Profile.chain([1, 1], [1, 1], [1, 1], [1, 1]), Topology.flat(2, 1e9), memory=0.0
        ),
        ("memory per worker must be positive", "memory: 0.0"),
    ),
    "2bw with fewer microbatches than stages": Row(
        "plan",
        "`sync='2bw'` with 2 microbatches on 3 stages",
        lambda tmp: SegmentStream(Plan.from_balance([1, 1, 1]), "2bw", 2),
        ("2bw needs at least as many microbatches", "use microbatches=3"),
    ),
    "topology lists of different lengths": Row(
        "plan",
        "`--workers 2 2 --bandwidth 1e9`",
        lambda tmp: Topology.from_lists([2, 2], [1e9]),
        ("one bandwidth per level", "workers: [2, 2]"),
    ),
    # ----- the plain engine ---------------------------------------------------------------
    "engine optimizer given built": Row(
        "config",
        "`Pipeline(layers, ..., optimizer=torch.optim.SGD(other.parameters(), lr=0.1))`",
        lambda tmp: Pipeline(
            nn.Sequential(nn.Linear(2, 2)),
            nn.functional.mse_loss,
            torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1),  # type: ignore[arg-type]
        ),
        ("must hold only the layers' parameters", "SGD with 2 parameters not in layers"),
    ),
    "engine without a layout": Row(
        "plan",
        "`Pipeline(...)` with neither `balance=`, `plan=` nor `example_input=`",
        lambda tmp: choose_plan(None, None, 3, 2),
        ("layout must be given as balance= or plan=", "none given", "example_input=x"),
    ),
    # ----- checkpoint ---------------------------------------------------------------------
    "checkpoint path that is no checkpoint": Row(
        "checkpoint",
        "`consolidate_checkpoint('nowhere')`",
        lambda tmp: consolidate_checkpoint(tmp / "nowhere"),
        ("a directory with pipeline.json", "path:", "trainer.save_checkpoint"),
    ),
    "checkpoint missing a shard": Row(
        "checkpoint",
        "a checkpoint directory without stage 1's shard",
        _shards_missing,
        ("needs every stage's shard", "stage-01.pt", "did not finish saving"),
    ),
}

# Rows whose error needs real ranks, covered by multi-process tests (kind "run" in docs/errors.md):
# a rank killed mid-run -> tests/strategy/test_errors.py::test_a_dead_rank_is_named_by_the_others;
# devices unlike the plan -> tests/strategy/test_errors.py::test_devices_different_from_the_plan;
# a rank failing after fit -> tests/strategy/test_launcher.py.


def message_of(row: Row, tmp: Path) -> str:
    """The error ``row`` raises (its text), or a failure if it raises nothing."""
    try:
        row.make(tmp)
    except Exception as error:  # noqa: BLE001 - every kind of error the rows give
        return str(error)
    raise AssertionError(f"no error for: {row.bad}")


def test_the_table_has_twenty_rows_over_every_kind() -> None:
    assert len(ROWS) >= 20
    kinds = {row.kind for row in ROWS.values()}
    assert kinds == {"model", "batch", "config", "CLI", "profile", "plan", "checkpoint"}


@pytest.mark.parametrize("name", list(ROWS))
def test_a_bad_input_gets_its_error(name: str, tmp_path: Path) -> None:
    row = ROWS[name]
    text = message_of(row, tmp_path)
    assert "Traceback" not in text, text
    for word in row.words:
        assert word in text, (word, text)


def errors_table() -> list[tuple[str, str, str]]:
    """docs/errors.md's table: (input, what is wrong, the error) per row."""
    rows = []
    for line in ERRORS_PAGE.read_text().splitlines():
        if not line.startswith("| ") or line.startswith(("| input", "|---")):
            continue
        kind, bad, error = (cell.strip() for cell in line.strip().strip("|").split(" | ", 2))
        rows.append((kind, bad, error))
    return rows


def test_the_errors_page_lists_every_row_with_its_key_words() -> None:
    table = errors_table()
    listed = {(kind, bad): error for kind, bad, error in table if kind != "run"}
    assert list(listed) == [(row.kind, row.bad) for row in ROWS.values()]
    for row in ROWS.values():
        error = listed[(row.kind, row.bad)]
        for word in row.words:
            assert word in error, (row.bad, word, error)
    assert sum(kind == "run" for kind, _, _ in table) == 3  # the multi-process rows above


if __name__ == "__main__":  # print every row's message, for docs/errors.md
    import tempfile

    for row in ROWS.values():
        with tempfile.TemporaryDirectory() as tmp:
            print(f"{row.kind} | {row.bad} | {message_of(row, Path(tmp)).strip()}", file=sys.stdout)
