"""Eight processes in the suite: ``flush`` on a straight 8-stage pipeline equals one device, and a
SIGKILL of a middle rank is named first by the report over the ranks' ends.

One launch of ``fit_script.py``'s ``main`` on eight ranks forked from this process, as a
launcher starts them (``tests.runtime.launched``; ``--model deep``: one Linear block per stage),
serves both tests: it trains ``flush`` with SGD and consolidates the weights, then runs a second
fit (``async``) in which rank 3 (stage 3) SIGKILLs itself at the start of step 2. Each rank
records its uncaught error as under the strategy's launcher (``PL_PIPEDREAM_ERRORS``), and the
report is rendered from those records and the ranks' statuses as that launcher renders it
(``runtime.processes.render``); that launcher's own watching of the ranks and its exit status
are tested on four ranks in test_launcher.py.
"""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.planner.plan import Plan
from pl_pipedream.runtime.processes import ERRORS_VARIABLE, RankEnd, render
from tests.runtime import oracle
from tests.runtime.launched import Rank, launch
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches
from tests.strategy import fit_script

STAGES = 8
MICROBATCHES = 4
KILLED = 3
TOLERANCE = 1e-6  # measured: 3.0e-8 against both (one device and the oracle agree bit for bit)


def script_rank(rank: int, argv: list[str]) -> None:
    fit_script.main(argv)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Rank], Path]:
    """The launch's folder, how each rank ended, and the folder of their recorded errors."""
    out = tmp_path_factory.mktemp("eight")
    errors = out / "errors"
    errors.mkdir()
    argv = ["--balance", *["1"] * STAGES, "--microbatches", str(MICROBATCHES), "--out", str(out)]
    argv += ["--configs", "flush:sgd", "--model", "deep", "--timeout", "60"]
    argv += ["--kill-rank", str(KILLED), "--kill-at", "2"]
    env = {ERRORS_VARIABLE: str(errors)}
    ranks = launch(STAGES, script_rank, argv, folder=out / "ranks", timeout=300, env=env)
    return out, ranks, errors


@pytest.mark.slow
def test_flush_on_eight_stages_equals_one_device_and_the_oracle(eight) -> None:  # type: ignore[no-untyped-def]
    from lightning.pytorch import Trainer

    from tests.strategy.fit_script import DeepNet, deep_model

    out, ranks, _ = eight
    weights = out / "flush-sgd" / "weights.pt"
    assert weights.is_file(), ranks[0].stderr[-3000:]
    got = torch.load(weights)
    reference = DeepNet(STAGES)
    one = Trainer(
        accelerator="cpu",
        devices=1,
        max_epochs=1,
        accumulate_grad_batches=MICROBATCHES,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        enable_checkpointing=False,
    )
    batches = make_batches(MICROBATCHES)
    rows = TensorDataset(torch.cat([b[0] for b in batches]), torch.cat([b[1] for b in batches]))
    microbatch = len(batches[0][0]) // MICROBATCHES
    one.fit(reference, DataLoader(rows, batch_size=microbatch))  # the same rows, accumulated
    assert sorted(got) == sorted(reference.state_dict())
    for key, tensor in reference.state_dict().items():
        diff = (got[key] - tensor).abs().max().item()
        assert diff <= TOLERANCE, f"flush against one device {key}: {diff}"
    plan = Plan.from_balance([1] * STAGES)
    expected = oracle.train(
        deep_model(STAGES), plan, "flush", batches, MICROBATCHES, loss_fn, OPTIMIZERS["sgd"]
    )
    for key, tensor in expected.items():
        diff = (got[f"net.{key}"] - tensor).abs().max().item()
        assert diff <= TOLERANCE, f"flush against the oracle {key}: {diff}"


@pytest.mark.slow
def test_a_killed_middle_rank_of_eight_is_named_first(eight) -> None:  # type: ignore[no-untyped-def]
    """Its neighbours fail with a PeerError naming it; the report leads with rank 3 itself and
    lists the seven others after it."""
    _, ranks, errors = eight
    assert ranks[KILLED].code == -signal.SIGKILL, [rank.code for rank in ranks]
    assert all(rank.code == 1 for r, rank in enumerate(ranks) if r != KILLED), ranks
    for neighbour in (KILLED - 1, KILLED + 1):
        entry = json.loads((errors / f"rank-{neighbour}.json").read_text())
        assert entry["kind"] == "PeerError" and f"rank {KILLED}" in entry["message"], entry
    for r, rank in enumerate(ranks):  # each survivor's first error line is ours, not gloo's
        if r != KILLED:
            first = next(line for line in rank.stderr.splitlines() if "Error:" in line)
            assert "PeerError: " in first and "pair.cc" not in first, first
    ends = []
    for r, rank in enumerate(ranks):  # as the launcher reads them (RankProcesses._end)
        end = RankEnd(r, rank.code, rank.at)
        recorded = errors / f"rank-{r}.json"
        if recorded.is_file():
            entry = json.loads(recorded.read_text())
            end.kind, end.text, end.message = entry["kind"], entry["text"], entry["message"]
            end.at = min(end.at, float(entry["time"]))
        ends.append(end)
    report = render(ends).splitlines()
    lead = f"pl-pipedream: rank {KILLED} failed (killed by SIGKILL); its error:"
    assert report[0] == lead, report
    others = [line for line in report[1:] if line.startswith("pl-pipedream: rank")]
    assert sorted(int(line.split()[2]) for line in others) == [0, 1, 2, 4, 5, 6, 7], others
