"""Memory per stage: the limit the planner gets, the plan it then picks, and what a fit reports."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from pl_pipedream.core.memory_report import StageMemory, estimate, render
from pl_pipedream.planner.plan import Plan, Stage
from pl_pipedream.schedule.modes import SyncMode
from tests.core.test_memory_limit import make
from tests.runtime import oracle
from tests.runtime.launched import Rank, launch
from tests.runtime.test_executor import OPTIMIZERS, loss_fn, make_batches, make_model
from tests.schedule.test_memory import LAYOUTS, built_counts
from tests.strategy import frames_script, memory_script, tied_script

MiB = 2**20


def sized(replicas: list[int]) -> Plan:
    """A pipeline of ``replicas`` whose every stage has 1 byte of weights and of activations."""
    plan = Plan.from_balance([1] * len(replicas), replicas=replicas)
    ones = {"parameter_bytes": 1.0, "activation_bytes": 1.0}
    return Plan(tuple(Stage(**{**s.__dict__, **ones}) for s in plan.stages))


@pytest.mark.parametrize("sync", list(SyncMode), ids=str)
def test_the_reported_counts_are_those_the_built_schedule_keeps(sync: SyncMode) -> None:
    """The estimate's versions (stashed / weights + 1) and minibatches in flight (activations /
    activation bytes) per stage equal the most any rank of the stage holds in the schedule."""
    for replicas in LAYOUTS:
        plan = sized(replicas)
        for microbatches in (1, 2, 4, 6, 12):
            try:
                built = built_counts(plan, sync, microbatches)
            except ValueError:  # counts the mode cannot serve
                continue
            reported = []
            for stage in plan.stages:
                weights, stashed, activations, _ = estimate(plan, stage, sync, microbatches, False)
                reported.append((int(stashed / weights) + 1, int(activations)))
            assert reported == built, (replicas, microbatches)


def test_the_estimate_follows_the_paper_rule_per_mode() -> None:
    plan = make(None)
    first = plan.stages[0]  # warm-up 1: two versions and two minibatches in flight
    w, a = first.parameter_bytes, first.activation_bytes
    assert estimate(plan, first, SyncMode.ASYNC, 4, False)[:3] == (w, w, 2 * a)
    assert estimate(plan, first, SyncMode.TWO_BW, 4, False)[:3] == (w, w, 2 * a)
    assert estimate(plan, first, SyncMode.FLUSH, 1, False)[:3] == (w, 0, a)
    assert estimate(plan, first, SyncMode.GPIPE, 8, False)[:3] == (w, 0, 8 * a)
    # recompute: inputs in flight (none profiled for the first stage) plus one replay
    assert estimate(plan, first, SyncMode.ASYNC, 4, True)[2] == a
    last = plan.stages[1]  # keeps its graph: its loss is the user's training_step
    assert estimate(plan, last, SyncMode.ASYNC, 4, True) == estimate(
        plan, last, SyncMode.ASYNC, 4, False
    )
    unprofiled = Plan.from_balance([2, 2])
    assert estimate(unprofiled, unprofiled.stages[0], SyncMode.ASYNC, 4, False) == (None,) * 4
    row = StageMemory(0, 0, MiB, 2 * MiB, 3 * MiB, 4 * MiB, None, MiB, MiB, MiB, None)
    table = render([row])
    assert "10.000" in table and "3.000" in table and "memory per stage" in table


def forked(
    world: int, main: Callable[[list[str]], object], argv: list[str], cwd: Path
) -> list[Rank]:
    """``main(argv)`` on ``world`` ranks forked from this process as a launcher starts them
    (``tests.runtime.launched``), working in ``cwd``."""
    return launch(world, lambda _: main(list(argv)), folder=cwd / "ranks", timeout=300, cwd=cwd)


def fit(tmp_path: Path, *args: str) -> list[Rank]:
    """``memory_script``'s ``main`` on 2 ranks forked from this process."""
    return forked(2, memory_script.main, ["--out", str(tmp_path), *args], tmp_path)


def succeeded(ranks: list[Rank]) -> str:
    """What the ranks printed, once each ended without an error."""
    for r, rank in enumerate(ranks):
        assert rank.code == 0, f"rank {r}: {rank.error}\n{rank.stderr[-3000:]}"
    return "".join(rank.output for rank in ranks)


def weights(out: Path) -> dict[str, torch.Tensor]:
    return {k: v for r in (0, 1) for k, v in torch.load(out / f"rank{r}.pt").items()}


