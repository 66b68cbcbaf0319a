"""Eight processes in the suite: ``flush`` on a straight 8-stage pipeline equals one device, and a
SIGKILL of a middle rank is named first by the launcher's report.

One launch of ``fit_script.py`` (``--model deep``: one Linear block per stage) serves both tests,
since eight ranks on a loaded 2-core machine take most of a minute to start: it trains ``flush``
with SGD and consolidates the weights, then runs a second fit (``async``) in which rank 3 (stage
3) SIGKILLs itself at the start of step 2, so the command ends with the report.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from pl_pipedream.planner.plan import Plan
from tests.runtime import oracle
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches
from tests.strategy.test_fit import launch
from tests.strategy.test_launcher import report_of

STAGES = 8
MICROBATCHES = 4
KILLED = 3
TOLERANCE = 1e-6  # measured: 3.0e-8 against both (one device and the oracle agree bit for bit)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, subprocess.CompletedProcess]:
    out = tmp_path_factory.mktemp("eight")
    extra = ["--model", "deep", "--kill-rank", str(KILLED), "--kill-at", "2", "--timeout", "120"]
    result = launch(out, [1] * STAGES, None, MICROBATCHES, ["flush:sgd"], extra=extra)
    return out, result


@pytest.mark.slow
def test_flush_on_eight_stages_equals_one_device_and_the_oracle(eight) -> None:  # type: ignore[no-untyped-def]
    from lightning.pytorch import Trainer

    from tests.strategy.fit_script import DeepNet, deep_model

    out, result = eight
    weights = out / "flush-sgd" / "weights.pt"
    assert weights.is_file(), result.stderr[-3000:]
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
def test_a_killed_middle_rank_of_eight_is_named_first_and_the_command_exits_1(eight) -> None:  # type: ignore[no-untyped-def]
    """Its neighbours fail with a PeerError naming it; the report leads with rank 3 itself and
    lists the seven others after it; the exit status is 1, not 0 nor Lightning's 137."""
    _, result = eight
    assert result.returncode == 1, (result.returncode, result.stderr[-3000:])
    assert "Forcefully terminating" not in result.stderr
    report = report_of(result.stderr)
    lead = f"pl-pipedream: rank {KILLED} failed (killed by SIGKILL); its error:"
    assert report[0] == lead, report
    others = [line for line in report[1:] if line.startswith("pl-pipedream: rank")]
    assert sorted(int(line.split()[2]) for line in others) == [0, 1, 2, 4, 5, 6, 7], others