@pytest.mark.slow
def test_a_fit_with_recompute_equals_the_oracle_and_reports_less_activation_memory(
    tmp_path: Path,
) -> None:
    configs = ["async:0:0", "async:1:0", "flush:1:0", "async:0:1", "async:1:1"]
    printed = succeeded(fit(tmp_path, "--configs", *configs))
    plan, m = Plan.from_balance([3, 3]), 2
    for sync in ("async", "flush"):
        expected = oracle.train(
            make_model(), plan, sync, make_batches(m), m, loss_fn, OPTIMIZERS["sgd"]
        )
        got = weights(tmp_path / f"{sync}-1-0")
        for key, tensor in expected.items():
            assert (got[f"net.{key}"] - tensor).abs().max().item() <= 1e-6, (sync, key)
    plain, recomputed = weights(tmp_path / "async-0-1"), weights(tmp_path / "async-1-1")
    for key, tensor in plain.items():  # dropout: the replay drew the same numbers
        assert torch.equal(tensor, recomputed[key]), key
    reports = {}
    for config in ("async-0-0", "async-1-0"):
        rows = json.loads((tmp_path / config / "report.json").read_text())["rows"]
        reports[config] = {row["rank"]: StageMemory(**row) for row in rows}
    for rank in (0, 1):
        row = reports["async-0-0"][rank]
        params = sum(p.numel() * 4 for p in list(make_model().parameters()))
        assert row.stage == rank and row.weights > 0 and row.activations > 0
        assert row.optimizer == row.weights  # SGD's momentum: one buffer per weight
        assert 0 < row.weights < params
    # stage 0 keeps two minibatches in flight; with recompute only their inputs
    assert reports["async-1-0"][0].activations < reports["async-0-0"][0].activations
    assert reports["async-0-0"][0].stashed > 0  # async stashes a second version
    assert "PipeDream memory per stage" in printed


@pytest.mark.slow
def test_an_automatic_plan_that_cannot_fit_stops_at_setup_naming_the_memory(
    tmp_path: Path,
) -> None:
    ranks = fit(tmp_path, "--memory", "64", "--devices", "2", "--configs", "async:0:0")
    assert any(rank.code != 0 for rank in ranks), [rank.code for rank in ranks]
    text = "".join(rank.error + rank.output for rank in ranks)
    assert "no pipeline fits the memory per device (memory: 64 bytes" in text, text[-3000:]
    need = float(text.split("the smallest that fits: ")[1].split(" bytes")[0])
    assert math.isfinite(need) and need > 64
    succeeded(fit(tmp_path, "--memory", str(int(need) + 1), "--devices", "2"))
    report = json.loads((tmp_path / "async-1-0" / "report.json").read_text())
    for stage in report["plan"]["stages"]:
        assert stage["activation_bytes"] > 0  # a profiled plan: the estimate is filled in
    assert all(row["estimate_weights"] is not None for row in report["rows"])


@pytest.mark.slow
def test_recompute_with_tied_parameters_equals_the_run_without(tmp_path: Path) -> None:
    """The tied parameter's version of a minibatch is kept with its weights for the replay
    (``tied_script``'s fits on ranks forked from this process)."""
    configs = ["async:sgd", "flush:sgd"]
    for flag, folder in (((), "plain"), (("--recompute",), "recomputed")):
        argv = ["--balance", "1", "3", "--configs", *configs, "--out", str(tmp_path / folder)]
        succeeded(forked(2, tied_script.main, [*argv, *flag], tmp_path))
    for config in ("async-sgd", "flush-sgd"):
        plain = torch.load(tmp_path / "plain" / config / "weights.pt")
        recomputed = torch.load(tmp_path / "recomputed" / config / "weights.pt")
        assert sorted(plain) == sorted(recomputed)
        for key, tensor in plain.items():
            assert (tensor - recomputed[key]).abs().max().item() <= 1e-6, (config, key)


@pytest.mark.slow
def test_the_reported_frames_are_those_the_channel_held(tmp_path: Path) -> None:
    """Three ranks over gloo, 32 KiB activations: each rank's channel held, at its peak, the
    estimate's frames (the schedule's messages in flight per link, one receive posted per
    link) to within 5 % (measured: 3.2-4.0 %): a frame adds its 512-byte header and 512 bytes
    of room to the 32 KiB it carries, and a link's first message comes after a 512-byte
    notice of its size."""
    argv = ["--out", str(tmp_path), "--devices", "3", "--syncs", "async", "flush"]
    printed = succeeded(forked(3, frames_script.main, argv, tmp_path))
    for sync in ("async", "flush"):
        rows = [StageMemory(**r) for r in json.loads((tmp_path / f"{sync}.json").read_text())]
        assert [r.rank for r in rows] == [0, 1, 2]
        for row in rows:
            pairs = (
                (row.frames_sent, row.estimate_frames_sent),
                (row.frames_received, row.estimate_frames_received),
            )
            for measured, estimated in pairs:
                assert estimated is not None and estimated > 0, (sync, row)
                assert estimated <= measured <= 1.05 * estimated, (sync, row)
    assert "frames" in printed  # the printed table's column
